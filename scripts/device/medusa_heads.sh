# device: Medusa heads just trained (train_heads.sh with METHODS containing medusa and/or medusa4,
# same warm machine: they are in $HEADS = /tmp/tr) against each other and the shipped ones, then
# issue 11's Medusa point on MT-bench. One call (~7 minutes):
#  1. per variant: its static tree calibrated on the target's answers to its own requests (never
#     MT-bench; scripts/medusa_tree.py on the GPU, 31 nodes = num_draft_tokens 32), with what the
#     tree and the chain expect on those answers and, for the report, on MT-bench's answers;
#  2. the variant whose tree expects most on the calibration answers (not MT-bench's) is benched:
#     all 80 questions, 256 tokens, greedy, bf16, batch 1, interleaved: autoregressive, ngram k=4,
#     its chain k=4, its static tree, its dynamic tree 8x4/32, and EAGLE3 (EAGLE3=1, default) the
#     new eagle3 head's chain against the shipped one's; JSON in $OUT/medusa_b1.json.
# VARIANTS: the folders of $HEADS to weigh (default "medusa medusa4"); PPC: questions per category.
. scripts/device/common.sh
HEADS=${HEADS:-/tmp/tr}
SELF=${SELF:-docs/results/h200/train_run_1202c/self_prompts.jsonl}  # calibration requests (never MT-bench)
best="" best_e=0
for v in ${VARIANTS:-medusa medusa4}; do
  [ -f $HEADS/$v/config.json ] || { echo "$v: no heads in $HEADS/$v"; continue; }
  python3 scripts/medusa_tree.py --model $M --heads $HEADS/$v --prompts $SELF --num-prompts 160 --nodes 31 \
    --eval-prompts core/data/mt_bench.jsonl --eval-num-prompts 80 --device cuda --dtype bfloat16 \
    --json $OUT/medusa_tree_$v.json 2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING|Processed"
  e=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['expected'])" $OUT/medusa_tree_$v.json) || continue
  echo "$v: calibration answers expect the tree at $e"
  if python3 -c "import sys; sys.exit(not float(sys.argv[1]) > float(sys.argv[2]))" "$e" "$best_e"; then best=$v best_e=$e; fi
done
[ -n "$best" ] || { echo "no Medusa heads to bench"; exit 1; }
echo "benched: $best"
K='"num_speculative_tokens":4'
MH=$HEADS/$best
static=$(python3 -c "import json,sys; c = json.load(open(sys.argv[1]))['config']; c['model'] = sys.argv[2]; print(json.dumps(c))" \
  $OUT/medusa_tree_$best.json $MH)
ARGS=(--method "{\"method\":\"ngram\",$K}"
      --method "{\"method\":\"medusa\",\"model\":\"$MH\",$K}" --method "$static"
      --method "{\"method\":\"medusa\",\"model\":\"$MH\",\"tree_topk\":8,\"tree_depth\":4,\"num_draft_tokens\":32}")
if [ "${EAGLE3:-1}" = 1 ] && [ -f $HEADS/eagle3/config.json ]; then
  ARGS+=(--method "{\"method\":\"eagle3\",\"model\":\"$HEADS/eagle3\",$K}" --method "{\"method\":\"eagle3\",$K}")
fi
python3 scripts/device/head_kernels.py bench offline --model $M --dtype bfloat16 --max-tokens 256 --batch-size 1 \
  --prompts-per-category ${PPC:-10} --profile --interleave --baseline-again "${ARGS[@]}" --json $OUT/medusa_b1.json \
  2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING"
