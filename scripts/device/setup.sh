# device call 1: install the project and plugins, keep the first part of the GGUF, and
# measure candidate draft shapes for train_heads.sh (SHAPES below)
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# one -e per plugin: with a single -e only the first path is editable, and package data
# carried later (the shipped heads) would be missing from the others
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . $(for p in plugins/speculum-*; do echo "-e $p"; done) >/dev/null 2>&1
# the GGUF's first half: carried here, or (the tracked files grew past 14 MB: .whl and a GGUF
# half no longer fit one 64 MiB call) staged by a call of its own, `cp .gguf_a/part /tmp/gguf_a`
if [ -f .gguf_a/part ]; then cp .gguf_a/part /tmp/gguf_a; elif [ ! -f /tmp/gguf_a ]; then
  echo "note: no .gguf_a carried; stage it with a call carrying .gguf_a: cp .gguf_a/part /tmp/gguf_a"; fi
PYTHONPATH=/tmp/site speculum plugins
# SHAPES=0: no measurement; SHAPES=<a draft_shapes.json measured on this kind of machine before, carried>:
# that one (train_heads.sh reads /tmp/draft_shapes.json), e.g. docs/results/h200/draft_shapes_1204/draft_shapes.json
if [ -f "${SHAPES:-}" ]; then cp "$SHAPES" /tmp/draft_shapes.json && echo "draft shapes from $SHAPES"
elif [ "${SHAPES:-1}" != "0" ]; then bash scripts/device/draft_shapes.sh; fi
