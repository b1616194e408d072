"""``speculum bench verifiers``: acceptance rules side by side on MT-bench, sampled.

For each method config, temperature and verifier (``acceptance_method``), the same
prompts with the same per-request seeds: mean acceptance length (MAL), acceptance rate,
tokens/s, and two things a researcher comparing rules needs:

* paired expected acceptance: at every verify step, ``E[accepted | drafts]`` under the
  one-hot rule (acceptance ``p(x)``, the draft's probabilities ignored; the same as
  strict exact-match with the target's own sample), the token-wise rule
  ``min(1, p/q)`` and the block rule, computed on the drafts that step really had
  (``speculum.verifiers.expected``); the columns compare the rules on identical drafts,
  without the verifiers' own noise (the MAL columns of separate runs differ by sampling
  noise too);
* drift (``--logprobs``): every output token's log-probability under the target at the
  request's temperature (teacher-forced with transformers), the mean per token, and for
  each verifier against ``--reference`` a two-sample test (Mann-Whitney U) per output
  position and one on the per-sequence means. A lossless verifier should show none.

Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch

#: in a method config, the target's own checkpoint (a truncated self-draft for draft_model)
TARGET = "@target"


def add_parser(sub) -> None:
    p = sub.add_parser("verifiers", help="acceptance rules side by side, sampled: MAL, paired expected "
                                         "acceptance, tokens/s, drift of the output's target log-probability")
    p.add_argument("--model", default=None, help="target: transformers directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help='a speculative config without acceptance_method (repeatable); "model": "@target" means '
                        'the target checkpoint, e.g. \'{"method":"draft_model","model":"@target",'
                        '"num_speculative_tokens":4,"options":{"num_layers":12}}\'')
    p.add_argument("--verifier", default="rejection_sampler,block", help="comma separated acceptance methods")
    p.add_argument("--verifier-options", default=None, metavar="JSON",
                   help='{"verifier name": {options}} for verifiers that take options')
    p.add_argument("--temperature", default="0.7,1.0", help="comma separated temperatures (> 0)")
    p.add_argument("--prompts-per-category", type=int, default=2, help="MT-bench questions per category")
    p.add_argument("--categories", default=None, help="comma separated (default: all)")
    p.add_argument("--samples", type=int, default=1, help="sampled answers per prompt (seeds differ)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per answer")
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together (max_num_seqs)")
    p.add_argument("--seed", type=int, default=0, help="request i, sample s gets seed + i * samples + s")
    p.add_argument("--logprobs", action="store_true", help="teacher-force the target over every output: drift tests")
    p.add_argument("--reference", default="rejection_sampler", help="the verifier drift is measured against")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--runner", default=None, help="auto, native or hf")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    from speculum.cli import add_batch_invariant_arg
    add_batch_invariant_arg(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the CPUs not busy with other processes)")
    p.add_argument("--mt-bench", default=None, help="MT-bench JSONL (default: the shipped MT-bench questions)")
    p.add_argument("--json", default="results/bench_verifiers.json", help="where the results go")
    p.set_defaults(func=run)


def _prompts(args) -> list[list[dict]]:
    from speculum.datasets import first_turn, mt_bench, per_category
    wanted = set(args.categories.split(",")) if args.categories else None
    groups = per_category(mt_bench(path=args.mt_bench), args.prompts_per_category, wanted)
    return [[{"role": "user", "content": first_turn(r)}] for rows in groups.values() for r in rows]


class PairedShadow:
    """Wraps the engine's verifier; records E[accepted | drafts] of the lossless rules per step."""

    def __init__(self, inner):
        self.inner = inner
        self.lossless = inner.lossless
        self.reset()

    def reset(self) -> None:
        #: drafting steps seen (rows with at least one draft), sums of E[accepted | drafts]
        #: per rule, seconds spent here
        self.steps = 0
        self.sums = {"one_hot": 0.0, "token_wise": 0.0, "block": 0.0}
        #: sum and sum of squares of the per-step difference block - token-wise
        self.diff = [0.0, 0.0]
        self.seconds = 0.0

    def verify(self, target_logits, draft, sampling):
        from speculum.sampling import processed_probs
        from speculum.verifiers.expected import expected_accepted_block, expected_accepted_tokenwise
        t0 = time.perf_counter()
        if not sampling.all_greedy:
            p = processed_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                sampling.flags(target_logits.shape[-1]))
            ids = draft.token_ids.to(p.device)
            q = draft.probs.to(p.device) if draft.probs is not None else None
            if ids.shape[1]:
                self.steps += int((ids[:, 0] >= 0).sum())  # drafting steps, as MAL counts them
                self.sums["one_hot"] += float(expected_accepted_tokenwise(p, None, ids).sum())
                tw, blk = expected_accepted_tokenwise(p, q, ids), expected_accepted_block(p, q, ids)
                self.sums["token_wise"] += float(tw.sum())
                self.sums["block"] += float(blk.sum())
                d = (blk - tw).double()
                self.diff[0] += float(d.sum())
                self.diff[1] += float((d * d).sum())
        self.seconds += time.perf_counter() - t0
        return self.inner.verify(target_logits, draft, sampling)

    def mal(self) -> dict[str, float | None]:
        """1 + mean E[accepted | drafts] per drafting step, per rule (MAL as vLLM defines it)."""
        return {r: (1 + s / self.steps if self.steps else None) for r, s in self.sums.items()}

    def gain(self) -> tuple[float | None, float | None]:
        """(mean, standard error) of the per-step gain of block over token-wise."""
        n = self.steps
        if n < 2:
            return None, None
        mean = self.diff[0] / n
        var = max(self.diff[1] / n - mean * mean, 0.0) * n / (n - 1)
        return mean, math.sqrt(var / n)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _target_logprobs(model_path, outs, temperature: float, device) -> list[list[float]]:
    """Per output token, log p_target(token | prefix) at ``temperature`` (teacher-forced)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device).eval()
    res = []
    with torch.no_grad():
        for o in outs:
            ids = list(o.prompt_token_ids) + list(o.token_ids)
            n = len(o.token_ids)
            logits = model(torch.tensor([ids], device=device)).logits[0, len(ids) - n - 1: len(ids) - 1].float()
            lp = (logits / temperature).log_softmax(-1)
            res.append(lp.gather(-1, torch.tensor(o.token_ids, device=device).view(-1, 1)).view(-1).tolist())
    del model
    return res


def drift(lp: list[list[float]], ref: list[list[float]], min_samples: int = 8) -> dict:
    """Tests of per-token target log-probabilities against a reference run.

    Per output position ``t`` (the sequences that reached it), Mann-Whitney U (two
    samples); on the per-sequence mean log-probability, Mann-Whitney U and, because both
    runs answer the same requests in the same order (same prompts and seeds), the paired
    Wilcoxon signed-rank test on the per-request differences, which removes the spread
    between prompts.
    """
    from scipy import stats
    pvals, diffs = [], []
    for t in range(max((len(x) for x in lp + ref), default=0)):
        a = [x[t] for x in lp if len(x) > t]
        b = [x[t] for x in ref if len(x) > t]
        if len(a) < min_samples or len(b) < min_samples:
            break
        pvals.append(float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue))
        diffs.append(sum(a) / len(a) - sum(b) / len(b))
    seq_a = [sum(x) / len(x) if x else None for x in lp]
    seq_b = [sum(x) / len(x) if x else None for x in ref]
    ua, ub = [v for v in seq_a if v is not None], [v for v in seq_b if v is not None]
    seq = float(stats.mannwhitneyu(ua, ub, alternative="two-sided").pvalue) if ua and ub else None
    pairs = [a - b for a, b in zip(seq_a, seq_b) if a is not None and b is not None]
    paired = None
    if len(pairs) >= min_samples and any(pairs):
        paired = float(stats.wilcoxon(pairs).pvalue)
    n = len(pvals)
    mean_pair = sum(pairs) / len(pairs) if pairs else None
    se_pair = (sum((d - mean_pair) ** 2 for d in pairs) / (len(pairs) - 1) / len(pairs)) ** 0.5 \
        if len(pairs) > 1 else None
    return {"positions_tested": n, "positions_p_below_0.05": sum(p < 0.05 for p in pvals),
            "expected_below_0.05_if_no_drift": 0.05 * n,
            "min_p": min(pvals) if pvals else None,
            "min_p_bonferroni": min(1.0, min(pvals) * n) if pvals else None,
            "per_position_p": pvals, "per_position_mean_diff": diffs, "sequence_mean_p": seq,
            "paired_sequence_mean_diff": mean_pair, "paired_sequence_mean_diff_se": se_pair,
            "paired_wilcoxon_p": paired, "sequence_means": seq_a, "reference_sequence_means": seq_b}


def run(args) -> int:
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    prompts = _prompts(args)
    temps = [float(t) for t in args.temperature.split(",") if t.strip()]
    if any(t <= 0 for t in temps):
        from speculum.errors import ConfigError
        raise ConfigError("bench verifiers compares sampled verification: temperatures must be > 0")
    verifiers = [v.strip() for v in args.verifier.split(",") if v.strip()]
    vopts = json.loads(args.verifier_options) if args.verifier_options else {}
    opts = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size,
                cuda_graphs=not args.enforce_eager, threads=args.threads)
    if args.batch_invariant:
        opts["batch_invariant"] = True
    if args.runner:
        opts["runner"] = args.runner
    S = args.samples
    rows, lps = [], {}
    device = "cpu"
    for cfg in [json.loads(m) for m in args.method]:
        for ver in verifiers:
            spec = dict(cfg, acceptance_method=ver)
            if ver in vopts:
                spec["verifier_options"] = vopts[ver]
            llm = LLM(speculative_config=_resolve_target(spec, args.model), **opts)
            device = str(llm.backend.device)
            shadow = PairedShadow(llm.loop.verifier)
            llm.loop.verifier = shadow
            llm.generate(prompts[: args.batch_size], SamplingParams(temperature=1.0, max_tokens=8, seed=0))
            name = f"{llm.speculative_config.method}(k={cfg['num_speculative_tokens']})"
            for t in temps:
                params = [SamplingParams(temperature=t, max_tokens=args.max_tokens, seed=args.seed + i * S + s)
                          for i in range(len(prompts)) for s in range(S)]
                batch = [p for p in prompts for _ in range(S)]
                llm.stats = type(llm.stats)(lossless=llm.verifier_spec.lossless)
                shadow.reset()
                _sync(device)
                t0 = time.perf_counter()
                outs = llm.generate(batch, params)
                _sync(device)
                dt = time.perf_counter() - t0 - shadow.seconds
                m = llm.metrics
                ntok = sum(len(o.token_ids) for o in outs)
                paired, (gain, gain_se) = shadow.mal(), shadow.gain()
                row = {"method": name, "config": cfg, "verifier": ver, "lossless": llm.verifier_spec.lossless,
                       "temperature": t, "requests": len(outs), "tokens": ntok, "seconds": dt,
                       "tokens_per_s": ntok / dt, "mean_acceptance_length": m.mean_acceptance_length,
                       "tokens_per_step": m.tokens_per_step, "drafts": m.num_drafts,
                       "draft_acceptance_rate": m.draft_acceptance_rate,
                       "acceptance_per_position": m.acceptance_rate_per_position(),
                       "paired_mal_one_hot": paired["one_hot"], "paired_mal_token_wise": paired["token_wise"],
                       "paired_mal_block": paired["block"], "paired_block_gain": gain, "paired_block_gain_se": gain_se,
                       "verify_steps": m.num_steps, "acceptance_histogram": list(m.acceptance_histogram),
                       "mal_standard_error": _mal_se(m.acceptance_histogram, m.num_steps - m.num_drafts)}
                if args.logprobs:
                    lp = _target_logprobs(llm.model_path, outs, t, llm.backend.device)
                    lps[(name, t, ver)] = lp
                    flat = [v for x in lp for v in x]
                    row["mean_target_logprob"] = sum(flat) / len(flat) if flat else None
                rows.append(row)
                print(f"bench verifiers: {name} T={t} {ver}: MAL {_f(row['mean_acceptance_length'])}, "
                      f"{row['tokens_per_s']:.1f} tok/s", flush=True)
            del llm
            import gc
            gc.collect()
    if args.logprobs:
        for row in rows:
            key = (row["method"], row["temperature"], row["verifier"])
            ref = lps.get((row["method"], row["temperature"], args.reference))
            if row["verifier"] != args.reference and ref is not None:
                row["drift_vs_reference"] = drift(lps[key], ref)
    _print_table(rows, args.reference)
    report = {"device": device, "cpu": platform.processor(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "max_tokens": args.max_tokens, "prompts": len(prompts), "samples_per_prompt": S,
              "batch_size": args.batch_size, "dtype": args.dtype, "seed": args.seed, "reference": args.reference,
              "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


def _mal_se(hist: list[int], steps_without_draft: int = 0) -> float | None:
    """Standard error of the realized MAL from the histogram of accepted drafts per step
    (steps without a draft, all in bin 0, left out: MAL counts drafting steps)."""
    hist = list(hist)
    if hist:
        hist[0] -= steps_without_draft
    n = sum(hist)
    if n < 2:
        return None
    mean = sum(a * c for a, c in enumerate(hist)) / n
    var = sum(c * (a - mean) ** 2 for a, c in enumerate(hist)) / (n - 1)
    return math.sqrt(var / n)


def _resolve_target(spec: dict, model) -> dict:
    if spec.get("model") == TARGET:
        from speculum.model_source import default_gguf_path
        spec = dict(spec, model=str(model) if model else str(default_gguf_path()))
    return spec


def _f(v, spec=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _print_table(rows, reference: str) -> None:
    head = (f"{'method':<18}{'T':>5}  {'verifier':<27}{'MAL':>6}{'acc':>7}{'E-MAL 1hot':>11}{'E-MAL tw':>10}"
            f"{'E-MAL blk':>10}{'gain':>14}"
            f"{'tok/s':>8}{'logp/tok':>10}  drift vs {reference}")
    print(head)
    for r in rows:
        d = r.get("drift_vs_reference")
        dtxt = "-" if d is None else (f"{d['positions_p_below_0.05']}/{d['positions_tested']} pos p<.05, "
                                      f"min p*n {_f(d['min_p_bonferroni'], '.2g')}, seq p {_f(d['sequence_mean_p'], '.2g')}, "
                                      f"paired {_f(d['paired_sequence_mean_diff'], '+.3f')} p {_f(d['paired_wilcoxon_p'], '.2g')}")
        lossy = "" if r["lossless"] else " (LOSSY)"
        print(f"{r['method']:<18}{r['temperature']:>5.2f}  {(r['verifier'] + lossy):<27}"
              f"{_f(r['mean_acceptance_length'], '.3f'):>6}{_f(r['draft_acceptance_rate'], '.3f'):>7}"
              f"{_f(r['paired_mal_one_hot'], '.3f'):>11}"
              f"{_f(r['paired_mal_token_wise'], '.3f'):>10}{_f(r['paired_mal_block'], '.3f'):>10}"
              f"{_f(r.get('paired_block_gain'), '+.3f') + '+-' + _f(r.get('paired_block_gain_se'), '.3f'):>14}"
              f"{r['tokens_per_s']:>8.1f}{_f(r.get('mean_target_logprob'), '.3f'):>10}  {dtxt}")
