# The server's own host cost on the CPU: a tiny random Llama (hidden 64, 2 layers) with
# SmolLM2's tokenizer, so that streamed chat answers carry text as on the real model but the
# model costs little next to the server's per-step work (the regime of a fast GPU at high
# load). Serves it with 1 thread and sends 512 chat prompts, 64 at once, 64 tokens each
# (ignore_eos), streamed. Prints the client's figures; JSON in $OUT (default /tmp/serve_host).
#   bash scripts/serve_host_cpu.sh [LABEL]      # after bash scripts/setup.sh
set -e
OUT=${OUT:-/tmp/serve_host}; L=${1:-run}; PORT=${PORT:-8124}
mkdir -p $OUT
if [ ! -f $OUT/tok/tokenizer.json ]; then
  .venv/bin/python - "$OUT/tok" <<'PY'
import json, shutil, sys
from pathlib import Path
from speculum.model_source import resolve_model_path
from speculum.testing import tiny_model_dir
out = tiny_model_dir(Path(sys.argv[1]), vocab_size=49152)
src = resolve_model_path(None)  # the default model's converted folder: its tokenizer
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / f).exists():
        shutil.copy(src / f, out / f)
cfg, ref = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
cfg.update(bos_token_id=ref.get("bos_token_id"), eos_token_id=ref.get("eos_token_id"))
(out / "config.json").write_text(json.dumps(cfg))
PY
fi
.venv/bin/speculum serve $OUT/tok --device cpu --dtype float32 --threads 1 --port $PORT --max-num-seqs 64 \
  > $OUT/serve_$L.log 2>&1 &
P=$!
trap "kill $P 2>/dev/null; wait $P 2>/dev/null" EXIT  # gone before the next run takes the port
for i in $(seq 120); do curl -s localhost:$PORT/health >/dev/null && break; sleep 1; done
kill -0 $P  # the server is up (not an earlier one still on the port)
.venv/bin/speculum bench serve --base-url http://localhost:$PORT --num-prompts 512 --max-concurrency 64 --max-tokens 64 \
  --ignore-eos --result-json $OUT/$L.json 2>&1 | grep -E "throughput|TPOT|TTFT" || true
