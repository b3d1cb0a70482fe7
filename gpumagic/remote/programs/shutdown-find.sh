# shutdown-find.sh: can this machine shut itself down, and how (gpumagic/budget/shutdown.py
# reads the last line).  Prints one of:
#   ok COMMAND      the command that powers the machine off (prefixed "sudo -n " when needed)
#   noroot          not root and `sudo -n` needs a password
#   nocmd           neither shutdown nor poweroff exists (on PATH or off it: gm_find)
#   noinit INIT     the command is the distribution's own but PID 1 (INIT) is no init system
# shellcheck shell=sh
priv=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then priv="sudo -n "; else echo "noroot"; exit 0; fi
fi
if cmd=$(gm_find shutdown); then args=" -h now"
elif cmd=$(gm_find poweroff); then args=""
else echo "nocmd"; exit 0
fi
init=$(cat /proc/1/comm 2>/dev/null)
case "$cmd" in
  /sbin/*|/usr/sbin/*|/bin/*|/usr/bin/*)
    case "$init" in systemd|init) ;; *) echo "noinit $init"; exit 0 ;; esac ;;
esac
echo "ok ${priv}${cmd}${args}"
