# torchrun_reach.sh PYTHON HOST PORT SECONDS: can this machine open a TCP connection to
# HOST:PORT within SECONDS?  Prints "dev IFACE" (the interface of the route to HOST, from
# `ip route get`, when `ip` exists), then "ok" or "error WHY".
py=$1; host=$2; port=$3; secs=$4
[ -n "$py" ] || py=$(gm_python) || { echo "error no python3"; exit 0; }
if ipt=$(gm_find ip); then
  dev=$("$ipt" route get "$host" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n 1)
  [ -n "$dev" ] && printf 'dev %s\n' "$dev"
fi
"$py" -c 'import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError as e:
    print("error", e.strerror or type(e).__name__ + (": " + str(e) if str(e) else ""))' "$host" "$port" "$secs"
