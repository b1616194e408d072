# device: token trees (issue 11) on MT-bench, bf16, greedy, 256 new tokens, shipped heads.
# One device call per PART (each stays under the 10-minute limit); see scripts/device/README.md.
#   PART=tests  CUDA tests of trees (graphed tree verify and drafting) and of the heads
#   PART=sweep  node-budget sweep, 2 questions per category, batch 1: per head method chain k=4
#               and six dynamic trees verifying 8..32 tokens (top-4/8, depth 5/6; medusa depth 4);
#               the best tree per method (tokens/s) is kept in
#               /tmp/trees_best.json (and $OUT) for the next parts
#   PART=b1     all 80 questions, batch 1, one run: autoregressive, ngram, and every head method's
#               chain vs best tree (MEDUSA_TREE too); carry all four heads (~8 minutes)
#   PART=b1a    all 80 questions, batch 1: autoregressive, ngram, eagle and eagle3 chain vs best tree
#   PART=b1b    all 80 questions, batch 1: autoregressive, mtp and medusa chain vs best tree
#   PART=quick  batch 1, PPC (3) questions per category: autoregressive, and per METHODS (eagle3 medusa)
#               chain k=4 against its trees (MEDUSA_TREE too): a short run measuring one change
#   PART=b16    (INTERLEAVE=1: every engine loaded, the pooled batch through each in turn, ROUNDS times)
#               all 80 questions at once, batch 16 (bench offline pools the categories above batch 1
#               since 2026-12-02: before, each category ran alone, 5-10 sequences at most): every
#               config above, with the step profile
# (if the sweep of all four methods would not fit one call: METHODS="eagle eagle3" TAG=_a, then
# METHODS="mtp medusa" TAG=_b; the best trees accumulate in /tmp/trees_best.json)
# TREES="4 4 16;8 5 32" (top-k, depth, verified tokens; ';' between trees): b1a, b1b and b16 run
# these trees for every method instead of the sweep's best (Medusa: depth capped at its 4 heads).
# HEAD_KERNELS=torch: the heads draft on plain torch kernels (the "before" of 72e1646).
# MEDUSA_TREE=FILE: b1b also runs the static Medusa tree of scripts/medusa_tree.py's JSON FILE.
# VERDICT="off draft forward": b1, b1a, b1b and quick run each head config once per value of
# from_verdict (what a step launches from the device verdict; docs/config.md), in one run.
# NGRAM=0: b1 and b16 without their n-gram config; METHODS: b1's head methods (default all four).
# Every part but tests prints its table and writes JSON to $OUT; b1a, b1b and b16 also the step
# profile (--profile) of every config.
# Report and figure: python scripts/trees_report.py <the JSON files> (on the lead's machine).
PART=${PART:-sweep}
if [ "$PART" = tests ]; then  # tiny models only; joins the GGUF in /tmp when .gguf_b is carried
  if [ -d .gguf_b ]; then . scripts/device/common.sh; else export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; fi
  python3 -m pytest -q tests/test_trees_cuda.py tests/test_heads_cuda.py tests/test_kernels_cuda.py 2>&1 | tail -4
  exit
fi
. scripts/device/common.sh
B="speculum bench offline --model $M --dtype bfloat16 --max-tokens 256"
K='"num_speculative_tokens":4'
# the shipped heads, or with HEADS=/tmp/tr those train_heads.sh just trained (a method with no
# folder there, e.g. after METHODS=eagle3, keeps its shipped head)
mdl() { [ -n "$HEADS" ] && [ -d "$HEADS/$1" ] && echo ",\"model\":\"$HEADS/$1\""; }
chain() { echo "{\"method\":\"$1\"$(mdl $1),$K}"; }
tree() { echo "{\"method\":\"$1\"$(mdl $1),\"tree_topk\":$2,\"tree_depth\":$3,\"num_draft_tokens\":$4}"; }
# the best tree of a method from the sweep (fallback: top-8, depth 6 (medusa: 4), 32 tokens)
best() {
  python3 - "$1" "$HEADS" <<'EOF'
import json, os, sys
m, heads = sys.argv[1], sys.argv[2]
try:
    best = json.load(open("/tmp/trees_best.json"))[m]
except (OSError, KeyError):
    best = {"method": m, "tree_topk": 8, "tree_depth": 4 if m == "medusa" else 6, "num_draft_tokens": 32}
    if heads and os.path.isdir(f"{heads}/{m}"):
        best["model"] = f"{heads}/{m}"
print(json.dumps(best))
EOF
}
B="python3 scripts/device/head_kernels.py ${B#speculum }"
# INTERLEAVE=1 (batch 1 parts): every engine loaded at once, each category through all configs in
# turn (--interleave), so a drift of the machine's speed slows every config alike (two runs of the
# same code on 2026-12-02 differed by up to 14% per config when each ran its 20 s alone)
IL=(); [ "${INTERLEAVE:-0}" = 1 ] && IL=(--interleave)
# every part but the sweep runs autoregressive decoding once more at the end (--baseline-again): its
# ratio to the first run is the run's drift (batch 16 on 2026-12-02: configs running only plain
# steps measured 1.24-1.37x the autoregressive baseline); AGAIN=0 leaves it out
[ "${AGAIN:-1}" = 1 ] && IL+=(--baseline-again)
run() { $B "$@" 2>&1 | grep -v -E "Loading|Writing|it/s|INFO|WARNING"; }
# the trees of a method: TREES, else the sweep's best
trees() {
  if [ -z "$TREES" ]; then best "$1"; return; fi
  echo "$TREES" | tr ';' '\n' | while read -r k d n; do
    [ "$1" = medusa ] && [ "$d" -gt 4 ] && d=4
    tree "$1" "$k" "$d" "$n"
  done
}
tm() { trees "$1" | while IFS= read -r c; do printf -- '--method\n%s\n' "$c"; done; }
# MEDUSA_TREE=FILE (scripts/medusa_tree.py's JSON, e.g. docs/results/cpu/medusa_tree_calibrated_self_1202b.json):
# its static tree as a config, on the same medusa heads as the others
medusa_static() {
  local MH=""; [ -n "$HEADS" ] && [ -d "$HEADS/medusa" ] && MH="$HEADS/medusa"
  python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['config']; c.pop('model', None)
c.update({'model': sys.argv[2]} if sys.argv[2] else {}); print(json.dumps(c))" "$MEDUSA_TREE" "$MH"
}
# ARGS += for each method given: its chain k=4, its trees, and for medusa MEDUSA_TREE's static tree
# (VERDICT="off draft forward": each of them once per value of the config's from_verdict, in one run)
heads() {
  local A=() c v
  for m in "$@"; do
    mapfile -t T < <(tm $m); A+=(--method "$(chain $m)" "${T[@]}")
    [ $m = medusa ] && [ -n "$MEDUSA_TREE" ] && A+=(--method "$(medusa_static)")
  done
  if [ -z "$VERDICT" ]; then ARGS+=("${A[@]}"); return; fi
  for c in "${A[@]}"; do
    [ "$c" = --method ] && continue
    for v in $VERDICT; do ARGS+=(--method "${c%\}},\"from_verdict\":\"$v\"}"); done
  done
}
case $PART in
quick)
  # batch 1, PPC questions per category (default 3): autoregressive, then per METHODS (default
  # eagle3 medusa) the chain k=4 and its trees (and MEDUSA_TREE's static tree): a short run for
  # one change, within the few minutes a session has left
  ARGS=(); heads ${METHODS:-eagle3 medusa}
  run --batch-size 1 --prompts-per-category ${PPC:-3} --profile "${IL[@]}" "${ARGS[@]}" --json $OUT/trees_quick${TAG}.json ;;
sweep)
  ARGS=(--method "{\"method\":\"ngram\",$K}")
  for m in ${METHODS:-eagle eagle3 mtp medusa}; do
    d=5; D=6; [ $m = medusa ] && d=4 && D=4   # Medusa: one head per depth (the shipped one has 4)
    ARGS+=(--method "$(chain $m)")
    for t in "4 $d 8" "4 $d 16" "8 $d 16" "8 $D 24" "4 $D 32" "8 $D 32"; do ARGS+=(--method "$(tree $m $t)"); done
  done
  run --batch-size 1 --prompts-per-category ${PPC:-2} "${ARGS[@]}" --json $OUT/trees_sweep_b1${TAG}.json
  TAG=$TAG python3 - <<'EOF'
import json, os
rows = json.load(open(os.environ["OUT"] + "/trees_sweep_b1" + os.environ.get("TAG", "") + ".json"))["results"]
best = {}
for r in rows:
    c = r["config"] or {}
    if "tree_topk" not in c:
        continue
    m = c["method"]
    if m not in best or r["total"]["tokens_per_s"] > best[m][1]:
        best[m] = (c, r["total"]["tokens_per_s"])
out = {}
if os.path.exists("/tmp/trees_best.json"):  # an earlier sweep call (METHODS=...) chose the others
    out = json.load(open("/tmp/trees_best.json"))
out.update({m: c for m, (c, _) in best.items()})
json.dump(out, open("/tmp/trees_best.json", "w"))
json.dump(out, open(os.environ["OUT"] + "/trees_best.json", "w"), indent=1)
print("best trees:", json.dumps(out))
EOF
  ;;
b1)
  # all four head methods in one run with one autoregressive baseline and n-gram (the issue's
  # "in one run"; ~8 minutes for 11 configs on the H200: b1a and b1b together, one baseline less)
  # (METHODS="medusa" NGRAM=0: one method's chain and trees against autoregressive decoding)
  ARGS=(); [ "${NGRAM:-1}" = 1 ] && ARGS=(--method "{\"method\":\"ngram\",$K}"); heads ${METHODS:-eagle eagle3 mtp medusa}
  run --batch-size 1 --prompts-per-category ${PPC:-10} --profile "${IL[@]}" "${ARGS[@]}" --json $OUT/trees_b1${TAG}.json ;;
b1a)
  ARGS=(--method "{\"method\":\"ngram\",$K}"); heads eagle eagle3
  run --batch-size 1 --prompts-per-category ${PPC:-10} --profile "${IL[@]}" "${ARGS[@]}" --json $OUT/trees_b1a${TAG}.json ;;
b1b)
  ARGS=(); heads mtp medusa
  run --batch-size 1 --prompts-per-category ${PPC:-10} --profile "${IL[@]}" "${ARGS[@]}" --json $OUT/trees_b1b${TAG}.json ;;
b16)
  # each tree also with "auto": the tree or nothing per step, from its measured gain and cost
  auto() { python3 -c "import json,sys; c=json.loads(sys.argv[1]); c['num_speculative_tokens_per_batch_size']='auto'; print(json.dumps(c))" "$1"; }
  ARGS=(); [ "${NGRAM:-1}" = 1 ] && ARGS=(--method "{\"method\":\"ngram\",$K}")
  for m in ${METHODS:-eagle eagle3 mtp medusa}; do
    b=$(trees $m | head -1)
    ARGS+=(--method "$(chain $m)" --method "$b" --method "$(auto "$b")"); done
  AG=(); [ "${AGAIN:-1}" = 1 ] && AG=(--baseline-again)
  # INTERLEAVE=1: every engine loaded at once, the pooled batch through each in turn, ROUNDS (3)
  # times, each config's median round (a one-after-the-other run carried 15-30% on 2026-12-04)
  [ "${INTERLEAVE:-0}" = 1 ] && AG+=(--interleave --rounds ${ROUNDS:-3})
  run --batch-size 16 --prompts-per-category ${PPC:-10} --profile "${AG[@]}" "${ARGS[@]}" --json $OUT/trees_b16.json ;;
*) echo "unknown PART=$PART (tests, quick, sweep, b1, b1a, b1b, b16)"; exit 2 ;;
esac
