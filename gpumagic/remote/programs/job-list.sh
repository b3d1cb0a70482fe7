# gpumagic job listing (gpumagic/remote/jobs.py: list_jobs, parse_listing).
#
#   job-list.sh SCAN_BYTES NAME_OR_EMPTY ALERT_ERE...
#
# Prints a `now<TAB>EPOCH` line, then per job (all of ~/.gpumagic/jobs, or only NAME) a
# `job<TAB>NAME` line followed by `KEY<TAB>VALUE` lines: the job directory's small files, `alive`
# while it runs (gm_job_running), `last` (its log's last non-blank line, not a notify line),
# `alert` lines (the first two lines of the log's last SCAN_BYTES bytes matching each ERE, case-insensitive) and,
# for one machine's part of a torchrun job (its command exports GPUMAGIC_TORCHRUN_DIR), a
# `torchrun<TAB>1` line and a `rank<TAB>GLOBAL LOCAL` line per rank that started here (~/.gpumagic/torchrun/NAME/ranks/,
# written by torchrun_rank.py).
# shellcheck shell=sh
scan=$1 only=$2
shift 2
printf 'now\t%s\n' "$(date +%s)"
base=$HOME/.gpumagic/jobs
[ -d "$base" ] || exit 0
for d in "$base"/*; do
  [ -d "$d" ] || continue
  n=${d##*/}
  [ -z "$only" ] || [ "$n" = "$only" ] || continue
  printf 'job\t%s\n' "$n"
  for f in started ended exit_code killed runner shutdown shutdown_started shutdown_cancelled \
           shutdown_command stop_on no_alerts; do
    [ -e "$d/$f" ] && printf '%s\t%s\n' "$f" "$(head -c 300 "$d/$f" | head -n 1)"
  done
  [ -e "$d/stopped_by" ] && printf 'stopped_by\t%s\n' "$(head -n 1 "$d/stopped_by" | cut -c1-300)"
  gm_job_running "$d" && printf 'alive\t1\n'
  if grep -q GPUMAGIC_TORCHRUN_DIR "$d/command" 2>/dev/null; then
    printf 'torchrun\t1\n'
    for f in "$HOME/.gpumagic/torchrun/$n/ranks"/*; do
      [ -f "$f" ] && read -r l _ < "$f" && printf 'rank\t%s %s\n' "${f##*/}" "$l"
    done
  fi
  [ -f "$d/log" ] || continue
  # (gpumagic's own "TIME notify: ..." lines, written after the job ended, are not its output)
  printf 'last\t%s\n' "$(tail -c 4096 "$d/log" | tr '\r' '\n' | grep -a -v -E -e '^[[:space:]]*$' \
    -e '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}Z notify: ' | tail -n 1 | cut -c1-300)"
  for are in "$@"; do
    tail -c "$scan" "$d/log" | tr '\r' '\n' | grep -a -i -E -m 2 -e "$are" | cut -c1-300 |
      while IFS= read -r l; do printf 'alert\t%s\n' "$l"; done
  done
done
