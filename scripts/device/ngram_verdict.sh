# device: n-gram drafted on the device from the verdict (issue 16), after setup.sh and common.sh
# (scripts/device/README.md). One interleaved run (every category through every engine in
# turn): from_verdict off (the host lookup after the verdict's copy: the "before"), draft
# (the lookup on the device from the verdict), forward (and the next verify forward
# launched from it), the same with a corpus of the target's answers, beside EAGLE-3's chain
# (the shipped head: carry its folder) and autoregressive decoding.
#   bash scripts/device/ngram_verdict.sh tests            # the CUDA tests of the device lookup
#   SET=mt_bench PPC=10 bash scripts/device/ngram_verdict.sh bench     # carry the corpus (CORPUS)
#   SET=other_tasks PPC=8 bash scripts/device/ngram_verdict.sh bench
#   bash scripts/device/ngram_verdict.sh shipped          # the defaults (from_verdict "forward" for n-gram)
#                                                         # and the corpus shipped with the plugin
# CORPUS: a corpus file (python -m speculum_ngram.corpus build), int32, or uint16 with 65535
# as the separator (half the size to carry). PROFILE=1 adds bench offline's --profile.
# JSON in $OUT: ngram_verdict_${SET}_b1.json.
set -e
. scripts/device/common.sh
PART=${1:-bench}
SET=${SET:-mt_bench}
PPC=${PPC:-10}
TOK=${TOK:-256}
CORPUS=${CORPUS:-results/corpus_u16.npy}
case $PART in
  tests)
    python3 -m pytest -q plugins/speculum-ngram/tests/ \
      tests/test_decode_attention_cuda.py 2>&1 | tail -5
    ;;
  bench)
    python3 -c "import numpy as np, sys; a = np.load(sys.argv[1]).astype(np.int64); a[a == 65535] = -1; \
np.save('/tmp/corpus.npy', a.astype(np.int32)); print('corpus', (a >= 0).sum(), 'tokens')" "$CORPUS"
    C='"options":{"corpus":"/tmp/corpus.npy"}'
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --interleave --mt-bench $SET ${PROFILE:+--profile} \
      --method '{"method":"ngram","num_speculative_tokens":4,"from_verdict":"off"}' \
      --method '{"method":"ngram","num_speculative_tokens":4}' \
      --method '{"method":"ngram","num_speculative_tokens":4,"from_verdict":"forward"}' \
      --method "{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"from_verdict\":\"forward\",$C}" \
      --method "{\"method\":\"ngram\",\"num_speculative_tokens\":6,\"from_verdict\":\"forward\",$C}" \
      --method '{"method":"eagle3","num_speculative_tokens":4}' \
      --json $OUT/ngram_verdict_${SET}_b1.json 2>&1 | grep -v -E "Loading|Writing|it/s|Warning|warn|INFO"
    ;;
  shipped)
    python3 -m pytest -q plugins/speculum-ngram/tests/test_ngram_device.py -k "cuda or kernel" 2>&1 | tail -2
    speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category $PPC --max-tokens $TOK \
      --interleave --mt-bench $SET --method '{"method":"ngram","num_speculative_tokens":4}' \
      --method '{"method":"ngram","num_speculative_tokens":4,"options":{"corpus":"shipped"}}' \
      --json $OUT/ngram_shipped_${SET}_b1.json 2>&1 | grep -v -E "Loading|Writing|it/s|Warning|warn|INFO"
    ;;
esac
