# device call 3: CUDA tests of the heads, then MT-bench (all 80 questions by default), greedy,
# 256 new tokens, bf16, batch 1, chain k=4: tokens/s and acceptance for autoregressive, ngram,
# the heads and the trained draft model in one run. With HEADS=/tmp/tr the heads just trained
# by train_heads.sh (the machine must have stayed warm; a method it did not train: the shipped head), else the
# shipped ones. TREES=1: the heads' trees too; INTERLEAVE=1: runs in turns. SET=other_tasks: the
# 40 prompts of five task types MT-bench lacks (8 per type: PPC=8 for all), JSON heads_speed_bf16_other_tasks.json
. scripts/device/common.sh
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q tests/test_heads_cuda.py tests/test_kernels_cuda.py 2>&1 | tail -2
K=${K:-4}
E="\"num_speculative_tokens\":$K"
# a head not trained in this call (no $HEADS/<method>) is the shipped one (carry its folder)
m() { if [ -n "$HEADS" ] && [ -f "$HEADS/$1/config.json" ]; then echo "{\"method\":\"$1\",\"model\":\"$HEADS/$1\",$E}"; else echo "{\"method\":\"$1\",$E}"; fi; }
METHODS=(--method "{\"method\":\"ngram\",$E}" --method "$(m eagle3)" --method "$(m eagle)" --method "$(m mtp)"
         --method "$(m medusa)")
# every other folder train_heads.sh left in $HEADS (eagle2ce, medusaseq, mtp2regled, draft3, ...), benched as the
# method its config.json records (speculum.method; a trained draft's "draft" is the draft_model method)
spec_method() { python3 -c 'import json, sys
m = json.load(open(sys.argv[1])).get("speculum", {}).get("method", "")
print({"draft": "draft_model"}.get(m, m))' "$1"; }
variant() { [ -f "$1" ] || return 0; local sm; sm=$(spec_method "$1")
            [ -z "$sm" ] || METHODS+=(--method "{\"method\":\"$sm\",\"model\":\"${1%/config.json}\",$E}"); }
for c in ${HEADS:+$HEADS/*/config.json}; do
  case "$(basename "$(dirname "$c")")" in eagle3|eagle|mtp|medusa|draft) ;; *) variant "$c" ;; esac
done
# ALSO="/tmp/tr": every folder of these too, the default names included (an earlier phase's heads beside HEADS=/tmp/tr2)
for a in ${ALSO:-}; do for c in "$a"/*/config.json; do variant "$c"; done; done
D=${DRAFT:-${HEADS:-/tmp/tr}/draft}
[ -f $D/model.safetensors ] && METHODS+=(--method "{\"method\":\"draft_model\",\"model\":\"$D\",$E}")
# DRAFT_KS="2 3": the draft at those k too (its acceptance falls fast along a chain: 0.45, 0.24, 0.15, 0.12 per
# position on the H100, 2026-12-05, so a shorter chain may pay more)
for dk in ${DRAFT_KS:-}; do
  [ -f $D/model.safetensors ] && METHODS+=(--method "{\"method\":\"draft_model\",\"model\":\"$D\",\"num_speculative_tokens\":$dk}")
done
# DRAFT_AB=1: the draft also drafting after the verdict's copy (from_verdict "off": before the thirty-second session's
# chains drafted from the device verdict), in the same run
[ "${DRAFT_AB:-0}" = 1 ] && [ -f $D/model.safetensors ] && \
  METHODS+=(--method "{\"method\":\"draft_model\",\"model\":\"$D\",$E,\"from_verdict\":\"off\"}")
# TREES=1: each head's tree too (the configurations docs/trees.md measured best for the heads before)
t() { local h=""; [ -n "$HEADS" ] && [ -f "$HEADS/$1/config.json" ] && h="\"model\":\"$HEADS/$1\","
      echo "{\"method\":\"$1\",$h\"tree_topk\":$2,\"tree_depth\":$3,\"num_draft_tokens\":$4}"; }
[ "${TREES:-0}" = 1 ] && METHODS+=(--method "$(t eagle3 8 6 32)" --method "$(t eagle 8 6 32)" --method "$(t mtp 4 5 16)")
SET=${SET:-mt_bench}; SUFFIX=""; [ "$SET" = mt_bench ] || SUFFIX="_$SET"
# INTERLEAVE=1: each category through every config in turn (the machine's drift shared by all)
speculum bench offline --model $M --dtype bfloat16 --batch-size 1 --prompts-per-category ${PPC:-10} --max-tokens 256 \
  $([ "${INTERLEAVE:-0}" = 1 ] && echo --interleave) \
  --mt-bench $SET "${METHODS[@]}" --json $OUT/heads_speed_bf16$SUFFIX.json 2>&1 | grep -v -E "Loading|Writing|it/s" | tail -40
