#!/bin/sh
# The sandbox's stand-in `shutdown` (the sandbox is this computer): installed in the sandbox's
# DIR/bin, first on its PATH, by gpumagic.ssh.sandbox.Sandbox.shutdown_stand_in; it records the
# call as `EPOCH shutdown ARGS` in DIR/shutdown-calls and powers nothing off.
printf '%s shutdown %s\n' "$(date +%s)" "$*" >> "$(dirname "$0")/../shutdown-calls"
