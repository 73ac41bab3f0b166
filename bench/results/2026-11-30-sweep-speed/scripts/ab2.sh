cd $REPO && . .venv/bin/activate
S=$SHARED/data/traces
run() {
  tree=$1; tag=$2; shift 2
  if [ $tree = new ]; then R="python -m moeinf"; else R="python $REPO/bench/results/2026-11-30-sweep-speed/scripts/wtrun.py $WORK/wt"; fi
  /usr/bin/time -f "%e" -o $WORK/ab/$tag-$tree.time $R bench cache "$@" --out $WORK/ab/$tag-$tree > $WORK/ab/$tag-$tree.txt 2>&1
  echo $tag $tree $(cat $WORK/ab/$tag-$tree.time) $(head -1 $WORK/ab/$tag-$tree.txt | grep -o "fit.*")
}
for t in new old; do run $t dsv2-r2 --traces $S/dsv2lite-puffin-700.jsonl.gz --seed 0; done
for t in new old; do run $t third-r2 --traces $WORK/third.jsonl --seed 0; done
for t in old new; do run $t gtop1-r1 --traces $S/gptoss20b-fingerprint-400.jsonl.gz --top1 --seed 0; done
echo ABDONE
