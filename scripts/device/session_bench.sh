# device call 3 of a session (after setup.sh and train_heads.sh, machine still warm):
# MT-bench, all 80 questions, greedy, 256 new tokens, bf16, batch 1, in ONE run:
# autoregressive, ngram k=4, and for each head method chain k=4 against a tree
# (TREE: top-k x depth / tokens verified), then the trained draft model.
# HEADS=/tmp/tr: the heads train_heads.sh just trained (else the shipped ones).
# The JSON ($OUT/bench_b1.json) is rewritten after every configuration.
. scripts/device/common.sh
K='"num_speculative_tokens":4'
mdl() { [ -n "$HEADS" ] && echo ",\"model\":\"$HEADS/$1\""; }
chain() { echo "{\"method\":\"$1\"$(mdl $1),$K}"; }
tree() { echo "{\"method\":\"$1\"$(mdl $1),\"tree_topk\":$2,\"tree_depth\":$3,\"num_draft_tokens\":$4}"; }
ARGS=(--method "{\"method\":\"ngram\",$K}")
for m in ${METHODS:-eagle3 eagle mtp medusa}; do
  t=${TREE:-8 6 32}; [ $m = medusa ] && t=${MEDUSA_TREE:-8 4 32}
  ARGS+=(--method "$(chain $m)" --method "$(tree $m $t)")
done
D=${DRAFT:-/tmp/tr/draft}
[ -f $D/model.safetensors ] && ARGS+=(--method "{\"method\":\"draft_model\",\"model\":\"$D\",$K}")
speculum bench offline --model $M --dtype bfloat16 --max-tokens 256 --batch-size ${BS:-1} \
  --prompts-per-category ${PPC:-10} ${PROFILE:---profile} "${ARGS[@]}" --json $OUT/bench_b${BS:-1}.json 2>&1 \
  | grep -v -E "Loading|Writing|it/s|INFO|WARNING"
