# device call 4 of a session: batch 16 (trees against chains and autoregressive), the JAX
# backend beside torch, a server soak at concurrency 64, and the step costs.
. scripts/device/common.sh
T0=$(date +%s)
K='"num_speculative_tokens":4'
mdl() { [ -n "$HEADS" ] && echo ",\"model\":\"$HEADS/$1\""; }
A=(--method "{\"method\":\"ngram\",$K}")
for m in eagle3 eagle mtp; do
  A+=(--method "{\"method\":\"$m\"$(mdl $m),$K}" --method "{\"method\":\"$m\"$(mdl $m),\"tree_topk\":8,\"tree_depth\":6,\"num_draft_tokens\":32}")
done
speculum bench offline --model $M --dtype bfloat16 --max-tokens 256 --batch-size 16 --prompts-per-category 10 \
  "${A[@]}" --json $OUT/bench_b16.json 2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING" | tail -14
echo "b16: $(( $(date +%s) - T0 )) s"
speculum bench soak --server --model $M --dtype bfloat16 --device cuda --num-requests ${SOAK_N:-1500} \
  --concurrency 64 --max-model-len 512 --max-num-seqs 64 --kv-blocks 96 --json $OUT/soak_server.json 2>&1 \
  | grep -v -E "Loading|Writing|it/s|INFO|WARNING|preempted|failed:" | tail -6
echo "soak: $(( $(date +%s) - T0 )) s"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
speculum bench backends --model $M --backend torch,jax --separate-processes --dtype bfloat16 --batch-size 1 \
  --num-prompts 10 --max-tokens 128 --method "{\"method\":\"ngram\",$K}" --json $OUT/backends_b1_bf16.json 2>&1 \
  | grep -v -E "Loading|Writing|it/s|INFO" | tail -8
echo "backends: $(( $(date +%s) - T0 )) s"
for s in smollm2-135m llama3-8b; do
  speculum bench step --shape $s --batch-sizes 1,16 --query-lens 1,2,5,9,17,33 --json $OUT/step_$s.json 2>&1 | tail -16
done
echo "total: $(( $(date +%s) - T0 )) s"
