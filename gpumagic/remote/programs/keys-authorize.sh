# keys-authorize.sh LINE: append the public key LINE (an authorized_keys line, sshd(8)
# AUTHORIZED_KEYS FILE FORMAT) to ~/.ssh/authorized_keys unless a line already holds the same
# key blob (so a key with another comment or with options is not added twice).  Creates ~/.ssh
# (0700) and the file (0600) when missing and removes group/other write bits (sshd's
# StrictModes refuses such files).  Prints "added" or "present".
# shellcheck shell=sh
set -e
umask 077
line=$1
blob=$(printf '%s\n' "$line" | awk '{print $2}')
d="$HOME/.ssh"; f="$d/authorized_keys"
[ -d "$d" ] || mkdir -m 700 "$d"
chmod go-w "$d"
if [ ! -e "$f" ]; then : > "$f"; chmod 600 "$f"; fi
chmod go-w "$f"
if grep -qF -- "$blob" "$f"; then echo present; exit 0; fi
if [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ]; then printf '\n' >> "$f"; fi
printf '%s\n' "$line" >> "$f"
if command -v restorecon >/dev/null 2>&1; then restorecon -F "$d" "$f" >/dev/null 2>&1 || :; fi
echo added
