# torchrun_probe.sh PYTHON CODE_DIR SAME_DIR HASH: what a distributed job must agree on across
# machines, one fact a line:
#   python PATH | torch VERSION | cuda VERSION | nccl VERSION | gpus N | visible CUDA_VISIBLE_DEVICES
#   code SHA256 PATH      (each *.py/*.sh/*.yaml/*.yml/*.toml/*.json/*.cfg under CODE_DIR, sorted,
#                         hidden folders, __pycache__, .venv and node_modules left out)
#   data SIZE [SHA256] PATH   (each file under SAME_DIR; the hash only with HASH=1)
#   datadir               (SAME_DIR exists; a missing one prints no data line)
#   addr IP               (this machine's addresses, `hostname -I`)
# "none" stands for a missing torch / CUDA / NCCL.
py=$1; code=$2; same=$3; hash=$4
[ -n "$py" ] || py=$(gm_python) || py=
printf 'python %s\n' "${py:-none}"
if [ -n "$py" ]; then
  "$py" -c 'import sys
try:
    import torch
except Exception:
    print("torch none"); sys.exit(0)
print("torch", torch.__version__)
print("cuda", torch.version.cuda or "none")
try:
    v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
except Exception:
    v = None
print("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else (v or "none"))' 2>/dev/null || echo "torch none"
else
  echo "torch none"
fi
smi=$(gm_find nvidia-smi) && n=$("$smi" -L 2>/dev/null | grep -c '^GPU') || n=0
printf 'gpus %s\n' "$n"
printf 'visible %s\n' "${CUDA_VISIBLE_DEVICES-all}"
# shellcheck disable=SC2088  # a literal "~/" prefix, replaced by $HOME
case $code in "~/"*) code=$HOME/${code#"~/"} ;; ""|"~") code=$HOME ;; /*) ;; *) code=$HOME/$code ;; esac
if [ -d "$code" ]; then
  (cd "$code" && find . -type d \( -name '.?*' -o -name __pycache__ -o -name .venv -o -name node_modules \) -prune -o \
     -type f \( -name '*.py' -o -name '*.sh' -o -name '*.yaml' -o -name '*.yml' -o -name '*.toml' \
     -o -name '*.json' -o -name '*.cfg' \) -size -2M -print 2>/dev/null | LC_ALL=C sort | head -n 2000 |
   while IFS= read -r f; do printf 'code %s %s\n' "$(sha256sum < "$f" | cut -d' ' -f1)" "${f#./}"; done)
fi
if [ -n "$same" ]; then
  # shellcheck disable=SC2088
  case $same in "~/"*) same=$HOME/${same#"~/"} ;; /*) ;; *) same=$code/$same ;; esac
  if [ -d "$same" ]; then
    echo "datadir"
    (cd "$same" && find . -type f -print 2>/dev/null | LC_ALL=C sort | head -n 100000 |
     while IFS= read -r f; do
       s=$(wc -c < "$f" | tr -d ' ')
       if [ "$hash" = 1 ]; then printf 'data %s %s %s\n' "$s" "$(sha256sum < "$f" | cut -d' ' -f1)" "${f#./}"
       else printf 'data %s - %s\n' "$s" "${f#./}"; fi
     done)
  fi
fi
for a in $(hostname -I 2>/dev/null); do printf 'addr %s\n' "$a"; done
