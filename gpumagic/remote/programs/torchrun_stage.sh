# torchrun_stage.sh DIR FILE [NEW_RUN]: write stdin to DIR/FILE (~/-relative DIR and its parent 0700,
# the file 0600);
# with NEW_RUN=1 (a new run) first remove the previous run's ranks/ and logs/ there.
d=$1; f=$2
umask 077  # gpumagic's state is private: folders 0700, files 0600
# shellcheck disable=SC2088  # a literal "~/" prefix, replaced by $HOME
case $d in "~/"*) d=$HOME/${d#"~/"} ;; esac
mkdir -p "$d" && chmod 700 "$d" "${d%/*}" || exit 1
[ "$3" = 1 ] && rm -rf "$d/ranks" "$d/logs" "$d/hosts"
cat > "$d/$f.tmp" && mv "$d/$f.tmp" "$d/$f"
