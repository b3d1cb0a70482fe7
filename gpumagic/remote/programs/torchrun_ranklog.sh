# torchrun_ranklog.sh DIR LOCAL_RANK STREAM LINES: the last LINES lines (0: all) of local rank
# LOCAL_RANK's STREAM (stdout or stderr) in the newest torchrun --log-dir run under DIR/logs
# (torchrun's layout: logs/RUN_ID/attempt_N/LOCAL_RANK/STREAM.log).  Nothing when there is none.
d=$1; l=$2; s=$3; n=$4
# shellcheck disable=SC2088  # a literal "~/" prefix, replaced by $HOME
case $d in "~/"*) d=$HOME/${d#"~/"} ;; esac
# shellcheck disable=SC2012  # the names are torchrun's own (no newlines)
f=$(ls -1t "$d"/logs/*/attempt_*/"$l"/"$s".log 2>/dev/null | head -n 1)
[ -n "$f" ] || exit 0
if [ "$n" = 0 ]; then cat "$f"; else tail -n "$n" "$f"; fi
