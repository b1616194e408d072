# device call 2: one command trains every method from scratch in one call of at most 10 minutes.
#  1. self-distillation data once for all methods (bf16, CUDA graphs, batched through speculum.LLM):
#     greedy + sampled answers, long-form answers and target-written second turns, MT-bench answers
#     for evaluation only (at most GEN_TL seconds; the shards finished by then are used);
#  2. eagle, eagle3, medusa, mtp and a draft model side by side on the GPU for the time left
#     (INIT_FROM_SHIPPED=1: each head starts from the one shipped for it, --init-from, so that
#     sessions add up; carry the heads' folders, or put them in the tree: tree.sh heads;
#     INIT_DIR=<TR of an earlier call>: each method from what that call left, with another TR)
#     (the draft's shape from /tmp/draft_shapes.json when draft_shapes.sh ran in this warm session);
#     (DATA_ONLY=1: stop after step 1, the answers into $OUT as answers.tgz.part_* (15 MiB parts): a data call, whose
#     answers a training call carries back in as ANSWERS, so training gets the whole call)
#  3. heads, reports, logs and training curves into $OUT as tar parts of 15 MiB (the draft's
#     weights left out when they do not fit), and the answers alone (answers.tgz.part_*: gzipped token ids, no
#     hidden states) for a later call to carry back in as ANSWERS=<folder> (states recomputed
#     by prefill, generation continuing where the answers stop).
. scripts/device/common.sh
T0=$(date +%s)
BUDGET=${BUDGET:-550}    # seconds this script may take (the call's limit is 600)
GEN_TL=${GEN_TL:-150}    # generation stops here
RESERVE=${RESERVE:-75}   # trainer start-up, final validation, export and packing
TR=${TR:-/tmp/tr}
mkdir -p $TR
# METHODS: which trainers share the GPU (default all five; e.g. METHODS=eagle3 gives one head the whole GPU)
METHODS=${METHODS:-eagle eagle3 medusa mtp draft}
# how many trainers fit side by side: each holds 15-25 GB of the GPU (four on an 80 GB H100, 2026-12-05: the fourth ran
# out of memory at its first step), so a card holds one per 22 GB; more are refused here, before the data step spends
# the call (MAX_TRAINERS=N to try anyway)
if [ "${PREP_ONLY:-0}" != 1 ] && [ "${DATA_ONLY:-0}" != 1 ]; then
  GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | awk '{print int($1 / 1024)}')
  MAX_TRAINERS=${MAX_TRAINERS:-$(( ${GPU_GB:-0} > 0 ? GPU_GB / 22 : 99 ))}
  N_TRAINERS=$(echo $METHODS | wc -w)
  if [ $N_TRAINERS -gt $MAX_TRAINERS ]; then
    echo "METHODS ($METHODS) is $N_TRAINERS trainers; this GPU's ${GPU_GB} GB holds about $MAX_TRAINERS side by side"
    echo "(15-25 GB each): give METHODS fewer, or MAX_TRAINERS=$N_TRAINERS to try anyway"; exit 2
  fi
fi
if [ -n "${INIT_DIR:-}" ] && [ "$(realpath -m $INIT_DIR)" = "$(realpath -m $TR)" ]; then
  echo "INIT_DIR ($INIT_DIR) is where this call writes (TR): give the call another TR (e.g. TR=/tmp/tr2)"; exit 2
fi
# answers generated in an earlier call (python -m speculum.train.distill export, carried as ANSWERS):
# their hidden states are recomputed by prefill and generation continues where they stop
if [ -n "$ANSWERS" ] && [ -d "$ANSWERS" ]; then
  # keyed again for this machine's model (import): the converted folder's name may differ
  python3 -m speculum.train.distill import $ANSWERS/*/ --model $M
fi
# SELF_PROMPTS=N: N chat requests written by the target itself (python -m speculum.train.self_prompts:
# its chat template up to a user turn, sampled; MT-bench kept out) are answered first, as --data rows
# (seconds on the H200; the file comes back in $OUT)
SELF=""
if [ "${SELF_PROMPTS:-0}" -gt 0 ]; then
  # --after: the DATA_ARGS files' requests are not written again, and the seeds continue past theirs
  # (the same seed writes the same requests: 2026-12-04's "new" 3,000 were 2026-12-03's)
  python3 -m speculum.train.self_prompts --model $M --num $SELF_PROMPTS --out $TR/self_prompts.jsonl \
    --dtype bfloat16 --batch 512 $(echo " ${DATA_ARGS:-}" | sed 's/ --data / --after /g') 2>&1 \
    | grep -v -E "it/s|prompt/s|INFO" | tail -2
  cp $TR/self_prompts.jsonl $TR/self_prompts.jsonl.json $OUT/ && SELF="--data $TR/self_prompts.jsonl"
  echo "self prompts: $(( $(date +%s) - T0 )) s"
fi
D="--model $M --num-prompts ${NPROMPTS:-4728} --max-prompt-tokens ${MAXPROMPT:-512} --max-tokens ${MAXTOK:-384} --extra-answers ${EXTRA:-2} \
   --extra-temperature ${EXTRA_T:-0.7,1.0} --long-form ${LONG:-2} --template-long-form ${TLONG:-1} \
   --second-turns ${SECOND:-0.5} \
   --gen-batch ${GEN_BATCH:-512} --gen-shard-size 128 --gen-dtype bfloat16 --gen-time-limit $GEN_TL \
   --eval-prompts mt_bench --eval-num-prompts 80 ${DATA_ARGS:-} $SELF ${RECORD_FOR:+--record-for $RECORD_FOR} \
   --states ${STATES:-disk}"
# RECORD_FOR=mtp (methods, comma-separated): the data holds only the hidden states these methods train on, where
# every installed method's are recorded by default (EAGLE-3's four a token: 2026-12-07, the carried 8 M answer
# tokens' states and 2,616 requests more filled the H100's 64 GB disk); answers carried in are found all the same
export_answers() {  # the answers alone (token ids, no hidden states) into /tmp/answers.tgz
  rm -rf /tmp/answers && mkdir -p /tmp/answers
  for d in $SPECULUM_CACHE/distill/*/; do python3 -m speculum.train.distill export $d /tmp/answers | tail -1; done
  # gzipped: 8.01 M answer tokens are 48 MB as a tar and 8.4 MB gzipped (the form docs/results keeps, answers.tgz);
  # as a plain tar they would pass the ~60 MB a call brings back once the answers grow much past 8 M tokens
  tar czf /tmp/answers.tgz -C /tmp answers
}
# the answers into $OUT as answers.tgz.part_* (15 MiB parts: a file coming back from a call holds at most 16 MiB);
# here, `cat answers.tgz.part_* > docs/results/<card>/<run>/answers.tgz` is the file a later call carries
put_answers() { split -b 15M /tmp/answers.tgz $OUT/answers.tgz.part_; }
send_answers() {  # a data call's end: the answers and the data log back
  export_answers && put_answers && cp $TR/data.log $OUT/
}
# (each --data file's answers are a cache of their own, found by the file's name and size in any order:
# a training call after a data call gives the same DATA_ARGS plus --data <the self_prompts.jsonl that came back>)
# (DATA_ONLY: --answers-only, no prefill of the carried answers' hidden states: the training call makes them)
DM=${RECORD_FOR%%,*}  # the data call's method: one whose layers are recorded
# STATES=online: no hidden states on disk at all (speculum train --states online, in $D): the data step writes answers
# only and every trainer has the target prefill its batches; for data whose states pass the disk (EAGLE-3 past ~12 M
# answer tokens)
if [ "${STATES:-disk}" = online ] && [ -n "${RECORD_FOR:-}" ]; then
  echo "STATES=online writes no hidden states; RECORD_FOR chooses which are written: leave RECORD_FOR unset"; exit 2
fi
speculum train ${DM:-eagle3} $D --prepare-only $([ "${DATA_ONLY:-0}" = 1 ] && echo --answers-only) > $TR/data.log 2>&1 || {
  tail -20 $TR/data.log; echo "self-distillation failed"
  # a data call's answers come back all the same (2026-12-07: the disk filled while the states were written, and
  # 2,616 requests' answers were lost with the call)
  if [ "${DATA_ONLY:-0}" = 1 ] || [ "${EXPORT_ANSWERS:-0}" = 1 ]; then send_answers && echo "the answers made so far: in \$OUT"; fi
  exit 1; }
grep -v -E "it/s|s/it|prompt/s|Loading|Converting" $TR/data.log | tail -4
echo "self-distillation: $(( $(date +%s) - T0 )) s"
# PREP_ONLY=1: stop here with the answers' hidden states made (the join call can spend the prefill, so that the
# training call that follows on the warm machine, with the same data options and no ANSWERS, trains for its whole budget)
# (with GEN_TL above a few seconds such a call also answers rows not answered yet: EXPORT_ANSWERS=1 sends every answer
# back into $OUT as answers.tgz.part_*, for a later session to carry in as ANSWERS)
if [ "${PREP_ONLY:-0}" = 1 ]; then
  [ "${EXPORT_ANSWERS:-0}" = 1 ] && send_answers
  exit 0
fi
if [ "${DATA_ONLY:-0}" = 1 ]; then  # a data call: the answers come back, training is another call's
  send_answers && ls -la $OUT
  exit 0
fi
TL=$(( BUDGET - ($(date +%s) - T0) - RESERVE ))
echo "training for $TL s"
T="$D --cached-data-only --max-len ${MAXLEN:-640} --batch-size ${BS:-32} --time-limit $TL --steps 1000000 \
   --warmup 100 --eval-every 0 --eval-seconds ${EVAL_S:-45} --save-every 5000 --val-max-seqs 256 --threads 2 --amp bf16 \
   $([ "${KEEP_BEST:-1}" = 1 ] && echo --keep-best) \
   ${TRAIN_ARGS:-}"  # TRAIN_ARGS: more options for every trainer, e.g. "--lr 3e-4" when continuing a shipped head
# (--keep-best, KEEP_BEST=0 to leave it out: each head is exported at its best validation, step 0 included, so a
# head continued from the shipped one never comes back worse on validation than it went in; 2026-12-03's
# medusa heads peaked after 45 s and lost 0.07 tokens per step of validation by the end; a head trained before
# 2026-12-06 was trained on another validation split and has seen most of today's validation prompts, so its step 0
# does not compete (the trainer warns): the thirty-eighth session's run 1 kept step 0 before that fix; the last
# step's weights come back beside an earlier step kept, in <method>/last-step/)
SHAPE=""; [ -f /tmp/draft_shapes.json ] && SHAPE="--shape /tmp/draft_shapes.json"
# the draft keeps the target's embedding (and so can leave it out of its checkpoint) at the target's width only
EMB="--embeddings-from-target"
[ -f /tmp/draft_shapes.json ] && ! python3 -c "import json, sys; d = json.load(open('/tmp/draft_shapes.json'))
sys.exit(0 if d.get('recommended', d).get('hidden_size', 576) == 576 else 1)" && EMB=""
PIDS=()
# The default entries (eagle eagle3 medusa mtp draft) train the kinds shipped now, so INIT_FROM_SHIPPED=1 continues
# each shipped head (tests/test_device_scripts.py checks their options against the shipped configs):
# eagle: two layers, the token loss weighing most (--ce-weight 1 --reg-weight 0.1, where EAGLE-1's paper has 0.1 and
#   1: EAGLE-3 found the feature regression holds a head back and dropped it), the kind shipped since the thirty-first
#   session; eagle2ce: the same (its name in that session's commands)
# eagle3: drafting every token (--draft-tail: the target's LM head beyond its draft vocabulary), shipped since the
#   twenty-fourth session; eagle3tail: the same (its earlier name); eagle3own: the draft vocabulary only (from
#   scratch: a head with the tail cannot be continued without it)
# medusa: sequentially dependent heads (--sequential, after Hydra: each head also reads the token its state produced
#   and the tokens drafted before it) under a prefix layer (--prefix-layer), shipped since the thirty-fourth session;
#   medusapre: the same (its earlier name); medusaseq: the sequential heads alone (shipped from the thirty-first to
#   the thirty-third session)
# eagle, mtp, medusa and the draft: the loss over the whole vocabulary (--loss-vocab 0; the CLI's 8,192 most frequent
#   tokens are for the CPU; in row chunks recomputed in backward, so the trainers fit side by side); the draft saved
#   without the target's embedding (--embeddings-from-target: 14 MB for two layers, so it comes back from the call)
#   and continued from DRAFT_INIT=<a carried draft folder> when given (whatever INIT_FROM_SHIPPED says)
# Variants beside them:
# eaglece: eagle's loss with one layer (never from the shipped two-layer head; INIT_DIR=<folder with eaglece>
#   continues a one-layer head, e.g. the twenty-eighth session's: git show f510b2f:<the eagle head's files>)
# eagle2: two layers on the paper's loss (the thirtieth session's, grown from a one-layer head: its layer, then one
#   whose output projections start at zero)
# medusa4: MEDUSA4_LAYERS (4) blocks per sequential head under the prefix layer, grown from the shipped heads (their
#   blocks, then identity ones)
# medusatok: token-aware Medusa heads (--token-input: each head also reads the token its state produced), the kind
#   shipped from the twenty-second to the thirtieth session (never from the shipped sequential heads)
# the prefix layer (after Hydra++'s prefix attention): one decoder layer over the heads' features of every position, so
#   head 0 attends over the sequence as an EAGLE layer does; grown onto heads without one, it starts as the identity,
#   so they draft as before until trained
# mtp2: an MTP module of two decoder layers (--num-layers 2, a speculum extension of DeepSeek-V3's format), grown
#   from the shipped one-layer module (its layer, then one whose output projections start at zero: it drafts as the
#   shipped module until trained), as eagle grew to two layers in the thirtieth session
# mtp6: the shipped MTP module trained on six unrolled positions with a flatter weighing (--num-positions 6
#   --step-decay 0.9: the later chain steps, where its acceptance falls, weigh more); the same module format
# mtpreg, mtp2reg: the shipped MTP module (one layer; mtp2reg grown to two) trained with EAGLE-1's feature regression
#   beside the token loss (--reg-weight 0.1, as the shipped eagle head: its normed output onto the target's next
#   final normed state); the eagle head, the same chain on the same data, accepts more from its first step on
#   (validation 0.750 against 0.710 at position 1); both moved as plain continuation does (H100, 2026-12-06: MAL 2.24)
# mtp2regled: the shipped module grown to two layers and trained regression-led (--reg-weight 1 --ce-weight 0.1, EAGLE-1's
#   paper, as the eagle head was for most of its steps before its token-led run moved it) with ARGS_mtp2regled="--no-keep-best"
#   (that phase lowers the token acceptance on purpose, 2.908 -> 2.77 in 205 s on the H100: --keep-best exported its
#   start, the thirty-sixth session); continue it token-led with INIT_DIR=<its TR> ARGS_mtp2regled="--ce-weight 1 --reg-weight 0.1"
#   (thirty-seventh session: 423 s regression-led, then 244 s token-led: validation 2.963, MT-bench MAL 2.28 against the
#   shipped module's 2.23, but 1.22x against 1.34x: the second layer costs more than it gains; not shipped)
# mtpregled: the same two phases on the shipped one-layer module (its step stays as cheap as the shipped one's)
# draft3: the draft grown to three layers (--num-layers 3: its layers, then a copy of its last whose output projections
#   start at zero, so it drafts as the draft it grew from until trained); from the shipped draft with INIT_FROM_SHIPPED=1
for m in "eagle=eagle --loss-vocab 0 --num-layers 2 --ce-weight 1 --reg-weight 0.1" "eagle2=eagle --loss-vocab 0 --num-layers 2" \
         "eagle2ce=eagle --loss-vocab 0 --num-layers 2 --ce-weight 1 --reg-weight 0.1" "eaglece=eagle --loss-vocab 0 --ce-weight 1 --reg-weight 0.1" \
         "eagle3=eagle3 --draft-tail" "medusa=medusa --num-heads 4 --num-layers 2 --sequential --prefix-layer --loss-vocab 0" "mtp=mtp --loss-vocab 0" \
         "draft=draft $SHAPE --loss-vocab 0 $EMB ${DRAFT_ARGS:-}" "medusa4=medusa --num-heads 4 --num-layers ${MEDUSA4_LAYERS:-4} --sequential --prefix-layer --loss-vocab 0" \
         "medusatok=medusa --num-heads 4 --num-layers 2 --token-input --loss-vocab 0" \
         "medusaseq=medusa --num-heads 4 --num-layers 2 --sequential --loss-vocab 0" "eagle3tail=eagle3 --draft-tail" \
         "eagle3own=eagle3" "mtp2=mtp --loss-vocab 0 --num-layers 2" \
         "medusapre=medusa --num-heads 4 --num-layers 2 --sequential --prefix-layer --loss-vocab 0" \
         "mtp6=mtp --loss-vocab 0 --num-positions 6 --step-decay 0.9" \
         "mtpreg=mtp --loss-vocab 0 --reg-weight 0.1" "mtp2reg=mtp --loss-vocab 0 --num-layers 2 --reg-weight 0.1" \
         "mtp2regled=mtp --loss-vocab 0 --num-layers 2 --reg-weight 1 --ce-weight 0.1" \
         "mtpregled=mtp --loss-vocab 0 --reg-weight 1 --ce-weight 0.1" \
         "draft3=draft $SHAPE --loss-vocab 0 $EMB --num-layers 3 ${DRAFT_ARGS:-}"; do
  n=${m%%=*}
  case " $METHODS " in *" $n "*) ;; *) continue ;; esac
  INIT=""  # INIT_FROM_SHIPPED=1: continue from the head shipped for this method (carry its folder)
  if [ "${INIT_FROM_SHIPPED:-0}" = 1 ]; then
    base=${m#*=}; base=${base%% *}  # the method (medusa4's heads start from medusa's)
    for d in plugins/speculum-*/speculum_*/{heads,drafts}/$base-smollm2-135m-instruct; do [ -f $d/config.json ] && INIT="--init-from $d"; done
    # kinds the shipped head cannot be grown into (a head loses no part: medusaseq and medusatok have no prefix layer)
    case $n in eagle3own|eaglece|medusatok|medusaseq) INIT="" ;; esac
  fi
  # INIT_DIR=<folder>: continue each method from what an earlier call of this script left there (TR of
  # that call, e.g. /tmp/tr on a machine still warm), where it left one: a second call goes on without copying
  # heads over the shipped ones; DRAFT_INIT wins for the draft
  [ -n "${INIT_DIR:-}" ] && [ -f "$INIT_DIR/$n/config.json" ] && INIT="--init-from $INIT_DIR/$n"
  [ "$n" = draft ] && [ -n "${DRAFT_INIT:-}" ] && INIT="--init-from $DRAFT_INIT"
  # ARGS_<method>: more options for that trainer alone, after TRAIN_ARGS (so they win: e.g. ARGS_medusaseq="--lr 1e-3"
  # for heads with new zero maps beside heads continued at TRAIN_ARGS="--lr 2e-4")
  own="ARGS_$n"; own="${!own:-}"
  echo "$n: ${INIT:-a fresh start (no shipped head in the tree or carried, or eagle3own)}${own:+ ($own)}"
  speculum train ${m#*=} $T $INIT $own --out $TR/$n > $TR/$n.log 2>&1 < /dev/null &
  PIDS+=($!)
done
for p in "${PIDS[@]}"; do wait $p || echo "a training failed (pid $p): see $TR/*.log"; done
for n in $METHODS; do echo "== $n"; grep -h -E "top-1 agreement|Error|error" $TR/$n.log | tail -3; done
python3 -m speculum.train.curves $(for n in $METHODS; do echo $TR/$n; done) --json $TR/curves.json | tail -6
for f in $SPECULUM_CACHE/distill/*/meta.json; do cp $f $TR/data_meta_$(basename $(dirname $f)).json; done
[ -f /tmp/draft_shapes.json ] && cp /tmp/draft_shapes.json $TR/
echo "total: $(( $(date +%s) - T0 )) s"
# the answers alone (no hidden states: megabytes), for the next session to carry back in as ANSWERS
export_answers
# pack: everything but checkpoints; what comes back from a call is about 60 MB in all, so the
# draft's weights (70 MB) are left out when the rest would not fit (they stay in $TR/draft while warm)
LIMIT=${OUT_LIMIT:-60000000}
# pack [more tar options]: the heads' tar, whose size too_big compares with LIMIT
pack() { tar cf /tmp/heads.tar --exclude=checkpoint.pt --exclude=meta.json "$@" $METHODS *.log *.json; }
too_big() { [ $(stat -c %s /tmp/heads.tar) -gt $LIMIT ]; }
cd $TR && pack
if too_big; then
  echo "the draft's weights do not fit: left out (they stay in $TR/draft while the machine is warm)"
  pack --exclude='draft/*.safetensors'
fi
# --keep-best's copies of the last step (<method>/last-step/, where an earlier step was kept) come next
if too_big; then
  echo "the last steps' weights do not fit: left out (they stay in $TR/*/last-step while the machine is warm)"
  pack --exclude='draft/*.safetensors' --exclude='*/last-step/*.safetensors'
fi
if [ $(( $(stat -c %s /tmp/heads.tar) + $(stat -c %s /tmp/answers.tgz) )) -le $LIMIT ]; then
  put_answers
else
  echo "the answers ($(stat -c %s /tmp/answers.tgz) bytes) do not fit beside the heads: left in /tmp/answers.tgz"
fi
cd $OUT && split -b 15M /tmp/heads.tar heads.tar.part_ && rm /tmp/heads.tar && ls -la $OUT
