# device call 1 of a session: install (setup.sh, with the draft-shape measurement), then the
# CUDA tests (tiny models: graphed tree verify and drafting, graphed chain drafting, the
# Triton kernels, the batch-invariant mode, the JAX backend on the GPU). Carry .whl and .gguf_a.
bash scripts/device/setup.sh
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout ${TEST_TL:-240} python3 -m pytest -q -p no:cacheprovider tests/test_trees_cuda.py tests/test_heads_cuda.py \
  tests/test_kernels_cuda.py tests/test_batch_invariant_cuda.py tests/test_decode_attention_cuda.py \
  tests/test_overlap.py tests/test_devices.py 2>&1 | tail -12
