# shellcheck shell=sh
# gpu-sections.sh SMI_SECONDS LOGIN_PATH SECTION...
#
# The readings of `%gpu status` and `%gpu doctor`, gathered in one round trip
# (gpumagic/gpu/smi.py, gpumagic/gpu/doctor.py).  Runs after lib.sh (gm_find).
#
# SMI_SECONDS  how long one nvidia-smi call may run before `timeout` stops it (status 124):
#              a GPU in a bad state can make nvidia-smi hang for minutes.
# LOGIN_PATH   the PATH of the user's login shell, where ~/.bashrc or /etc/profile put
#              nvidia-smi; '' keeps the PATH this runs with.
# SECTION      NAME or NAME=ARG, run in the order given:
#   gpus=FIELDS   nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits
#   apps=FIELDS   nvidia-smi --query-compute-apps=FIELDS --format=csv,noheader,nounits
#   version       nvidia-smi --version; old drivers lack it: the first lines of the banner
#   torch=SOURCE  python3 -c SOURCE, the login's python3 (SOURCE: gpu-python-probe.py)
#   env           VIRTUAL_ENV=, CONDA_DEFAULT_ENV=, and python3=, tmux=, rsync= (their paths)
#   cwd           pwd -P
#   df            df -P -B1 (df -Pk where df lacks -B)
#   sample=N      the cpu lines of /proc/stat, --gpu, N utilization.gpu readings 1 s apart,
#                 --end, the cpu lines of /proc/stat again
#
# Each section prints, with RS the byte 0x1e (read by split_sections in gpumagic/gpu/smi.py):
#   RS gpumagic-section NAME
#   what it printed, stdout and stderr merged
#   RS gpumagic-rc NAME STATUS     (on a line of its own; 127: a program was not found)

smi_seconds=$1
[ -n "$2" ] && { PATH=$2; export PATH; }
shift 2

# nvidia-smi, also where GPU images keep it off a non-login PATH; not found anywhere, the
# shell's own "not found" and status 127 are what the section reports.
smi_bin=$(gm_find nvidia-smi) || smi_bin=nvidia-smi
if command -v timeout >/dev/null 2>&1; then
  smi() { timeout "$smi_seconds" "$smi_bin" "$@"; }
else
  smi() { "$smi_bin" "$@"; }
fi

gpu_sample() {
  grep '^cpu' /proc/stat
  echo '--gpu'
  i=0
  while [ "$i" -lt "$1" ]; do
    smi --query-gpu=utilization.gpu --format=csv,noheader,nounits
    sleep 1
    i=$((i + 1))
  done
  echo '--end'
  grep '^cpu' /proc/stat
}

for spec in "$@"; do
  name=${spec%%=*}
  arg=${spec#"$name"}
  arg=${arg#=}
  printf '\036gpumagic-section %s\n' "$name"
  (
    case $name in
      gpus) smi --query-gpu="$arg" --format=csv,noheader,nounits ;;
      apps) smi --query-compute-apps="$arg" --format=csv,noheader,nounits ;;
      version) smi --version || smi | head -n 4 ;;
      torch) python3 -c "$arg" ;;
      env) printf 'VIRTUAL_ENV=%s\nCONDA_DEFAULT_ENV=%s\npython3=%s\ntmux=%s\nrsync=%s\n' \
             "$VIRTUAL_ENV" "$CONDA_DEFAULT_ENV" "$(command -v python3)" "$(command -v tmux)" \
             "$(command -v rsync)" ;;
      cwd) pwd -P ;;
      df) df -P -B1 2>/dev/null || df -Pk ;;
      sample) gpu_sample "$arg" ;;
      *) echo "gpu-sections.sh: no section named '$name'" >&2; exit 2 ;;
    esac
  ) </dev/null 2>&1
  printf '\n\036gpumagic-rc %s %s\n' "$name" "$?"
done
