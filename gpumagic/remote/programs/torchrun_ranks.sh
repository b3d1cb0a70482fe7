# torchrun_ranks.sh DIR: the ranks this machine ran for the job whose torchrun folder is DIR
# (~/-relative), one "RANK LOCAL_RANK PID" a line (from the files torchrun_rank.py writes).
d=$1
# shellcheck disable=SC2088  # a literal "~/" prefix, replaced by $HOME
case $d in "~/"*) d=$HOME/${d#"~/"} ;; esac
for f in "$d"/ranks/*; do
  [ -f "$f" ] || continue
  read -r l p < "$f" || continue
  printf '%s %s %s\n' "${f##*/}" "$l" "$p"
done
