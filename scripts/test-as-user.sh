#!/usr/bin/env bash
# Run the whole test suite as a plain (non-root) user, the way Binder (`jovyan`), a school
# JupyterHub and most laptops run gpumagic.  Arguments are passed to pytest.
#
# Not root: this is scripts/test.sh, as the current user.
#
# Root (CI): as the user gpumagic-ci (GPUMAGIC_TEST_USER to change it), made here when missing:
# no password, no sudo rights, shell /bin/bash, home /home/gpumagic-ci.
#   1. the checkout's files (tracked files plus untracked ones git does not ignore: the working
#      tree as `git status` sees it; on a clean clone, the commit) are copied to
#      ~gpumagic-ci/gpumagic, owned by that user; its .venv there is kept between runs;
#   2. as that user, with a plain user's PATH (/usr/local/bin:/usr/bin:/bin) and a clean
#      environment: a venv from a python3 it can run (Debian's /usr/bin/python3), then
#      `pip install -e ".[test]"` (scripts/_setup.sh), with pip's cache in its own home
#      (seeded once from root's cache) and root's own pip.conf (copied once, where it has one);
#      GPUMAGIC_TEST_* (GPUMAGIC_TEST_TORCH=1: torch for the torchrun tests) pass through;
#   3. as that user: bash scripts/test.sh "$@" (its xdist workers and EncodingWarning check).  The
#      exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  exec bash scripts/test.sh "$@"
fi

user=${GPUMAGIC_TEST_USER:-gpumagic-ci}
plain_path=/usr/local/bin:/usr/bin:/bin
started=$SECONDS
say() { echo "test-as-user: $*" >&2; }

# System packages (sshd, rsync, tmux, git, login shells, shellcheck), as test.sh installs them.
source scripts/_packages.sh

if ! id -u "$user" >/dev/null 2>&1; then
  say "creating the plain user $user"
  useradd --create-home --home-dir "/home/$user" --shell /bin/bash --user-group "$user"
fi
if [ "$(id -u "$user")" = 0 ]; then
  say "$user has uid 0: it is not a plain user"; exit 2
fi
home=$(getent passwd "$user" | cut -d: -f6)
# pytest's temp folder left by an earlier account of the same name (removed and made again, so
# another uid) stops pytest at start ("not owned by the current user"): it goes
stale=/tmp/pytest-of-$user
if [ -d "$stale" ] && [ "$(stat -c %u "$stale")" != "$(id -u "$user")" ]; then
  say "removing $stale, left by an earlier $user (uid $(stat -c %u "$stale"))"
  rm -rf "$stale"
fi
repo=$PWD
cd "$home"  # the checkout may sit where the user cannot enter (/root)
as_user() {
  # A clean environment, as a login gives it, plus pip's and the proxy's settings and the locale.
  local keep=() var
  while IFS= read -r var; do
    case "$var" in
      PIP_*|http_proxy|https_proxy|no_proxy|HTTP_PROXY|HTTPS_PROXY|NO_PROXY|LANG|LC_*|TERM|TZ|CI|\
      SSL_CERT_FILE|SSL_CERT_DIR|PYTHONUNBUFFERED|PYTHONDONTWRITEBYTECODE|PYTHONFAULTHANDLER|PYTEST_ADDOPTS|\
      GPUMAGIC_TEST_*|GPUMAGIC_FUZZ_*)
        keep+=("$var=${!var}") ;;
    esac
  done < <(compgen -e)
  runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" SHELL=/bin/bash \
    PATH="$plain_path" "${keep[@]}" "$@"
}
if as_user sh -c 'command -v sudo >/dev/null && sudo -n true' >/dev/null 2>&1; then
  say "$user can use sudo without a password: it is not a plain user"; exit 2
fi
# The user must be able to run a python3 that can make a venv (root's python may sit in /root).
if ! as_user python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  say "installing python3 and python3-venv with apt-get (for $user)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
fi

# pip's cache: seed the user's from root's once, so the install downloads nothing twice.
root_cache=${PIP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pip}
user_cache=$home/.cache/pip
if [ -d "$root_cache" ] && [ ! -d "$user_cache" ]; then
  say "seeding $user's pip cache from $root_cache"
  mkdir -p "$home/.cache"
  cp -a "$root_cache" "$user_cache"
  chown -R "$user:" "$home/.cache"
fi
unset PIP_CACHE_DIR
# pip's settings: the user installs from where root installs (an index or a folder of wheels
# named in root's own pip.conf; the system-wide ones, /etc/pip.conf, apply to both already).
for conf in .config/pip/pip.conf .pip/pip.conf; do
  if [ -f "$HOME/$conf" ] && [ ! -e "$home/$conf" ]; then
    say "copying root's ~/$conf to $user"
    as_user mkdir -p "$home/$(dirname "$conf")"
    # shellcheck disable=SC2016  # $1 is expanded by that sh: the file, written for the user alone
    as_user sh -c 'umask 077 && cat > "$1"' sh "$home/$conf" < "$HOME/$conf"
  fi
done

# The checkout's files, as git sees the working tree; the user's .venv there is kept.
dest=$home/gpumagic
as_user mkdir -p "$dest"
find "$dest" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do
    case "$f" in .venv|.venv/*) continue ;; esac
    if [ -e "$repo/$f" ] || [ -L "$repo/$f" ]; then printf '%s\0' "$f"; fi  # not files deleted in the tree
  done |
  tar -C "$repo" --null --no-recursion -T - -cf - |
  (cd "$dest" && as_user tar -xf -)
say "copied the checkout to $dest ($((SECONDS - started))s)"

cd "$dest"
step=$SECONDS
as_user bash scripts/_setup.sh
say "venv ready as $user ($((SECONDS - step))s)"
step=$SECONDS
rc=0
as_user bash scripts/test.sh "$@" || rc=$?
say "pytest as $user exited $rc (suite $((SECONDS - step))s, all $((SECONDS - started))s)"
exit "$rc"
