# exec-login-env.sh MARK SETMARK: SETMARK, gpumagic's own settings for every cell, session
# and job (~/.gpumagic/env, NAME=VALUE lines: `%gpu mirrors hf`), SETMARK; the exec
# environment, MARK, then MARK and the environment of an interactive login shell
# (`$SHELL -lic`; csh and tcsh take -l only as their sole option, so they read the command
# from stdin), each as `env -0` prints it.  Read by gpumagic/remote/execution.py
# (read_environment).  The marks hold no quote or backslash.
# shellcheck shell=sh
mark=$1
printf '%s' "$2"; cat "$HOME/.gpumagic/env" 2>/dev/null; printf '%s' "$2"
env -0; printf '%s' "$mark"
cmd="printf '$mark'; env -0"
case ${SHELL##*/} in
  csh|tcsh) printf '%s\n' "$cmd" | "$SHELL" -l ;;
  *) "${SHELL:-/bin/sh}" -lic "$cmd" </dev/null ;;
esac 2>/dev/null
