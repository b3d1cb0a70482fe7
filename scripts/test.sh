#!/usr/bin/env bash
# Run the whole test suite against real local sshd servers (installs what it needs).
source "$(dirname "$0")/_setup.sh"
exec .venv/bin/python -m pytest "$@"
