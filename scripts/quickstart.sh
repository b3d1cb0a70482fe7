#!/usr/bin/env bash
# Run example-notebooks/01-quickstart.ipynb against the local sandbox machine.
# Installs only what the sandbox and a notebook need (the tests install the rest).
export GPUMAGIC_FOR=main
source "$(dirname "$0")/_setup.sh"
exec .venv/bin/python -m gpumagic run-notebook example-notebooks/01-quickstart.ipynb --output-dir build/executed "$@"
