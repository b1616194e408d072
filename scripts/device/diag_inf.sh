. scripts/device/common.sh
A='{"method":"ngram","num_speculative_tokens":4,"num_speculative_tokens_per_batch_size":"auto"}'
Z='{"method":"ngram","num_speculative_tokens":4,"num_speculative_tokens_per_batch_size":{"1-4096":0}}'
speculum bench serve --compare --model $M --max-num-seqs 64 --max-concurrency 64 --num-prompts 384 --max-tokens 128 \
  --sweep inf --warmup 4 --repeats 2 --speculative-config "$A" --speculative-config "$Z" \
  --result-json $OUT/diag.json --server-log-dir $OUT/logs_diag 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -22
