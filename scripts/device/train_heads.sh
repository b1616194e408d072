# device call 2: self-distillation once, then five trainings side by side on one GPU
. scripts/device/common.sh
mkdir -p /tmp/tr
C="--model $M --num-prompts 4728 --max-tokens ${MAXTOK:-320} --extra-answers ${EXTRA:-0} --gen-batch 256 \
   --gen-shard-size 600 --gen-dtype float32 --max-len 512 --batch-size ${BS:-32} --eval-every 500 --save-every 500 \
   --threads 2 --time-limit ${TL:-170} --steps 100000 \
   --eval-prompts $SPECULUM_SHARED/data/mt_bench.jsonl --eval-num-prompts 80"
T0=$(date +%s)
speculum train medusa $C --steps 1 --eval-every 0 --out /tmp/tr/probe 2>&1 | grep -v -E "it/s|s/it|prompt/s" | tail -3
echo "self-distillation: $(( $(date +%s) - T0 )) s"
# name=method and options (the name is the output folder)
for m in "eagle=eagle" "eagle3=eagle3" "medusa=medusa --num-heads 4 --num-layers 2" "mtp=mtp" \
         "eagle_2l=eagle --num-layers 2" "draft=draft --num-layers ${DRAFT_LAYERS:-2}"; do
  n=${m%%=*}
  setsid nohup speculum train ${m#*=} $C --out /tmp/tr/$n > /tmp/tr/$n.log 2>&1 < /dev/null &
done
sleep 20
while pgrep -f "speculum train" > /dev/null; do sleep 10; done
grep -h "top-1 agreement" /tmp/tr/*.log
echo "total: $(( $(date +%s) - T0 )) s"
cd /tmp/tr && tar cf $OUT/heads.tar --exclude=checkpoint.pt eagle eagle3 medusa mtp eagle_2l
cd $OUT && split -b 15M heads.tar heads.tar.part_ && rm heads.tar
