# Sourced by _setup.sh and test-as-user.sh: the system packages (apt-get as root).
# GPUMAGIC_FOR=main (scripts/quickstart.sh): only what the sandbox machine and a notebook need:
# sshd and ssh, rsync, tmux, python3-venv.  GPUMAGIC_FOR=test (the default: test.sh,
# test-as-user.sh): also the tools only the tests use.
# shellcheck shell=bash
set -euo pipefail

need=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null 2>&1 || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
if [ "${GPUMAGIC_FOR:-test}" = test ]; then
  command -v git >/dev/null 2>&1 || need+=(git)
  command -v curl >/dev/null 2>&1 || need+=(curl)  # what a machine's cells fetch with (tests/test_proxy.py)
fi
# Optional for the tests: login shells that re-read a command differently, shellcheck for
# the machine-side programs, and FUSE.  Installed when we are root; otherwise their tests are skipped
# with the install line.
if [ "${GPUMAGIC_FOR:-test}" = test ] && [ "$(id -u)" = 0 ]; then
  for tool in fish tcsh zsh shellcheck; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
  done
  # fuse3 (fusermount3, libfuse3) for the laptop-like file systems of tests/test_windows.py
  # (case-insensitive NTFS/APFS stand-ins, tests/casefold_fs.py); skipped without it.
  command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
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
