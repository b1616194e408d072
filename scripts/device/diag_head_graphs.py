"""Where graphed and eager EAGLE-3 drafting part on CUDA (tests/test_heads_cuda.py's case):
per step, whether the drafts agree, with the fused head kernels and with plain torch."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculum import SamplingParams  # noqa: E402
from speculum.testing import graphed_vs_eager_drafts, tiny_model_dir, train_tiny  # noqa: E402

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
work = Path(tempfile.mkdtemp())
target = tiny_model_dir(work / "t", "llama", seed=0, num_layers=4)
head = train_tiny("eagle3", target, work / "w", extra=("--draft-vocab", "384"))


def flags():
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    _, same = graphed_vs_eager_drafts(target, spec, PROMPTS, GREEDY)
    return "".join("=" if s else "x" for s in same)


print("fused:", flags(), flush=True)
import head_kernels  # noqa: E402
head_kernels.plain_torch()
print("torch:", flags(), flush=True)
