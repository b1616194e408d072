# device: EAGLE-3 heads just trained against the shipped one, right after e.g.
#   METHODS=eagle3 INIT_FROM_SHIPPED=1 TRAIN_ARGS="--lr 3e-4" bash scripts/device/train_heads.sh
# (eagle3 drafts every token, --draft-tail; eagle3own its draft vocabulary only; eagle3tail as eagle3)
# on the same warm machine (the heads in /tmp/tr, the model joined in /tmp/m); carry the shipped
# eagle3 head's folder for its row. MT-bench, PPC (5) questions per category, greedy, 256 new tokens,
# bf16, batch 1, one interleaved run: autoregressive, ngram k=4, the shipped head's chain, then each
# new head's chain k=4 and tree 8x6/32; the step profile of every config; JSON in $OUT.
. scripts/device/common.sh
TR=${TR:-/tmp/tr}
K='"num_speculative_tokens":4'
T='"tree_topk":8,"tree_depth":6,"num_draft_tokens":32'
ARGS=(--method "{\"method\":\"ngram\",$K}" --method "{\"method\":\"eagle3\",$K}")
for h in eagle3 eagle3tail eagle3own; do
  [ -f $TR/$h/config.json ] || continue
  ARGS+=(--method "{\"method\":\"eagle3\",\"model\":\"$TR/$h\",$K}" --method "{\"method\":\"eagle3\",\"model\":\"$TR/$h\",$T}")
done
speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC:-5} --max-tokens 256 \
  --interleave --baseline-again --profile "${ARGS[@]}" --json $OUT/eagle3_tail.json 2>&1 \
  | grep -v -E "Loading|Writing|it/s|INFO|WARNING"
