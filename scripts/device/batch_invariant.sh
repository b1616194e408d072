# device: the batch-invariant mode (issue 14), in parts that each fit a 10-minute call:
#   bash scripts/device/batch_invariant.sh tests   # after setup.sh (carry .whl, .gguf_a): the CUDA tests of the
#                                                  # mode, then bench step of both modes (random weights, no GGUF)
#   bash scripts/device/batch_invariant.sh bench   # carry .gguf_b: MT-bench, 80 questions, 256 tokens, greedy, bf16,
#                                                  # batch 1, in the mode: autoregressive, ngram k=4 and a draft model
#                                                  # (the target's first DRAFT_LAYERS layers); then bench scaling of
#                                                  # both modes (64 requests, batch 1 and 64): identity and cost
#   bash scripts/device/batch_invariant.sh eagle3  # carry the eagle3 head's folder (the model joined by `bench`
#                                                  # stays in /tmp while the machine is warm): the same for eagle3,
#                                                  # its chain and its tree 8x4/32 (trees: since 2026-12-02)
# Results in $OUT: bi_step_{default,invariant}.json, bi_offline.json, bi_scaling.json, bi_eagle3.json.
set -e
PART=${1:-bench}
PPC=${PPC:-10}
TOK=${TOK:-256}
quiet() { grep -v -E "Loading|Writing|it/s"; }
case $PART in
  tests)
    export PYTHONPATH=${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
    timeout ${TEST_TL:-300} python3 -m pytest -q -p no:cacheprovider tests/test_batch_invariant_cuda.py \
      tests/test_batch_invariant.py tests/test_kernels_cuda.py 2>&1 | tail -15
    for mode in default invariant; do
      speculum bench step --shape smollm2-135m --batch-sizes 1,16,64 --query-lens 1,2,5,9 --iters 50 \
        $([ $mode = invariant ] && echo --batch-invariant) --json $OUT/bi_step_$mode.json 2>&1 | quiet
    done ;;
  bench)
    . scripts/device/common.sh
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --batch-invariant --method '{"method":"ngram","num_speculative_tokens":4}' \
      --method "{\"method\":\"draft_model\",\"model\":\"$M\",\"num_speculative_tokens\":3,\"options\":{\"num_layers\":${DRAFT_LAYERS:-4}}}" \
      --json $OUT/bi_offline.json 2>&1 | quiet | tail -20
    speculum bench scaling --model $M --dtype bfloat16 --num-requests 64 --batch-sizes 1,64 --max-tokens 128 \
      --batch-invariant both --json $OUT/bi_scaling.json 2>&1 | quiet | tail -8 ;;
  eagle3)
    . scripts/device/common.sh
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --batch-invariant --method '{"method":"eagle3","num_speculative_tokens":4}' \
      --method '{"method":"eagle3","tree_topk":8,"tree_depth":4,"num_draft_tokens":32}' \
      --json $OUT/bi_eagle3.json 2>&1 | quiet | tail -16 ;;
  *) echo "usage: batch_invariant.sh tests|bench|eagle3" >&2; exit 2 ;;
esac
