# device: rate inf only (384 prompts, 64 concurrent, 128 tokens, 2 repeats pooled): no speculation
# against "auto" and against a schedule of k = 0 at every batch size (the speculative server with a
# policy that never weighs), to tell the policy's own cost from the server's spread (docs/benchmarks.md,
# eighth session). After setup.sh; carry .gguf_b. JSON and server logs in $OUT.
set -e
. scripts/device/common.sh
A='{"method":"ngram","num_speculative_tokens":4,"num_speculative_tokens_per_batch_size":"auto"}'
Z='{"method":"ngram","num_speculative_tokens":4,"num_speculative_tokens_per_batch_size":{"1-4096":0}}'
speculum bench serve --compare --model $M --max-num-seqs 64 --max-concurrency 64 --num-prompts 384 --max-tokens 128 \
  --sweep inf --warmup 4 --repeats 2 --speculative-config "$A" --speculative-config "$Z" \
  --result-json $OUT/diag.json --server-log-dir $OUT/logs_diag 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -22
