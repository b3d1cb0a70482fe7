#!/usr/bin/env bash
# Run example-notebooks/01-quickstart.ipynb against the local sandbox machine.
source "$(dirname "$0")/_setup.sh"
exec .venv/bin/python -m gpumagic run-notebook example-notebooks/01-quickstart.ipynb --output-dir build/executed "$@"
