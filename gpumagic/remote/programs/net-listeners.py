# net-listeners.py PORT: the addresses that listen on TCP port PORT on the machine, one a line
# (127.0.0.1, 0.0.0.0, ::1, ::), read from /proc/net/tcp and /proc/net/tcp6 (Linux; every
# process's sockets of this network namespace, whoever owns them).  Prints "noproc" when neither
# file can be read.  Run by gpumagic/tunnel/reverse.py: whether the machine's sshd put a reverse
# tunnel on loopback only (sshd_config GatewayPorts), and whether a refused port is taken.
import ipaddress
import sys

port = int(sys.argv[1])
LISTEN = "0A"
readable = False
found = []
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        with open(name, encoding="ascii") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        continue
    readable = True
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[3] != LISTEN:
            continue
        addr, _, hex_port = fields[1].partition(":")
        if int(hex_port, 16) != port:
            continue
        raw = bytes.fromhex(addr)
        # the kernel prints each 32-bit word of the address in the host's byte order
        if sys.byteorder == "little":
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        ip = ipaddress.ip_address(raw)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        found.append(str(ip))
if not readable:
    print("noproc")
for a in dict.fromkeys(found):
    print(a)
