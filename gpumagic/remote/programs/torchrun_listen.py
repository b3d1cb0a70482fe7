# torchrun_listen.py HOST PORT SECONDS: listen on HOST:PORT (PORT 0: one the system picks) so the
# other machines can test that they reach the rendezvous endpoint; prints "port N" and returns
# at once, leaving a detached listener that accepts connections until SECONDS have passed.
import os
import socket
import sys
import time

host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((host, port))
    s.listen(16)
except OSError as e:
    print(f"error {e.strerror or e}")
    sys.exit(1)
print(f"port {s.getsockname()[1]}", flush=True)
if os.fork():
    os._exit(0)
os.setsid()
fd = os.open(os.devnull, os.O_RDWR)
for i in (0, 1, 2):
    os.dup2(fd, i)
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.settimeout(max(0.1, end - time.monotonic()))
    try:
        c, _ = s.accept()
        c.close()
    except OSError:
        pass
