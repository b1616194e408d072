# device: issue 16's serving figures, the command of docs/benchmarks.md's first serving table
# (2026-11-30, before the step-cost work) on the current code: TTFT and TPOT at 1 request/s and
# throughput all at once, no speculation against n-gram k=4. After setup.sh, carrying .gguf_b.
#   bash scripts/device/serve_compare.sh      # results in $OUT/serve_compare.json, plots, server logs
# REPEATS=N starts each server N times in turns and pools each rate (one server differs from the
# next by up to 17% all at once on the H200).
set -e
. scripts/device/common.sh
speculum bench serve --compare --model $M --speculative-config '{"method":"ngram","num_speculative_tokens":4}' \
  --num-prompts ${N:-40} --max-tokens 128 --sweep ${RATES:-1,4,16,64,inf} --max-num-seqs 64 --warmup 4 \
  --repeats ${REPEATS:-1} --result-json $OUT/serve_compare.json --plot-dir $OUT/plots_serve \
  --server-log-dir $OUT/logs_serve 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -40
