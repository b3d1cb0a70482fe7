# Sourced by quickstart.sh and test.sh: system packages, then the project's venv in .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null 2>&1 || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v git >/dev/null 2>&1 || need+=(git)
# Optional for the tests: login shells that re-read a command differently, and shellcheck for
# the machine-side programs.  Installed when we are root; otherwise their tests are skipped
# with the install line.
if [ "$(id -u)" = 0 ]; then
  for tool in fish tcsh zsh shellcheck; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
  done
  # GPUMAGIC_TEST_BROWSER=1 (.ci/run sets it): Debian's chromium for tests/test_browser.py, driven
  # by Playwright (whose own browser download cannot work here), and a Chinese font (5 MB) so the
  # zh-CN tutorials' screenshots show characters, not boxes.
  if [ "${GPUMAGIC_TEST_BROWSER:-}" = 1 ]; then
    [ -x /usr/bin/chromium ] || need+=(chromium)
    [ -e /usr/share/fonts/truetype/wqy/wqy-microhei.ttc ] || need+=(fonts-wqy-microhei)
  fi
fi
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "gpumagic: installing ${need[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "gpumagic: missing ${need[*]}; install them first, e.g.:" >&2
    echo "  sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi

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
