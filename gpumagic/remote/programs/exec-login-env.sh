# exec-login-env.sh MARK: the exec environment, MARK, then MARK and the environment of an
# interactive login shell (`$SHELL -lic`; csh and tcsh take -l only as their sole option, so
# they read the command from stdin), each as `env -0` prints it.  Read by
# gpumagic/remote/execution.py (login_env_delta).  MARK holds no quote or backslash.
# shellcheck shell=sh
mark=$1
env -0; printf '%s' "$mark"
cmd="printf '$mark'; env -0"
case ${SHELL##*/} in
  csh|tcsh) printf '%s\n' "$cmd" | "$SHELL" -l ;;
  *) "${SHELL:-/bin/sh}" -lic "$cmd" </dev/null ;;
esac 2>/dev/null
