# net-doctor.py TARGETS TIMEOUT READ MAX_BYTES: from the machine, for every target at once
# (TARGETS: a JSON list of {"name", "url"}): the time to the first byte of the body (no answer
# within TIMEOUT seconds: timed out), then the bytes read in the next READ seconds (at most
# MAX_BYTES).  Runs as a cell does, so http(s)_proxy and no_proxy apply as they do to pip.
# The whole check ends by TIMEOUT + READ + 0.5 s whatever the sites do (a name that never
# resolves included: each target has its own thread, and the ones still running then are
# reported as timed out).  Prints one JSON object: {"results": [...], "seconds": s,
# "proxy": the https_proxy in effect, "turbo": whether /etc/network_turbo exists (AutoDL)}.
# Read by gpumagic/net/doctor.py.
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

targets = json.loads(sys.argv[1])
timeout, read_time, max_bytes = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
started = time.monotonic()
results = {}


def measure(i, target):
    t0 = time.monotonic()
    out = {"name": target["name"], "url": target["url"], "status": "timeout", "bytes": 0}
    results[i] = out
    try:
        req = urllib.request.Request(target["url"], headers={"User-Agent": "gpumagic-doctor/1"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out["http"] = r.status
            first = r.read(1)
            now = time.monotonic()
            if now - t0 > timeout:
                return
            out["ttfb"] = now - t0
            out["status"] = "ok"
            out["seconds"] = 0.0
            got = len(first)
            end = now + read_time
            while got < max_bytes and first and time.monotonic() < end:
                chunk = r.read1(min(1 << 20, max_bytes - got))
                if not chunk:
                    out["complete"] = True
                    break
                got += len(chunk)
                out["bytes"], out["seconds"] = got, time.monotonic() - now  # seen even if cut off
            out["bytes"], out["seconds"] = got, time.monotonic() - now
    except urllib.error.HTTPError as e:
        out.update(status="http", http=e.code, ttfb=time.monotonic() - t0)
    except (socket.timeout, TimeoutError):
        out["status"] = "timeout"
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            out["status"] = "timeout"
        else:
            out.update(status="error", error=getattr(reason, "strerror", None) or str(reason))
    except (OSError, ValueError) as e:
        out.update(status="error", error=getattr(e, "strerror", None) or str(e))


threads = [threading.Thread(target=measure, args=(i, t), daemon=True) for i, t in enumerate(targets)]
for t in threads:
    t.start()
deadline = started + timeout + read_time + 0.5
for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
report = {"results": [dict(results.get(i) or {"name": t["name"], "url": t["url"], "status": "timeout", "bytes": 0})
                      for i, t in enumerate(targets)],
          "seconds": time.monotonic() - started,
          "proxy": os.environ.get("https_proxy") or os.environ.get("HTTPS_PROXY") or "",
          "turbo": os.path.exists("/etc/network_turbo")}
print(json.dumps(report), flush=True)
os._exit(0)  # threads still waiting (a name that never resolves) must not hold the exit
