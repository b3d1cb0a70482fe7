#!/usr/bin/env bash
# Run the whole test suite against real local sshd servers (installs what it needs).
# Arguments go to pytest (`-k sync`, `-x`, a test file); `-n N` sets the workers.
started=$SECONDS
source "$(dirname "$0")/_setup.sh"
echo "gpumagic: set-up took $((SECONDS - started)) s" >&2

# pytest-xdist: the suite waits far more than it computes (sshd logins, the link emulator's
# delays, kernels starting, deadlines), so it runs in more worker processes than there are
# cores: GPUMAGIC_TEST_WORKERS (default 3 per core, at least 4), unless -n is given.  Each
# worker has its own sshd servers, HOME, ports and data dirs (tests/conftest.py);
# --dist loadgroup keeps a module marked xdist_group("...") on one worker (the browser's
# JupyterLab, the Binder build).  `-n 0` runs it in this one process.
workers=()
xdist=1
for a in "$@"; do
  case "$a" in
    -n|-n[0-9]*|--numprocesses|--numprocesses=*) workers=(--dist loadgroup) ;;
    no:xdist) xdist=0 ;;
  esac
done
if [ "$xdist" = 1 ] && [ ${#workers[@]} = 0 ]; then
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
  n=${GPUMAGIC_TEST_WORKERS:-$((cores * 3 > 4 ? cores * 3 : 4))}
  workers=(-n "$n" --dist loadgroup)
fi
[ "$xdist" = 1 ] || workers=()

# PEP 597: a text file opened without naming its encoding is an error in every test (the
# laptop may be Chinese Windows, whose locale encoding is GBK); see pyproject's filterwarnings.
exec .venv/bin/python -X warn_default_encoding -W error::EncodingWarning -m pytest "${workers[@]}" "$@"
