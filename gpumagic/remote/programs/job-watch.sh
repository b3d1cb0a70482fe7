# gpumagic --stop-on watcher: installed (after lib.sh) as watch.sh in the job's directory and
# started there by run.sh next to the job.  It follows the log with `grep -E -i` and, at the
# first line matching stop_on_re, records it in stopped_by and runs `kill.sh KIND` (the kind
# whose own pattern, stop_on_re.KIND, matches that line).
# shellcheck shell=sh
umask 077  # what it writes in the job's directory is private, as the rest there
re=$(cat stop_on_re)
rm -f watch.fifo; mkfifo watch.fifo || exit 0
tail -n +1 -f log > watch.fifo 2>/dev/null &
t=$!
grep -a -i -E -m 1 -e "$re" < watch.fifo > stopped_by.tmp
found=$?
kill $t 2>/dev/null
rm -f watch.fifo
[ "$found" = 0 ] || exit 0
line=$(head -n 1 stopped_by.tmp)
kind=user
for k in $(tr ',' ' ' < stop_on); do
  if printf '%s\n' "$line" | grep -a -q -i -E -e "$(cat "stop_on_re.$k")"; then kind=$k; break; fi
done
mv stopped_by.tmp stopped_by
exec /bin/sh ./kill.sh "$kind"
