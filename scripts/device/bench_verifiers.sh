# device: acceptance rules side by side (speculum bench verifiers, docs/verifiers.md) on MT-bench.
#   bash scripts/device/bench_verifiers.sh mal    MAL at T 0.7 and 1.0, eagle3 and draft_model, rejection vs block (fp32)
#   bash scripts/device/bench_verifiers.sh speed  tokens/s at batch 1 (bf16, T 0.7): rejection, block, typical acceptance
#   bash scripts/device/bench_verifiers.sh drift  typical acceptance vs rejection at T 0.7: MAL and drift (fp32, 4 samples)
# Each part fits one device call (10 min); PPC prompts per category (default 10, 4 for speed).
. scripts/device/common.sh
E='"num_speculative_tokens":4'
EAGLE3="{\"method\":\"eagle3\",$E}"
# the truncated self-draft (no trained draft ships); a draft trained in this session if any
DM="{\"method\":\"draft_model\",\"model\":\"@target\",$E,\"options\":{\"num_layers\":24}}"
[ -d /tmp/tr/draft ] && DM="{\"method\":\"draft_model\",\"model\":\"/tmp/tr/draft\",$E}"
B="speculum bench verifiers --model $M --max-tokens 256"
case "${1:-mal}" in
  mal)   $B --dtype float32 --batch-size 16 --prompts-per-category ${PPC:-10} --temperature 0.7,1.0 \
           --verifier rejection_sampler,block --logprobs --method "$EAGLE3" --method "$DM" \
           --json $OUT/verifiers_mal_fp32.json ;;
  speed) $B --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC:-4} --temperature 0.7 \
           --verifier rejection_sampler,block,typical_acceptance --method "$EAGLE3" \
           --json $OUT/verifiers_speed_bf16.json ;;
  drift) $B --dtype float32 --batch-size 32 --prompts-per-category ${PPC:-10} --samples 4 --temperature 0.7 \
           --verifier rejection_sampler,typical_acceptance --logprobs --method "$EAGLE3" \
           --json $OUT/typical_drift_fp32.json ;;
esac 2>&1 | grep -v -E "^INFO|Loading|Writing|it/s" | tail -12
