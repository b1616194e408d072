"""EAGLE-3 chains and trees with every fused Triton kernel (target and head) run through
Triton's interpreter on the CPU, against the same engine on plain torch: outputs must equal
plain decoding and the drafts must agree step by step. A GPU-free check of the kernels'
inference paths (72e1646, 4f24171, 6067d63):

    pip install --no-deps --target /tmp/tri triton   # once
    PYTHONPATH=/tmp/tri TRITON_INTERPRET=1 .venv/bin/python scripts/interpret_heads.py
"""
import importlib
import tempfile
from pathlib import Path

import torch

from speculum import LLM, SamplingParams
from speculum.backends.torch.native import attention, kernels
from speculum.testing import record_drafts, tiny_model_dir, train_tiny

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
work = Path(tempfile.mkdtemp())
target = tiny_model_dir(work / "t", "llama", seed=0, num_layers=2)
head = train_tiny("eagle3", target, work / "w", extra=("--draft-vocab", "384"))
ref = LLM(str(target), device="cpu", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)


def run(spec, fused):
    if fused:
        kernels.use_triton = attention.use_triton = lambda t, *others: not kernels.wants_grad(t, *others)
    llm = LLM(str(target), spec, device="cpu", dtype="float32", max_num_seqs=4)
    seen = record_drafts(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref], "not lossless"
    return seen


for spec in ({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
             {"method": "eagle3", "model": str(head), "tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 6}):
    importlib.reload(kernels)  # plain torch first (the module's own rule: CUDA only)
    importlib.reload(attention)
    a = run(spec, False)
    b = run(spec, True)
    same = sum(torch.equal(x[1], y[1]) for x, y in zip(a, b))
    print("tree" if "tree_topk" in spec else "chain", "steps", len(a), len(b), "drafts equal", same)
