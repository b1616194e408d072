"""Training-style (teacher-forced) vs engine acceptance of the run1201c EAGLE-3 head, CPU fp32.

Usage: OMP_NUM_THREADS=1 .venv/bin/python results/gap/measure.py [num_prompts]
Writes results/gap/measure.json and results/gap/engine_trace.pt.
"""
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from speculum import LLM, SamplingParams  # noqa: E402
from speculum.backends.torch.heads import TrainContext  # noqa: E402

HEAD = "/work/main/results/run1201c/eagle3"
OUT = Path("/work/main/results/gap")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
MAXTOK = 128

rows = [json.loads(l) for l in open("/work/main/core/data/mt_bench.jsonl")]
seen, prompts = set(), []
for r in rows:  # one per category, first turn
    if r["category"] not in seen:
        seen.add(r["category"])
        prompts.append([{"role": "user", "content": r["turns"][0]}])
prompts = prompts[:N]
params = SamplingParams(temperature=0.0, max_tokens=MAXTOK)


def engine_run(k, trace=False):
    llm = LLM(speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": k},
              dtype="float32", device="cpu", threads=1, seed=0)
    prop = llm.loop.proposer
    calls = []
    if trace:
        def hook(mod, args, out):
            feats, toks, pos, _ = args
            calls.append(dict(feats=feats.detach().clone(), toks=toks.detach().clone(), pos=pos.detach().clone(),
                              out=out.detach().clone()))
        prop.head.register_forward_hook(hook)
    res = []
    t0 = time.time()
    for i, p in enumerate(prompts):
        start = len(calls)
        o = llm.generate([p], params)[0]
        m = o.metrics
        res.append(dict(prompt=list(o.prompt_token_ids), answer=list(o.token_ids), drafts=m.num_drafts,
                        draft_tokens=m.num_draft_tokens, accepted=m.num_accepted_tokens,
                        accepted_per_position=list(m.accepted_per_position),
                        drafts_per_position=list(m.drafts_per_position), calls=(start, len(calls))))
    print(f"engine k={k}: {time.time() - t0:.0f}s", flush=True)
    return llm, res, calls


def teacher_forced(runner, head, tokens, layers, cast=None):
    """Per anchor t (0..n-2): head step-0 greedy prediction of x_{t+2} (training path)."""
    sid = -12345
    hid = runner.add_many([sid], [tokens[:-1]], hidden_layers=tuple(layers))[sid]
    runner.remove(sid)
    hid = {l: h.float() for l, h in hid.items()}
    if cast is not None:
        hid = {l: h.to(cast).float() for l, h in hid.items()}
    n = len(tokens)
    with torch.no_grad():
        feat = head.features({l: hid[l].unsqueeze(0) for l in head.feature_layers})  # [1, n-1, H]
        ctx = TrainContext()
        ctx.next_step()
        toks = torch.tensor(tokens[1:], dtype=torch.int64).unsqueeze(0)  # x_{t+1}
        pos = torch.arange(n - 1).unsqueeze(0)
        out = head(feat, toks, pos, ctx)
        pred = head.greedy(out)[0]  # [n-1] predicts x_{t+2}
        tl = torch.nn.functional.linear(hid[-1].to(runner_lm_head(runner).dtype), runner_lm_head(runner)).argmax(-1)
    return dict(feat=feat[0], out=out[0], pred=pred, target_argmax=tl)


def runner_lm_head(runner):
    from speculum.backends.torch.heads.proposer import target_weights
    return target_weights(runner)[1]


def correctness(tf, prompt_len, tokens):
    """c[t] for anchors t with x_{t+2} in the answer: head pred == x_{t+2} (answer token)."""
    n = len(tokens)
    t_idx = list(range(prompt_len - 2, n - 2))
    return {t: bool(int(tf["pred"][t]) == tokens[t + 2]) for t in t_idx}


def simulate(c, P, n, k):
    """Greedy chain drafting with k drafts from the first engine anchor t = P - 1."""
    t, drafts, acc, acc_pos, dr_pos = P - 1, 0, 0, [0] * k, [0] * k
    while t + 2 <= n - 1:  # some draft target exists
        kk = min(k, n - 2 - t)  # drafts that have a target token
        a = 0
        while a < kk and c.get(t + a, False) is True and chain_ok(c, t, a):
            a += 1
        drafts += 1
        for j in range(kk):
            dr_pos[j] += 1
        for j in range(a):
            acc_pos[j] += 1
        acc += a
        t += a + 1
    return drafts, acc, acc_pos, dr_pos


def chain_ok(c, t, a):
    # position a of a chain from t is only teacher-forced-equivalent for a == 0
    return a == 0


def main():
    llm1, r1, calls1 = engine_run(1, trace=True)
    runner = llm1.target
    head = llm1.loop.proposer.head
    layers = tuple(sorted(set(head.feature_layers) | {-1}))
    print("feature layers", head.feature_layers, "head dtype", next(head.parameters()).dtype, flush=True)
    per = []
    tot = dict(tf_ok=0, tf_n=0, sim_d=0, sim_a=0, eng_d=0, eng_a=0, tf16_ok=0, tfbr_ok=0, targ_agree=0)
    traces = []
    llm16 = LLM(dtype="bfloat16", device="cpu", threads=1, seed=0)
    for i, r in enumerate(r1):
        P, toks = len(r["prompt"]), r["prompt"] + r["answer"]
        n = len(toks)
        tf = teacher_forced(runner, head, toks, layers)
        tfbr = teacher_forced(runner, head, toks, layers, cast=torch.bfloat16)  # fp32 states rounded to bf16
        tf16 = teacher_forced(llm16.target, head.to(torch.float32), toks, layers)  # bf16 target states
        c = correctness(tf, P, toks)
        c16 = correctness(tf16, P, toks)
        cbr = correctness(tfbr, P, toks)
        d, a, _, _ = simulate(c, P, n, 1)
        tot["tf_ok"] += sum(c.values()); tot["tf_n"] += len(c)
        tot["tf16_ok"] += sum(c16.values()); tot["tfbr_ok"] += sum(cbr.values())
        tot["targ_agree"] += sum(int(tf["target_argmax"][t + 1]) == toks[t + 2] for t in c)
        tot["sim_d"] += d; tot["sim_a"] += a
        tot["eng_d"] += r["drafts"]; tot["eng_a"] += r["accepted"]
        # engine trace: per call, last-position draft vs TF at the same anchor
        s, e = r["calls"]
        mism = []
        ed = ea = 0
        for cl in calls1[s:e]:
            pos, tk, ft, out = cl["pos"][0], cl["toks"][0], cl["feats"][0], cl["out"][0]
            q = pos.shape[0]
            for j in range(q):
                t = int(pos[j])
                if t >= n - 1:
                    continue
                tok_ok = int(tk[j]) == toks[t + 1]
                fdiff = float((ft[j].float() - tf["feat"][t]).abs().max())
                odiff = float((out[j].float() - tf["out"][t]).abs().max())
                epred = int(head.greedy(out[j:j + 1].float())[0])
                mism.append(dict(t=t, tok_ok=tok_ok, fdiff=fdiff, odiff=odiff, same_pred=epred == int(tf["pred"][t]),
                                 last=j == q - 1))
        per.append(dict(i=i, P=P, n=n, tf_acc=sum(c.values()) / len(c), tf16_acc=sum(c16.values()) / len(c),
                        tfbr_acc=sum(cbr.values()) / len(c), sim_k1=(d, a), eng_k1=(r["drafts"], r["accepted"]),
                        max_fdiff=max(m["fdiff"] for m in mism), max_odiff=max(m["odiff"] for m in mism),
                        bad_tok=sum(not m["tok_ok"] for m in mism), pred_diff=sum(not m["same_pred"] for m in mism),
                        rows=len(mism), pos_range=(min(m["t"] for m in mism), max(m["t"] for m in mism))))
        print(per[-1], flush=True)
        traces.append(mism)
    del llm16
    summary = dict(
        tf_acc_fp32=tot["tf_ok"] / tot["tf_n"], tf_acc_bf16_target=tot["tf16_ok"] / tot["tf_n"],
        tf_acc_fp32_rounded_bf16=tot["tfbr_ok"] / tot["tf_n"], tf_anchors=tot["tf_n"],
        target_argmax_eq_answer=tot["targ_agree"] / tot["tf_n"],
        sim_k1=tot["sim_a"] / tot["sim_d"], sim_k1_counts=(tot["sim_d"], tot["sim_a"]),
        eng_k1=tot["eng_a"] / tot["eng_d"], eng_k1_counts=(tot["eng_d"], tot["eng_a"]))
    print(summary, flush=True)
    del llm1
    # k=4 engine + simulation of k=4 chains with the TF first position (positions 2..4 need the unroll)
    llm4, r4, _ = engine_run(4)
    e4 = dict(drafts=sum(r["drafts"] for r in r4), acc=sum(r["accepted"] for r in r4))
    app = [0] * 4
    dpp = [0] * 4
    for r in r4:
        for j, v in enumerate(r["accepted_per_position"]):
            app[j] += v
        for j, v in enumerate(r["drafts_per_position"]):
            dpp[j] += v
    same = all(a["answer"] == b["answer"] for a, b in zip(r1, r4))
    summary["eng_k4"] = dict(first_pos=app[0] / max(dpp[0], 1), per_pos=[a / max(d, 1) for a, d in zip(app, dpp)],
                             mal=1 + e4["acc"] / e4["drafts"], drafts=e4["drafts"], outputs_same_as_k1=same)
    print(summary, flush=True)
    json.dump(dict(summary=summary, per_prompt=per), open(OUT / "measure.json", "w"), indent=1)
    torch.save(dict(traces=traces, r1=r1, r4=r4), OUT / "engine_trace.pt")


if __name__ == "__main__":
    main()
