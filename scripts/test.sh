#!/usr/bin/env bash
# Run the whole test suite against real local sshd servers (installs what it needs).
source "$(dirname "$0")/_setup.sh"
# PEP 597: a text file opened without naming its encoding is an error in every test (the
# laptop may be Chinese Windows, whose locale encoding is GBK); see pyproject's filterwarnings.
exec .venv/bin/python -X warn_default_encoding -W error::EncodingWarning -m pytest "$@"
