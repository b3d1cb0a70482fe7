# shutdown-find.sh: can this machine shut itself down, and how (gpumagic/budget/shutdown.py
# reads the last line).  Prints one of:
#   ok COMMAND      the command that powers the machine off (prefixed "sudo -n " when needed)
#   noroot nosudo   not root, and no sudo on PATH
#   noroot sudo exit CODE LINE
#                   not root, and `sudo -n true` failed with CODE; LINE is the first line it
#                   printed (empty when it printed nothing)
#   nocmd           neither shutdown nor poweroff exists (on PATH or off it: gm_find)
#   noinit INIT     the command is the distribution's own but PID 1 (INIT) is no init system
# shellcheck shell=sh
priv=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "noroot nosudo"; exit 0; }
  if said=$(sudo -n true 2>&1 </dev/null); then priv="sudo -n "
  else
    rc=$?
    nl='
'
    echo "noroot sudo exit $rc ${said%%"$nl"*}"; exit 0
  fi
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
