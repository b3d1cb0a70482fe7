# Sourced by quickstart.sh and test.sh: system packages, then the project's venv in .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source "$(dirname "${BASH_SOURCE[0]}")/_packages.sh"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.gpumagic-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "gpumagic: installing into .venv (log: .venv/pip.log)" >&2
  if ! { .venv/bin/python -m pip install --upgrade pip &&
         .venv/bin/python -m pip install -e ".[test]"; } > .venv/pip.log 2>&1; then
    tail -n 20 .venv/pip.log >&2
    echo "gpumagic: pip install failed; the whole log is .venv/pip.log" >&2
    exit 1
  fi
  touch "$stamp"
fi

# GPUMAGIC_TEST_TORCH=1 (.ci/run sets it): PyTorch for the torchrun tests (tests/test_torchrun.py,
# skipped without it).  torch==2.13.0 is a CPU build where a local wheel is offered (this CI).
if [ "${GPUMAGIC_TEST_TORCH:-}" = 1 ] && ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  echo "gpumagic: installing torch==2.13.0 into .venv for the torchrun tests (log: .venv/pip.log)" >&2
  if ! .venv/bin/python -m pip install torch==2.13.0 >> .venv/pip.log 2>&1; then
    tail -n 20 .venv/pip.log >&2
    echo "gpumagic: installing torch failed; the whole log is .venv/pip.log" >&2
    exit 1
  fi
fi
