# device: CUDA tests of the heads, then tokens/s (bf16, batch 1) and acceptance (fp32) on MT-bench
. scripts/device/common.sh
python3 -m pytest -q tests/test_heads_cuda.py tests/test_kernels_cuda.py 2>&1 | tail -2
E='"num_speculative_tokens":4'
# the shipped heads, or with HEADS=/tmp/tr those just trained by train_heads.sh
m() { if [ -n "$HEADS" ]; then echo "{\"method\":\"$1\",\"model\":\"$HEADS/$1\",$E}"; else echo "{\"method\":\"$1\",$E}"; fi; }
METHODS=(--method "$(m eagle)" --method "$(m eagle3)" --method "$(m medusa)" --method "$(m mtp)"
         --method "{\"method\":\"ngram\",$E}")
# a draft model trained in this machine's session (train_heads.sh), if any
[ -d /tmp/tr/draft ] && METHODS+=(--method '{"method":"draft_model","model":"/tmp/tr/draft","num_speculative_tokens":2}'
                                  --method '{"method":"draft_model","model":"/tmp/tr/draft","num_speculative_tokens":3}')
speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC:-2} --max-tokens 256 \
  "${METHODS[@]}" --json $OUT/heads_speed_bf16.json 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -12
speculum bench offline --model $M --dtype float32 --batch-size 16 --prompts-per-category 10 --max-tokens 256 \
  "${METHODS[@]}" --json $OUT/heads_mal_fp32.json 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -12
