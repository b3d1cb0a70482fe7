# Sourced by quickstart.sh and test.sh: system packages, then the project's venv in .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source "$(dirname "${BASH_SOURCE[0]}")/_packages.sh"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# GPUMAGIC_FOR=main (quickstart.sh): the package and its [tutorials] extra (what every tutorial
# imports, here and on the sandbox, whose python3 is this venv's); test (the default): the [test]
# extra, which holds [tutorials]'s packages too, and [docs] (tests/test_docs.py builds the docs).
# A stamp per set of extras says it is done.
extra="test,docs"
[ "${GPUMAGIC_FOR:-test}" = main ] && extra=tutorials
stamp=.venv/.gpumagic-installed-${extra//,/-}
fresh() { [ -f "$1" ] && ! [ pyproject.toml -nt "$1" ]; }
if ! fresh "$stamp" && ! { [ $extra = tutorials ] && fresh .venv/.gpumagic-installed-test-docs; }; then
  echo "gpumagic: installing .[$extra] into .venv (log: .venv/pip.log)" >&2
  # No pip upgrade: the venv's own pip installs these wheels.  GPUMAGIC_INSTALLER=uv takes uv
  # (measured: 9 s against pip's 34 s for [notebook], cold caches), which reads no pip.conf:
  # not the default, since a PyPI mirror set there (as students in China do) would be ignored.
  # editable_mode=compat: the checkout is put on sys.path by a plain path line in a .pth file.
  # The default editable mode installs an import finder that every Python start runs (20 ms
  # measured here): the sandbox machine's python3 is this venv's, so each `%%remote --python`
  # cell paid it (1.7 RTT on the 40 ms link, 1.3 without), which no rented machine does.
  if [ "${GPUMAGIC_INSTALLER:-pip}" = uv ]; then
    run_install() { .venv/bin/python -m pip install -q --disable-pip-version-check uv &&
                    .venv/bin/uv pip install --python .venv/bin/python -C editable_mode=compat -e ".[$extra]"; }
  else
    run_install() { .venv/bin/python -m pip install --disable-pip-version-check \
                      --config-settings editable_mode=compat -e ".[$extra]"; }
  fi
  if ! run_install > .venv/pip.log 2>&1; then
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
