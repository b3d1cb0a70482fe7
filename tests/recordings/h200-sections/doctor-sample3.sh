PATH="$PATH:/usr/local/nvidia/bin:/usr/lib/wsl/lib"; export PATH
if command -v timeout >/dev/null 2>&1; then smi() { timeout 20 nvidia-smi "$@"; }
else smi() { nvidia-smi "$@"; }; fi
printf '\036gpumagic-section %s\n' gpus
( smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used,memory.free,utilization.gpu,utilization.memory,temperature.gpu,power.draw,power.limit,clocks.sm,clocks.max.sm,pstate,mig.mode.current,fan.speed --format=csv,noheader,nounits
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' gpus "$?"
printf '\036gpumagic-section %s\n' apps
( smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' apps "$?"
printf '\036gpumagic-section %s\n' version
( smi --version || smi | head -n 4
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' version "$?"
printf '\036gpumagic-section %s\n' torch
( python3 -c 'import os, sys
print(sys.version.replace('"'"'\n'"'"', '"'"' '"'"'))
kind = ('"'"'conda'"'"' if os.path.isdir(os.path.join(sys.prefix, '"'"'conda-meta'"'"')) else
        '"'"'venv'"'"' if sys.prefix != sys.base_prefix else '"'"'system'"'"')
print('"'"'env'"'"', kind, sys.prefix, sep='"'"'\t'"'"')
try:
    import torch
except Exception as e:
    print('"'"'no-torch'"'"', type(e).__name__ + '"'"':'"'"', e)
else:
    print(torch.__version__, torch.version.cuda)
'
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' torch "$?"
printf '\036gpumagic-section %s\n' env
( printf "VIRTUAL_ENV=%s\nCONDA_DEFAULT_ENV=%s\npython3=%s\ntmux=%s\nrsync=%s\n" "$VIRTUAL_ENV" "$CONDA_DEFAULT_ENV" "$(command -v python3)" "$(command -v tmux)" "$(command -v rsync)"
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' env "$?"
printf '\036gpumagic-section %s\n' cwd
( pwd -P
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' cwd "$?"
printf '\036gpumagic-section %s\n' df
( df -P -B1 2>/dev/null || df -Pk
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' df "$?"
printf '\036gpumagic-section %s\n' sample
( grep '^cpu' /proc/stat; echo '--gpu'; i=0; while [ $i -lt 3 ]; do smi --query-gpu=utilization.gpu --format=csv,noheader,nounits; sleep 1; i=$((i+1)); done; echo '--end'; grep '^cpu' /proc/stat
) </dev/null 2>&1
printf '\n\036gpumagic-rc %s %s\n' sample "$?"
