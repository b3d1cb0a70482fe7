"""Install gpumagic's alert program on this machine, or remove its settings.

Run by gpumagic (gpumagic/budget/notify.py: ``configure``, ``disable``) with one JSON object
on stdin -- ``{"program": SOURCE of budget-notifier.py, "config": {...} or null, "dir":
"~/.gpumagic/notify"}`` -- so the credentials in the settings never appear in a command line.
The program's own ``install`` writes the folder (0700) and its files (0600) and prints one
JSON line.
"""

import json
import sys

payload = json.loads(sys.stdin.read())
program = {"__name__": "gpumagic_notify", "__file__": "notify.py"}
exec(compile(payload["program"], "notify.py", "exec"), program)
program["install"](payload)
