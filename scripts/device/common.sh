# sourced by the device scripts: environment and the joined default model
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SPECULUM_CACHE=/tmp/sc SPECULUM_SHARED=$PWD/.shared
mkdir -p /tmp/m
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $M ] || cat /tmp/gguf_a .gguf_b/part > $M
