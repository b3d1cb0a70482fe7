# torchrun_stage.sh DIR FILE [FRESH]: write stdin to DIR/FILE (~/-relative DIR, created 0700);
# with FRESH=1 first remove the previous run's ranks/ and logs/ there.
d=$1; f=$2
# shellcheck disable=SC2088  # a literal "~/" prefix, replaced by $HOME
case $d in "~/"*) d=$HOME/${d#"~/"} ;; esac
mkdir -p "$d" && chmod 700 "$d" || exit 1
[ "$3" = 1 ] && rm -rf "$d/ranks" "$d/logs" "$d/hosts"
cat > "$d/$f.tmp" && mv "$d/$f.tmp" "$d/$f"
