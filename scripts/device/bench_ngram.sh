# device: n-gram lookup variants on MT-bench (issue 16), bf16, greedy, 256 new tokens, batch 1,
# in one run with autoregressive decoding and the step profile of each. The replay of
# scripts/ngram_ceiling.py (docs/benchmarks.md, "The ceiling of n-gram lookup") puts the
# default lookup (n = 2..5, k = 4) at 1.70 tokens per target forward, n = 1..5 at 1.83 (k = 4)
# and 1.93 (k = 6): this run says what they give in tokens/s, where a verify of 5 or 7 tokens
# costs about one step but drafting on more steps costs host time.
#   INTERLEAVE=1 (--interleave: configs in turn per category), PPC (10: all 80 questions), NGRAMS ("min max k;..." to run other variants), TAG (file suffix),
#   NGRAM_TREES ("min max topk depth nodes;...", default "1 5 8 4 33;1 5 8 6 33": n-gram token
#   trees of up to topk candidates, depth tokens each, nodes verified counting the root; "" for none)
. scripts/device/common.sh
ARGS=()
while read -r lo hi k; do
  [ -n "$k" ] && ARGS+=(--method "{\"method\":\"ngram\",\"num_speculative_tokens\":$k,\"prompt_lookup_min\":$lo,\"prompt_lookup_max\":$hi}")
done < <(echo "${NGRAMS:-2 5 4;1 5 4;1 5 6;2 5 6}" | tr ';' '\n')
while read -r lo hi m d n; do
  [ -n "$n" ] && ARGS+=(--method "{\"method\":\"ngram\",\"prompt_lookup_min\":$lo,\"prompt_lookup_max\":$hi,\"tree_topk\":$m,\"tree_depth\":$d,\"num_draft_tokens\":$n}")
done < <(echo "${NGRAM_TREES-1 5 8 4 33;1 5 8 6 33}" | tr ';' '\n')
IL=(); [ "${INTERLEAVE:-0}" = 1 ] && IL=(--interleave)  # every config through each category in turn
speculum bench offline --model $M --dtype bfloat16 --max-tokens 256 --batch-size 1 --prompts-per-category ${PPC:-10} \
  --profile "${IL[@]}" "${ARGS[@]}" --json $OUT/ngram_b1${TAG}.json 2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING"
