# device: the host cuts of the nineteenth and twentieth sessions (one-kernel greedy chain
# verification, last tokens staged on the host, the verdict's count and tokens side by side)
# before and after in one process (~4 minutes at PPC=2): `bench offline --interleave` on PPC (2)
# questions per category, 256 tokens, greedy, bf16, batch 1, every config twice, the first
# engine of each without the cuts (`UNFOLD=alt scripts/device/unfold.py`), so each category runs
# through both in turn: autoregressive (the repeated baseline is the unfolded one), ngram k=4,
# METHOD (eagle3) chain k=4 and tree 8x6/32 (shipped head: carry its folder; METHOD=eagle's 8 MB
# fit one call with .gguf_b, eagle3's 19 MB do not), with the step profile (PROFILE=0: without); ROUNDS (1) runs,
# JSON per run in $OUT. (Two runs of the same code in turns differed by up to 20% a config on
# 2026-12-03: only the interleaved comparison is worth reading.)
. scripts/device/common.sh
K='"num_speculative_tokens":4'
H=${METHOD:-eagle3}
ARGS=()
for c in "{\"method\":\"ngram\",$K}" "{\"method\":\"$H\",$K}" \
         "{\"method\":\"$H\",\"tree_topk\":8,\"tree_depth\":6,\"num_draft_tokens\":32}"; do
  ARGS+=(--method "$c" --method "$c")
done
for r in $(seq ${ROUNDS:-1}); do
  UNFOLD=alt python3 scripts/device/unfold.py bench offline --model $M --dtype bfloat16 --max-tokens 256 \
    --batch-size 1 --prompts-per-category ${PPC:-2} --interleave --baseline-again $([ "${PROFILE:-1}" = 1 ] && echo --profile) "${ARGS[@]}" \
    --json $OUT/fold_$r.json 2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING|CUDA calls" | tail -12
done
python3 scripts/device/fold_report.py $OUT/fold_*.json
