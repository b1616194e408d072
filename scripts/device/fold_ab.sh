# device: the host cuts of the nineteenth and twentieth sessions (one-kernel greedy chain
# verification, last tokens staged on the host, the verdict's count and tokens side by side)
# before and after, in turns in one call (~5 minutes): ROUNDS (2) x [UNFOLD=1, then as is] of
# `bench offline` on PPC (3) questions per category, 256 tokens, greedy, bf16, batch 1:
# autoregressive, METHOD (eagle3) chain k=4 and tree 8x6/32 (shipped head: carry its folder;
# METHOD=eagle's 8 MB fit one call with .gguf_b, eagle3's 19 MB do not) and ngram k=4, with the
# step profile; JSON per run in $OUT.
# Compare each run's ratios to its own autoregressive baseline (machines drift between runs).
. scripts/device/common.sh
K='"num_speculative_tokens":4'
H=${METHOD:-eagle3}
ARGS=(--method "{\"method\":\"ngram\",$K}" --method "{\"method\":\"$H\",$K}"
      --method "{\"method\":\"$H\",\"tree_topk\":8,\"tree_depth\":6,\"num_draft_tokens\":32}")
for r in $(seq ${ROUNDS:-2}); do
  for v in 1 0; do
    tag=$([ $v = 1 ] && echo before || echo after)
    UNFOLD=$v python3 scripts/device/unfold.py bench offline --model $M --dtype bfloat16 --max-tokens 256 \
      --batch-size 1 --prompts-per-category ${PPC:-3} --profile "${ARGS[@]}" --json $OUT/fold_${tag}_$r.json 2>&1 \
      | grep -v -E "Loading|Writing|it/s|INFO|WARNING" | tail -8
  done
done
python3 - <<'PY'
import glob, json, os
rows = {}
for f in sorted(glob.glob(os.environ["OUT"] + "/fold_*.json")):
    tag = os.path.basename(f)[5:-5]
    for r in json.load(open(f))["results"]:
        c = r["config"]
        name = "autoregressive" if not c else json.dumps(c, separators=(",", ":"))
        rows.setdefault(name, {})[tag] = (r["total"]["tokens_per_s"], r["total"].get("speedup"))
for name, by in rows.items():
    print(name[:60], " ".join(f"{t}: {v[0]:.1f}" + (f" ({v[1]:.3f}x)" if v[1] else "") for t, v in sorted(by.items())))
PY
