# device: the same LLM(...) code on the torch and the JAX backend (jax with CUDA is installed
# there), tokens/s side by side. One run per call (each takes a few minutes):
#   bash scripts/device/bench_backends.sh b1_bf16    # batch 1, bf16: AR, ngram k=4, 8-layer self-draft k=3
#   bash scripts/device/bench_backends.sh b1_fp32    # the same in fp32 (outputs must be identical)
#   bash scripts/device/bench_backends.sh b32_bf16   # 32 concurrent requests, bf16: AR, ngram k=4
# Each backend runs in its own process (--separate-processes): torch's and JAX's allocators
# and CUDA libraries never share one.
. scripts/device/common.sh
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -m pytest -q tests/test_jax_backend.py -k "matches_torch or verifiers_in_the_engine" 2>&1 | tail -1
K='"num_speculative_tokens":4'
NGRAM=(--method "{\"method\":\"ngram\",$K}")
DRAFT=(--method "{\"model\":\"$M\",\"num_speculative_tokens\":3,\"options\":{\"num_layers\":8}}")
b() { speculum bench backends --model $M --backend torch,jax --separate-processes "$@" 2>&1 \
        | grep -v -E "Loading|Writing|it/s|INFO" | tail -8; }
case "${1:-b1_bf16}" in
  b1_bf16) b --dtype bfloat16 --batch-size 1 --num-prompts 10 --max-tokens 128 "${NGRAM[@]}" "${DRAFT[@]}" \
             --json $OUT/backends_b1_bf16.json ;;
  b1_fp32) b --dtype float32 --batch-size 1 --num-prompts 10 --max-tokens 128 "${NGRAM[@]}" "${DRAFT[@]}" \
             --json $OUT/backends_b1_fp32.json ;;
  b32_bf16) b --dtype bfloat16 --batch-size 32 --num-prompts 64 --max-tokens 128 "${NGRAM[@]}" \
             --json $OUT/backends_b32_bf16.json ;;
  *) echo "unknown run $1: b1_bf16, b1_fp32 or b32_bf16"; exit 2 ;;
esac
