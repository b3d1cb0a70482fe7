# gpumagic-guard: shuts this machine down at a budget limit, a deadline, or after the GPU has
# been idle; armed and cancelled by gpumagic (%gpu budget guard; gpumagic/budget/guard.py),
# which installs lib.sh and this file as DIR/gpumagic-guard.sh (budget-guard-ctl.sh arm).
#
#   sh gpumagic-guard.sh run DIR [SETTING=VALUE...]    the guard (started detached)
#   sh gpumagic-guard.sh measure [SETTING=VALUE...]    one measurement, printed
#
# Settings: idle_s, limit_in, deadline_in (seconds from now; empty: that trigger is off),
# grace_s (warn this long before acting), poll_s (seconds between checks), idle_util (GPU
# utilisation % below which it is idle), busy_mem_mib (GPU memory held by no visible process
# above which it is busy), shutdown (the command that powers the machine off), jobs_dir
# (gpumagic's jobs, default ~/.gpumagic/jobs).
#
# Measured idle: `nvidia-smi --query-gpu=utilization.gpu,memory.used` and
# `--query-compute-apps=pid,used_memory` (`--format=csv,noheader,nounits`; field names from
# `nvidia-smi --help-query-gpu` / `--help-query-compute-apps`) both succeed, every value is a
# plain number, every GPU's utilisation is below idle_util %, GPU memory not held by a visible
# process is at most busy_mem_mib (memory used by processes we cannot see, e.g. another
# container's, means busy), no gpumagic job runs (a job runs while its JOBS_DIR/NAME/pid is
# alive and its exit_code is absent), no %%remote cell runs (~/.gpumagic/running, kept by
# exec-runner.py), and no live session (%gpu kernel) is executing a cell.  An SSH login
# alone is not measured: it keeps nothing alive.  Anything else -- nvidia-smi failing, `[N/A]`, no GPU
# listed, one GPU of several lost -- is *not* idle.  Exit status 14 ("infoROM is corrupted",
# nvidia-smi(1)) with valid rows is measured like 0: the warning line it prints is skipped.
#
# State file DIR/state (key=value lines, replaced atomically each poll): state, since,
# checked, checks, fire_at, reason, idle, and the settings.  DIR/alert holds the warning while
# a shutdown is pending; DIR/log the history.  When `%gpu budget notify` set alerts up
# (gpumagic/budget/notify.py), the warning and a failed shutdown are also sent from here.
# shellcheck shell=sh

IDLE_S='' LIMIT_IN='' DEADLINE_IN='' GRACE_S=600 POLL_S=30 IDLE_UTIL=5 BUSY_MEM_MIB=64
SHUTDOWN_CMD='' JOBS_DIR="$HOME/.gpumagic/jobs"

settings() {
  for _a in "$@"; do
    case "$_a" in
      idle_s=*) IDLE_S=${_a#*=} ;;
      limit_in=*) LIMIT_IN=${_a#*=} ;;
      deadline_in=*) DEADLINE_IN=${_a#*=} ;;
      grace_s=*) GRACE_S=${_a#*=} ;;
      poll_s=*) POLL_S=${_a#*=} ;;
      idle_util=*) IDLE_UTIL=${_a#*=} ;;
      busy_mem_mib=*) BUSY_MEM_MIB=${_a#*=} ;;
      shutdown=*) SHUTDOWN_CMD=${_a#*=} ;;
      jobs_dir=*) JOBS_DIR=${_a#*=} ;;
      *) echo "gpumagic-guard: unknown setting $_a" >&2; exit 2 ;;
    esac
  done
}

# why nvidia-smi failed: its first line that is not a row, and its exit status
smi_failed() {
  printf '%s (exit status %s)\n' "$(printf '%s\n' "$2" | grep -v -E '^[0-9., ]*$' | grep -v '^WARNING: infoROM' | head -n 1)" "$1"
}

measure() {
  smi=$(gm_find nvidia-smi) || smi=nvidia-smi  # not found: the shell says so, measured as unknown
  # Exit status 14 means "infoROM is corrupted" (nvidia-smi(1)): a warning printed beside
  # valid rows.  Any other non-zero status is a failure (a GPU of several lost: not idle).
  gpu=$("$smi" --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits 2>&1); rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 14 ]; then
    echo "unknown nvidia-smi failed: $(smi_failed "$rc" "$gpu")"; return
  fi
  apps=$("$smi" --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>&1); rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 14 ]; then
    echo "unknown nvidia-smi --query-compute-apps failed: $(smi_failed "$rc" "$apps")"; return
  fi
  for d in "$JOBS_DIR"/*/; do
    [ -f "${d}pid" ] || continue
    [ -e "${d}exit_code" ] && continue
    p=$(cat "${d}pid" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) continue ;; esac
    if gm_alive "$p"; then
      echo "busy gpumagic job $(basename "$d") is running (pid $p)"; return
    fi
  done
  # a %%remote cell running: exec-runner.py keeps RUNNING/RUNNERPID-CELLPID while it runs (a
  # file whose runner or cell is gone is left from a killed runner: not counted)
  for f in "${JOBS_DIR%/jobs}/running"/*; do
    [ -f "$f" ] || continue
    b=${f##*/}; r=${b%%-*}; c=${b#*-}
    case "$r" in ''|*[!0-9]*) continue ;; esac
    case "$c" in ''|*[!0-9]*) continue ;; esac
    if gm_alive "$r" && gm_alive "$c"; then
      echo "busy a gpumagic cell is running (pid $c)"; return
    fi
  done
  # a live Python session (%gpu kernel) executing a cell: its keeper keeps a `busy` file
  # while a cell runs (see gpumagic/remote/programs/kernel_keeper.py)
  for d in "${JOBS_DIR%/jobs}/kernels"/*/; do
    [ -f "${d}busy" ] || continue
    p=$(sed -n 's/.*"keeper_pid": *\([0-9][0-9]*\).*/\1/p' "${d}state.json" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) continue ;; esac
    if gm_alive "$p" && { [ ! -d "/proc/$p" ] || tr '\000' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q kernel_keeper; }; then
      echo "busy gpumagic kernel $(basename "$d") is executing a cell"; return
    fi
  done
  printf '%s\n--\n%s\n' "$gpu" "$apps" | awk -F', *' -v thr="$IDLE_UTIL" -v slack="$BUSY_MEM_MIB" '
    function num(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s ~ /^[0-9]+(\.[0-9]+)?$/ }
    BEGIN { part = 0; n = 0; used = 0; maxu = 0; apps = 0; appmem = 0; appunk = 0; bad = "" }
    /^--$/ { part = 1; next }
    /^[ \t]*$/ { next }
    /^WARNING: infoROM is corrupted/ { next }
    part == 0 {
      if (NF != 2 || !num($1) || !num($2)) { if (bad == "") bad = $0; next }
      n++; if ($1 + 0 > maxu) maxu = $1 + 0; used += $2
      next
    }
    { apps++; if (NF >= 2 && num($2)) appmem += $2; else appunk = 1 }
    END {
      if (bad != "") { print "unknown unreadable nvidia-smi value: " bad; exit }
      if (n == 0) { print "unknown nvidia-smi listed no GPU"; exit }
      why = ""
      if (!appunk && used - appmem > slack)
        why = sprintf("%d MiB of GPU memory in use by no visible process", used - appmem)
      if (maxu >= thr)
        why = (why == "" ? "" : why "; ") sprintf("GPU utilisation %d%% (idle below %d%%)", maxu, thr)
      if (why != "") { print "busy " why; exit }
      printf "idle GPU utilisation %d%%, %d MiB used, %d visible process(es)\n", maxu, used, apps
    }'
}

log() { printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >> "$dir/log"; }

# notify EVENT TEXT [OPTION...]: send an alert from this machine, in the background (it never
# holds the guard up), when `%gpu budget notify` set alerts up; the result goes to the log.
notify() {
  [ -f "$HOME/.gpumagic/notify/config.json" ] || return 0
  _py=$(gm_python) || return 0
  _event=$1 _text=$2; shift 2
  gm_detach "$_py" "$HOME/.gpumagic/notify/notify.py" --event "$_event" --text "$_text" --log "$dir/log" "$@"
}

put_state() {
  {
    echo "state=$1"; echo "since=$start"; echo "checked=$now"; echo "checks=$checks"
    echo "fire_at=$fire_at"; echo "reason=$why"; echo "idle=$m"
    echo "idle_s=$IDLE_S"; echo "limit_in=$LIMIT_IN"; echo "deadline_in=$DEADLINE_IN"
    echo "grace_s=$GRACE_S"; echo "poll_s=$POLL_S"
  } > "$dir/state.tmp" && mv -f "$dir/state.tmp" "$dir/state"
}

run() {
  echo $$ > "$dir/pid"
  start=$(date +%s); now=$start; checks=0; fire_at=""; why=""; m=""; idle_since=""; warned=""
  limit_at=""; [ -n "$LIMIT_IN" ] && limit_at=$((start + LIMIT_IN))
  deadline_at=""; [ -n "$DEADLINE_IN" ] && deadline_at=$((start + DEADLINE_IN))
  trap 'log "guard cancelled"; put_state cancelled; rm -f "$dir/alert" "$dir/pid"; exit 0' TERM INT
  armed=""  # only the triggers set: "idle=1800s deadline_in=3s", never "idle=-s"
  [ -n "$IDLE_S" ] && armed="$armed idle=${IDLE_S}s"
  [ -n "$LIMIT_IN" ] && armed="$armed limit_in=${LIMIT_IN}s"
  [ -n "$DEADLINE_IN" ] && armed="$armed deadline_in=${DEADLINE_IN}s"
  log "guard armed:${armed} grace=${GRACE_S}s poll=${POLL_S}s; shutdown: $SHUTDOWN_CMD"
  while :; do
    # stop if disarmed behind our back: directory removed, or another guard took over
    [ -d "$dir" ] || exit 0
    [ "$(cat "$dir/pid" 2>/dev/null)" = "$$" ] || { log "replaced by another guard"; exit 0; }
    now=$(date +%s); fire_at=""; why=""
    if [ -n "$limit_at" ]; then fire_at=$limit_at; why="budget limit reached"; fi
    if [ -n "$deadline_at" ] && { [ -z "$fire_at" ] || [ "$deadline_at" -lt "$fire_at" ]; }; then
      fire_at=$deadline_at; why="deadline reached"
    fi
    if [ -n "$IDLE_S" ]; then
      m=$(measure); checks=$((checks + 1))
      case "$m" in
        idle*) if [ -z "$idle_since" ]; then idle_since=$now; log "GPU idle: ${m#idle }"; fi ;;
        *) if [ -n "$idle_since" ] || [ "$checks" = 1 ]; then log "not idle: $m"; fi; idle_since="" ;;
      esac
      if [ -n "$idle_since" ]; then
        t=$((idle_since + IDLE_S))
        if [ -z "$fire_at" ] || [ "$t" -lt "$fire_at" ]; then fire_at=$t; why="GPU idle for ${IDLE_S}s"; fi
      fi
    fi
    if [ -n "$fire_at" ] && [ "$now" -ge $((fire_at - GRACE_S)) ]; then
      if [ "$warned" != "$fire_at" ]; then
        msg="shutting down in $((fire_at - now))s ($why); cancel with: %gpu budget guard --cancel"
        log "WARNING: $msg"; printf '%s\n' "$msg" > "$dir/alert"; warned=$fire_at
        notify shutdown "$msg" --once "shutdown:$start:$fire_at"
      fi
    elif [ -n "$warned" ]; then
      log "shutdown withdrawn: $m"; rm -f "$dir/alert"; warned=""
    fi
    if [ -n "$fire_at" ] && [ "$now" -ge "$fire_at" ]; then
      log "SHUTDOWN: $why; running: $SHUTDOWN_CMD"
      put_state firing
      sh -c "$SHUTDOWN_CMD" >> "$dir/log" 2>&1; rc=$?
      if [ "$rc" = 0 ]; then log "shutdown command succeeded"; put_state fired
      else log "shutdown command FAILED with exit code $rc"; put_state failed
        printf 'the guard could not shut down (exit code %s): stop the instance yourself\n' "$rc" > "$dir/alert"
        notify guard "the guard could not shut down (exit code $rc): stop the instance yourself"
      fi
      rm -f "$dir/pid"; exit 0
    fi
    put_state armed
    n=$POLL_S
    if [ -n "$fire_at" ] && [ $((fire_at - now)) -lt "$n" ]; then n=$((fire_at - now)); fi
    [ "$n" -ge 1 ] || n=1
    sleep "$n"
  done
}

case "$1" in
  run) dir=$2; shift 2; settings "$@"; run ;;
  measure) shift; settings "$@"; measure ;;
  *) echo "usage: gpumagic-guard.sh run DIR [SETTING=VALUE...] | gpumagic-guard.sh measure [SETTING=VALUE...]" >&2; exit 2 ;;
esac
