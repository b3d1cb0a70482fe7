# Can this machine shut itself down, and how (gpumagic/budget/shutdown.py reads the answer):
# one line, `ok COMMAND`, `noroot`, `nocmd` or `noinit PID1_NAME`.
#
# 1. privilege: root, or `sudo -n true` succeeds (then the command is prefixed `sudo -n`);
# 2. a command: `shutdown` (run as `shutdown -h now`), else `poweroff`, on PATH or where a
#    non-login PATH leaves them out (/sbin, /usr/sbin: gm_find);
# 3. it can act: PID 1 is an init system (systemd, init), or the command found is not the
#    distribution's own (not under /sbin, /usr/sbin, /bin, /usr/bin): a wrapper the user or
#    platform put earlier on PATH is trusted to know what it does.
# shellcheck shell=sh

priv=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then priv="sudo -n "; else echo "noroot"; exit 0; fi
fi
if cmd=$(gm_find shutdown); then
  args=" -h now"
elif cmd=$(gm_find poweroff); then
  args=""
else
  echo "nocmd"; exit 0
fi
init=$(cat /proc/1/comm 2>/dev/null)
case "$cmd" in
  /sbin/*|/usr/sbin/*|/bin/*|/usr/bin/*)
    case "$init" in systemd|init) ;; *) echo "noinit $init"; exit 0 ;; esac ;;
esac
echo "ok ${priv}${cmd}${args}"
