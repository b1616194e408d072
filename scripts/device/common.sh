# sourced by the device scripts: environment and the joined default model
# (M and SPECULUM_CACHE may be set beforehand, e.g. for a CPU dry run; the prompts ship with the package)
export PYTHONPATH=${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1 SPECULUM_CACHE=${SPECULUM_CACHE:-/tmp/sc}
if [ -z "$M" ]; then
  mkdir -p /tmp/m
  M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
  # joined once; a failed join (a half missing) leaves no file behind, not an empty one
  [ -s $M ] || { cat /tmp/gguf_a .gguf_b/part > $M.part && mv $M.part $M; } || rm -f $M.part
fi
