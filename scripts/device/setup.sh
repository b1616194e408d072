# device call 1: install the project and plugins, keep the first part of the GGUF, and
# (SHAPES=0 to skip) measure candidate draft shapes for train_heads.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# one -e per plugin: with a single -e only the first path is editable, and package data
# carried later (the shipped heads) would be missing from the others
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . $(for p in plugins/speculum-*; do echo "-e $p"; done) >/dev/null 2>&1
cp .gguf_a/part /tmp/gguf_a
PYTHONPATH=/tmp/site speculum plugins
[ "${SHAPES:-1}" = "0" ] || bash scripts/device/draft_shapes.sh
