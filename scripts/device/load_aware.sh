# device: load-aware speculation on the default model (issue 13), in parts that each fit a 10-minute call:
#   bash scripts/device/load_aware.sh sweep   # bench serve --compare, rates 1..inf at 64 concurrent: auto, fixed k=4
#   bash scripts/device/load_aware.sh c1      # the same at concurrency 1: auto and fixed k = 1..4
#   bash scripts/device/load_aware.sh check   # the must-show verdicts from the two JSONs (they come back in $OUT)
#   bash scripts/device/load_aware.sh tune    # speculum tune --check at batch 1, 8, 64
# METHOD (default ngram; eagle3 for the shipped head), K (default 4), KS (the fixed k of c1, default 1..K),
# N: prompts per rate of the sweep, one count or one per rate of RATES (default: 24 at 1 req/s rising to
# 384 all at once, so that every run lasts several seconds: 40 prompts all at once take half a second).
# REPEATS (default 1): every server of the sweep started that many times, in turns, each rate's runs pooled
# (bench serve --repeats): at high load one server process differs from the next by up to 17% on the H200
# (no speculation all at once: 2,915 / 3,411 / 4,075 tok/s in three servers), so one run per config can
# fail 0.97 by chance. A sweep takes ~125 s per server: REPEATS=2 fits a call with auto alone (FIXED_TOO=),
# or with fixed k too on fewer rates (RATES=1,4,16,32,inf N=24,32,96,256,384).
# Results in $OUT: load_sweep.json, load_c1.json, load_check.{txt,json}, tune.{txt,json}, plots_*/ and server logs.
set -e
. scripts/device/common.sh
PART=${1:-sweep}
METHOD=${METHOD:-ngram}
K=${K:-4}
RATES=${RATES:-1,2,4,8,16,32,inf}
FIXED_TOO=${FIXED_TOO-1}   # the sweep runs fixed k=K beside auto (FIXED_TOO= : auto alone)
N=${N:-24,24,32,48,96,256,384}
cfg() { echo "{\"method\":\"$METHOD\",\"num_speculative_tokens\":$1${2:+,\"num_speculative_tokens_per_batch_size\":\"$2\"}}"; }
AUTO=$(cfg $K auto)
case $PART in
  sweep)
    speculum bench serve --compare --model $M --max-num-seqs 64 --max-concurrency 64 --num-prompts $N --max-tokens 128 \
      --sweep $RATES --warmup 4 --repeats ${REPEATS:-1} --speculative-config "$AUTO" ${FIXED_TOO:+--speculative-config "$(cfg $K)"} \
      --result-json $OUT/load_sweep.json --plot-dir $OUT/plots_sweep --server-log-dir $OUT/logs_sweep 2>&1 \
      | grep -v -E "Loading|Writing|it/s" | tail -40 ;;
  c1)
    FIXED=(); for k in ${KS:-$(seq 1 $K)}; do FIXED+=(--speculative-config "$(cfg $k)"); done
    speculum bench serve --compare --model $M --max-num-seqs 64 --max-concurrency 1 --num-prompts 16 --max-tokens 128 \
      --request-rate inf --warmup 2 --speculative-config "$AUTO" "${FIXED[@]}" \
      --result-json $OUT/load_c1.json --plot-dir $OUT/plots_c1 --server-log-dir $OUT/logs_c1 2>&1 \
      | grep -v -E "Loading|Writing|it/s" | tail -30 ;;
  check)
    # SWEEP / C1: where the JSONs of the earlier calls are (carried back into the tree, e.g. docs/results/h200/)
    python3 -m speculum.bench.load_check ${SWEEP:-docs/results/h200/load_sweep.json} ${C1:-docs/results/h200/load_c1.json} \
      --json $OUT/load_check.json | tee $OUT/load_check.txt ;;
  tune)
    speculum tune --model $M --check --batch-sizes 1,8,64 --num-prompts 64 --max-tokens 128 --max-k $K --repeats 2 \
      --speculative-config "$(cfg 1)" --json $OUT/tune.json 2>&1 | grep -v -E "Loading|Writing|it/s" | tee $OUT/tune.txt | tail -45 ;;
  *) echo "usage: load_aware.sh sweep|c1|check|tune" >&2; exit 2 ;;
esac
