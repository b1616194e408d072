"""GPU time of each captured graph, chain against tree, and what a tree's drafting spends.

python3 scripts/device/profile_tree_draft.py MODEL CONFIG... [--topk]

For each speculative CONFIG (JSON): a few MT-bench answers (warm-up: every graph used gets
captured), then every captured graph of the target runner (verify and decode) and of the
head (drafting) replayed alone, timed with CUDA events (microseconds per replay, the GPU's
time with no host in the way), the host's time to launch it (a replay call on an idle GPU)
and its kernel count, and the kernels of the head's drafting graphs by GPU time.
``--topk``: first, top-k variants on the head's shapes (frontier rows x vocabulary), each
captured in a graph: what a tree level's candidate choice costs and what could replace it.
Replays rewrite the caches at the slots of the last step: run it after the answers only.
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from profile_step import graph_us, replay_us  # this folder's: graph capture and replay timing


def launch_us(graph, iters: int = 100) -> float:
    """Host microseconds of one ``replay()`` call on an idle GPU (median): what launching the
    graph costs the host, apart from the GPU's time to run it."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * sorted(times)[len(times) // 2]


def kernels(graph, replays: int = 3) -> int:
    """Kernels one replay of ``graph`` runs (from the torch profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if str(e.device_type).endswith("CUDA")) // replays


def topk_variants() -> None:
    def current(x, k):  # kernels.topk_logprobs_torch
        return x.float().log_softmax(dim=-1).topk(k, dim=-1)

    def lse(x, k):  # top-k of the raw logits, log-probs from one logsumexp
        v, i = x.topk(k, dim=-1)
        return v.float() - x.float().logsumexp(-1, keepdim=True), i

    def two_stage(x, k, c=64):  # top-k per chunk of the vocabulary, then of the chunks' winners
        *lead, V = x.shape
        v, i = x.view(*lead, c, V // c).topk(k, dim=-1)
        i = i + (torch.arange(c, device=x.device) * (V // c)).view(c, 1)
        v2, j = v.reshape(*lead, c * k).topk(k, dim=-1)
        return v2.float() - x.float().logsumexp(-1, keepdim=True), i.reshape(*lead, c * k).gather(-1, j)

    from speculum.backends.torch.native.kernels import topk_logprobs as fused

    print("top-k of the head's logits, graphed, us per call (bf16 logits; k = 8; 'torch': log_softmax then "
          "topk, what trees drafted with before the fused kernel)")
    print(f"{'shape':<18}{'torch':>10}{'lse':>10}{'2-stage':>10}{'fused':>10}{'argmax':>10}")
    for shape in [(1, 8192), (1, 8, 8192), (1, 16, 8192), (1, 49152), (1, 8, 49152), (1, 16, 49152),
                  (16, 8, 8192), (16, 8, 49152)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        a, b = current(x, 8), two_stage(x, 8)
        assert torch.equal(a[0].sort(-1).values, b[0].sort(-1).values.float()) or \
            torch.allclose(a[0].sort(-1).values, b[0].float().sort(-1).values, atol=1e-3)
        row = [graph_us(lambda f=f: f(x, 8)) for f in (current, lse, two_stage, fused)]
        print(f"{str(shape):<18}" + "".join(f"{v:>10.1f}" for v in row)
              + f"{graph_us(lambda: x.argmax(-1)):>10.1f}", flush=True)


def main() -> int:
    from speculum import LLM, SamplingParams
    from speculum.testing import mt_bench_chat_prompts

    args = [a for a in sys.argv[1:] if a != "--topk"]
    if "--topk" in sys.argv:
        topk_variants()
    model, configs = args[0], args[1:]
    prompts = mt_bench_chat_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=96)
    for cfg in configs:
        llm = LLM(model, speculative_config=json.loads(cfg), dtype="bfloat16", max_num_seqs=1)
        llm.generate(prompts, params)
        print(f"=== {cfg}")
        print(f"  {'graph':6} {'key':<40} {'GPU us':>8} {'host us':>8} {'kernels':>8}")
        for key, (graph, _) in sorted(llm.loop.target._graphs.items(), key=str):
            print(f"  target {str(key):<40} {replay_us(graph, 200):8.1f} {launch_us(graph):8.1f} {kernels(graph):8d}")
        heads = getattr(llm.proposer, "graphs", None)
        for key, (graph, _) in sorted(getattr(heads, "_graphs", {}).items(), key=str):
            print(f"  head   {str(key):<40} {replay_us(graph, 200):8.1f} {launch_us(graph):8.1f} {kernels(graph):8d}")
        drafting = [g for k, (g, _) in getattr(heads, "_graphs", {}).items() if k[-1] == "device"]
        if drafting:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    drafting[0].replay()
                torch.cuda.synchronize()
            print(f"  kernels of the head's drafting from the verdict (totals of 50 replays):")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        del llm
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
