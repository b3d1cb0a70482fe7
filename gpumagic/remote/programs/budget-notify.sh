# Reach the alert program gpumagic installed on this machine (~/.gpumagic/notify/notify.py with
# its settings, config.json; see gpumagic/budget/notify.py and budget-notify-install.py):
#
#   config        print its settings (nothing when alerts are not set up)
#   log LINES     the last LINES lines of its log, then `outbox N` (messages waiting to be sent)
#   run ARGS...   run it with ARGS (stdin passes through; its answer is one JSON line)
# shellcheck shell=sh

d="$HOME/.gpumagic/notify"
case "$1" in
  config) cat "$d/config.json" 2>/dev/null ;;
  log)
    tail -n "$2" "$d/log" 2>/dev/null
    n=0
    for f in "$d"/outbox/*.json; do [ -e "$f" ] && n=$((n + 1)); done
    echo "outbox $n" ;;
  run)
    shift
    py=$(gm_python) || { echo "gpumagic: no python3 on the machine" >&2; exit 127; }
    exec "$py" "$d/notify.py" "$@" ;;
  *) echo "usage: budget-notify.sh config | log LINES | run ARGS..." >&2; exit 2 ;;
esac
