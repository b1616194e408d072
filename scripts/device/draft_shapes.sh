# device: step cost of candidate draft-model shapes (random weights, the native runner's
# graphed forward, batch 1, bf16) and the shape to train; needs no GGUF, so it runs in the
# setup call. Writes /tmp/draft_shapes.json (train_heads.sh picks it up while the machine
# stays warm) and $OUT/draft_shapes.json.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# SHAPE_MLP: MLP widths as multiples of the target's ratio (e.g. 1,2: at batch 1 a layer costs mostly launches)
python3 -m speculum.train.draft_shapes --layers ${SHAPE_LAYERS:-1,2,3,4,6,8} --widths ${SHAPE_WIDTHS:-384,576} \
  --mlp-widths ${SHAPE_MLP:-1} --k ${K:-4} --max-break-even ${MAX_BREAK_EVEN:-1.6} --json /tmp/draft_shapes.json
[ -n "$OUT" ] && cp /tmp/draft_shapes.json $OUT/
