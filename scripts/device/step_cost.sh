# device: the step cost (issue 16), in parts that each fit a 10-minute call:
#   bash scripts/device/session_setup.sh         # carry .whl, .gguf_a: install and the CUDA tests (decode
#                                                # attention, overlap, kernels, trees, heads)
#   bash scripts/device/step_cost.sh bench       # carry .gguf_b: bench step of both shapes (Triton decode attention
#                                                # against SDPA_BEFORE=sdpa), then MT-bench (80 questions, 256 tokens,
#                                                # greedy, bf16, batch 1): autoregressive and ngram k=4 with the step
#                                                # profile, with and without overlap, and the old attention path
#   bash scripts/device/step_cost.sh eagle3      # carry the eagle3 head's folder: eagle3 k=4 against autoregressive
#                                                # on prompts of about 100, 500 and 2,000 tokens, both attention paths
#   bash scripts/device/step_cost.sh after       # carry .gguf_b: AR and ngram k=4 (lookup min 2 and 1), profiled
#   bash scripts/device/step_cost.sh eagle3_after  # carry the eagle3 head's folder (model joined already): eagle3 k=4, 2
#                                                # and ngram+eagle3 k=4
#   bash scripts/device/step_cost.sh plan        # after setup.sh (no model): the GEMM plan's CUDA test, then bench step of
#                                                # both shapes with the plan and with SPECULUM_GEMM_TUNE=0, in turns
#                                                # (step_{smollm,8b}_plan{,_off}.json), ~5 minutes
# Results in $OUT: step_{smollm,8b}{,_sdpa}.json, offline_{after,no_overlap,sdpa}.json, long_{N}{,_sdpa}.json.
set -e
PART=${1:-bench}
PPC=${PPC:-10}
TOK=${TOK:-256}
quiet() { grep -v -E "Loading|Writing|it/s|Warning|warn"; }
NGRAM='{"method":"ngram","num_speculative_tokens":4}'
case $PART in
  bench)
    . scripts/device/common.sh
    for att in triton sdpa; do
      sfx=$([ $att = sdpa ] && echo _sdpa || true)
      SPECULUM_ATTENTION=$att speculum bench step --shape smollm2-135m --batch-sizes 1,16 --query-lens 1,2,5,9,17,33 \
        --iters 50 --json $OUT/step_smollm$sfx.json 2>&1 | quiet
      SPECULUM_ATTENTION=$att speculum bench step --shape llama3-8b --batch-sizes 1,16 --query-lens 1,2,5,9,17,33 \
        --iters 30 --json $OUT/step_8b$sfx.json 2>&1 | quiet
    done
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --method "$NGRAM" --profile --json $OUT/offline_after.json 2>&1 | quiet | tail -22
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC_BEFORE:-4} \
      --max-tokens $TOK --method "$NGRAM" --profile --no-overlap --json $OUT/offline_no_overlap.json 2>&1 | quiet | tail -6
    SPECULUM_ATTENTION=sdpa speculum bench offline --model $M --dtype bfloat16 --batch-size 1 \
      --prompts-per-category ${PPC_BEFORE:-4} --max-tokens $TOK --method "$NGRAM" --profile --no-overlap \
      --json $OUT/offline_sdpa.json 2>&1 | quiet | tail -6 ;;
  plan)
    export PYTHONPATH=/tmp/site
    python3 -m pytest -q tests/test_gemm_plan.py 2>&1 | tail -2
    for shape in smollm2-135m llama3-8b; do
      short=$([ $shape = llama3-8b ] && echo 8b || echo smollm)
      for tune in 1 0; do
        sfx=$([ $tune = 0 ] && echo _off || true)
        SPECULUM_GEMM_TUNE=$tune speculum bench step --shape $shape --batch-sizes 1,16 --query-lens 1,2,5,9,17,33 \
          --iters 50 --json $OUT/step_${short}_plan$sfx.json 2>&1 | quiet
      done
    done ;;
  eagle3)
    . scripts/device/common.sh
    python3 scripts/long_prompts.py --tokens 100,500,2000 --out /tmp/long
    for n in 100 500 2000; do
      for att in triton sdpa; do
        sfx=$([ $att = sdpa ] && echo _sdpa || true)
        SPECULUM_ATTENTION=$att speculum bench offline --model $M --dtype bfloat16 --batch-size 1 \
          --mt-bench /tmp/long/long_$n.jsonl --prompts-per-category 1 --max-tokens $TOK \
          --method '{"method":"eagle3","num_speculative_tokens":4}' --method "$NGRAM" \
          --json $OUT/long_$n$sfx.json 2>&1 | quiet | tail -5
      done
    done ;;
  after)
    # the overlap of speculative steps (n-gram drafted ahead; hidden-state heads drafted ahead
    # and rewound) without the before runs: AR, ngram k=4 (prompt_lookup_min 2 and 1), then
    # eagle3 k=4 and k=2 if its head is there (carry its folder in a call without the GGUF)
    . scripts/device/common.sh
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --method "$NGRAM" --method '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1}' --profile \
      --json $OUT/offline_after3.json 2>&1 | quiet | tail -26 ;;
  eagle3_after)
    . scripts/device/common.sh
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC_E3:-2} \
      --max-tokens $TOK --method '{"method":"eagle3","num_speculative_tokens":4}' \
      --method '{"method":"eagle3","num_speculative_tokens":2}' \
      --method '{"method":"ngram+eagle3","num_speculative_tokens":4}' --profile --json $OUT/eagle3_after.json 2>&1 \
      | quiet | tail -26 ;;
  *) echo "usage: step_cost.sh bench|eagle3|after|eagle3_after" >&2; exit 2 ;;
esac
