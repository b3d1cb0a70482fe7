# tunnel-stop-service.sh PID: stop a TensorBoard/Jupyter server gpumagic started (its whole
# process group, so TensorBoard's data server too; the process itself when it leads none)
# and remove its record ~/.gpumagic/services/PID.json (written by tunnel-service.py).
# shellcheck shell=sh
kill -s TERM -- "-$1" 2>/dev/null || kill -s TERM "$1"
rm -f "$HOME/.gpumagic/services/$1.json"
