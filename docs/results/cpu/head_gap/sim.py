"""Selection-bias check: replay the engine's greedy chain drafting over teacher-forced
(training code path: chain_unroll) per-anchor agreement, and compare with the engine.

A: CPU fp32 engine, the cpu bench's 16 prompts (2 per category), 128 tokens, k=1 and k=4.
B: the H200 bench's setting (40 prompts, 5 per category, 256 tokens, k=4) replayed on the
   H200 bf16 greedy answers of training's eval set (same prompts), features on the CPU.

Usage: OMP_NUM_THREADS=1 .venv/bin/python results/gap/sim.py
"""
import json
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from safetensors import safe_open  # noqa: E402
from speculum import LLM, SamplingParams  # noqa: E402
from speculum.datasets import per_category  # noqa: E402
from speculum.train.base import chain_unroll  # noqa: E402
from speculum.train.data import Batch  # noqa: E402

HEAD = "/work/main/results/run1201c/eagle3"
OUT = Path("/work/main/results/gap")
K = 4
rows = [json.loads(l) for l in open("/work/main/core/data/mt_bench.jsonl")]


def bench_prompts(n):
    groups = per_category(rows, n)
    return [r for g in groups.values() for r in g]


def lead_vector(runner, head, toks, P):
    """lead[t]: leading agreeing drafts of a K-chain from anchor t (training unroll)."""
    layers = (-1,) + tuple(head.feature_layers)
    sid = -4242
    hid = runner.add_many([sid], [toks[:-1]], hidden_layers=layers)[sid]
    runner.remove(sid)
    n = len(toks)
    h = {l: torch.cat([v.float(), v.new_zeros(1, v.shape[1]).float()]).unsqueeze(0) for l, v in hid.items()}
    t = torch.tensor(toks).unsqueeze(0)
    valid = (torch.arange(n) < n - 1).unsqueeze(0)
    b = Batch(t, h, valid, valid.clone(), torch.tensor([True]))
    lead = torch.zeros(n, dtype=torch.int64)
    on = torch.ones(n, dtype=torch.bool)
    with torch.no_grad():
        for j, out in chain_unroll(head, b, K):
            pred = head.greedy(out[0])  # [n] predicts x_{t+j+2}
            ok = torch.zeros(n, dtype=torch.bool)
            m = n - j - 2
            if m > 0:
                ok[:m] = pred[:m] == t[0, j + 2:]
            on &= ok
            lead += on
    return lead.tolist()


def replay(lead, P, n_answer, k):
    """Engine-style greedy chains: first anchor P - 1, drafts capped by room - 1."""
    g, acc_pos, dr_pos, steps, acc = 1, [0] * k, [0] * k, 0, 0
    while g < n_answer:
        t = P + g - 2
        nd = min(k, n_answer - g - 1)
        a = min(lead[t], nd) if nd > 0 else 0
        steps += 1
        for i in range(max(nd, 0)):
            dr_pos[i] += 1
        for i in range(a):
            acc_pos[i] += 1
        acc += a
        g += a + 1
    return dict(steps=steps, acc=acc, acc_pos=acc_pos, dr_pos=dr_pos)


def agg(rs, k):
    s = dict(steps=0, acc=0, acc_pos=[0] * k, dr_pos=[0] * k)
    for r in rs:
        s["steps"] += r["steps"]; s["acc"] += r["acc"]
        s["acc_pos"] = [a + b for a, b in zip(s["acc_pos"], r["acc_pos"])]
        s["dr_pos"] = [a + b for a, b in zip(s["dr_pos"], r["dr_pos"])]
    return dict(first_pos=round(s["acc_pos"][0] / s["dr_pos"][0], 4),
                per_pos=[round(a / d, 4) if d else None for a, d in zip(s["acc_pos"], s["dr_pos"])],
                mal_per_step=round(1 + s["acc"] / s["steps"], 3), drafts=s["dr_pos"][0])


def tf_acc(leads, Ps, ns):
    """step-0 agreement over the anchors the engine could draft from (t >= P - 1)."""
    ok = cnt = 0
    for lead, P, n in zip(leads, Ps, ns):
        for t in range(P - 1, n - 2):
            ok += lead[t] > 0; cnt += 1
    return round(ok / cnt, 4)


def engine(k, prompts, max_tokens):
    llm = LLM(speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": k},
              dtype="float32", device="cpu", threads=1, seed=0)
    ap, dp, outs, ac, dr = [0] * k, [0] * k, [], 0, 0
    for r in prompts:
        o = llm.generate([[{"role": "user", "content": r["turns"][0]}]],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        m = o.metrics
        for i, v in enumerate(m.accepted_per_position):
            ap[i] += v
        for i, v in enumerate(m.drafts_per_position):
            dp[i] += v
        ac += m.num_accepted_tokens; dr += m.num_drafts
        outs.append((list(o.prompt_token_ids), list(o.token_ids)))
    return llm, outs, dict(first_pos=round(ap[0] / dp[0], 4), per_pos=[round(a / d, 4) for a, d in zip(ap, dp)],
                           mal_per_draft=round(1 + ac / dr, 3), drafts=dp[0])


res = {}
t0 = time.time()
# A: CPU engine text
pA = bench_prompts(2)
llm, outs, e1 = engine(1, pA, 128)
head, runner = llm.loop.proposer.head, llm.target
leads = [lead_vector(runner, head, p + a, len(p)) for p, a in outs]
Ps, ns = [len(p) for p, _ in outs], [len(p) + len(a) for p, a in outs]
res["A_cpu_16x128"] = dict(
    tf_step0_acc=tf_acc(leads, Ps, ns),
    sim_k1=agg([replay(l, len(p), len(a), 1) for l, (p, a) in zip(leads, outs)], 1),
    eng_k1=e1,
    sim_k4=agg([replay(l, len(p), len(a), 4) for l, (p, a) in zip(leads, outs)], 4))
print(res, f"{time.time() - t0:.0f}s", flush=True)
del llm
llm4, outs4, e4 = engine(4, pA, 128)
res["A_cpu_16x128"]["eng_k4"] = e4
res["A_cpu_16x128"]["k4_outputs_identical_to_k1"] = outs4 == outs
print(res, f"{time.time() - t0:.0f}s", flush=True)

# B: H200 bench setting on the H200 bf16 answers of the eval set
SHARD = "/work/main/results/run1201c/answers/SmolLM2-135M-Instruct.Q4_1-4fc9db252913-60c788e8e534/shard_00000.safetensors"
f = safe_open(SHARD, "pt")
tokens, offs = f.get_tensor("tokens").long(), f.get_tensor("offsets").long()
plens, kinds, pidx = f.get_tensor("prompt_lens").long(), f.get_tensor("kind").long(), f.get_tensor("prompt_index").long()
want = {rows.index(r) for r in bench_prompts(5)}
head, runner = llm4.loop.proposer.head, llm4.target
leadsB, simB, PsB, nsB = [], [], [], []
for i in range(len(plens)):
    if int(kinds[i]) != 0 or int(pidx[i]) not in want:
        continue
    s, e, P = int(offs[i]), int(offs[i + 1]), int(plens[i])
    e = min(e, s + P + 256)
    toks = tokens[s:e].tolist()
    lead = lead_vector(runner, head, toks, P)
    leadsB.append(lead); PsB.append(P); nsB.append(len(toks))
    simB.append(replay(lead, P, len(toks) - P, 4))
res["B_h200text_40x256"] = dict(prompts=len(simB), tf_step0_acc=tf_acc(leadsB, PsB, nsB), sim_k4=agg(simB, 4),
                                eng_k4_h200_reported=0.483)
print(json.dumps(res, indent=1), f"{time.time() - t0:.0f}s", flush=True)
json.dump(res, open(OUT / "sim.json", "w"), indent=1)
