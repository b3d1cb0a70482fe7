# gpumagic: list the kernels kept in ~/.gpumagic/kernels (see kernel_keeper.py), in one round
# trip, for gpumagic/remote/kernel/info.py's parse_listing.  For each kernel directory: a line
# "\036kernel NAME", its state.json, then "alive" when its keeper still runs (its pid is a
# process whose command line names the keeper) or "gone".  Then the GPU processes
# ("\036gpu-status" with nvidia-smi's exit status, "\036gpu" with
# nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits) and the
# process groups ("\036ps": ps -e -o pid=,pgid=).
root="$HOME/.gpumagic/kernels"
for d in "$root"/*/; do
  [ -f "${d}state.json" ] || continue
  name=${d%/}
  name=${name##*/}
  printf '\036kernel %s\n' "$name"
  cat "${d}state.json"
  echo
  pid=$(sed -n 's/.*"keeper_pid": *\([0-9][0-9]*\).*/\1/p' "${d}state.json")
  alive=gone
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    if [ -r "/proc/$pid/cmdline" ]; then
      tr '\000' ' ' < "/proc/$pid/cmdline" | grep -q 'kernel_keeper' && alive=alive
    else
      alive=alive
    fi
  fi
  echo "$alive"
done
gpu=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
printf '\036gpu-status\n%s\n' "$?"
printf '\036gpu\n'
[ -n "$gpu" ] && printf '%s\n' "$gpu"
printf '\036ps\n'
ps -e -o pid=,pgid= 2>/dev/null
exit 0
