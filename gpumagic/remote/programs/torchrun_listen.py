# torchrun_listen.py HOST PORT SECONDS COUNT: listen on HOST:PORT (PORT 0: one the system picks;
# every interface where HOST is not an address of this machine)
# so the machines can test that they reach the rendezvous endpoint; prints "port N" and returns
# at once, leaving a detached listener that accepts COUNT connections or until SECONDS have
# passed, whichever is first.  Each connection is closed by the other side first (the listener
# reads to EOF), so the port is left with no TIME_WAIT here for torchrun's store to bind.
import errno
import os
import socket
import sys
import time

host, port, seconds, count = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    try:
        s.bind((host, port))  # the rendezvous address itself, where it is this machine's
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        # An address that is not on any interface here (a cloud machine's public address,
        # NATed to a private one): listen on every interface, as torchrun's c10d store does.
        s.bind(("", port))
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
while count > 0 and time.monotonic() < end:
    s.settimeout(max(0.1, end - time.monotonic()))
    try:
        c, _ = s.accept()
        c.settimeout(max(0.1, end - time.monotonic()))
        while c.recv(1024):
            pass
        c.close()
        count -= 1
    except OSError:
        pass
s.close()
