"""The engine and its Python API: ``LLM(model=..., speculative_config=...)``.

Speculation is an engine concern: the same ``generate()`` serves both, only the config
differs. Requests go through ``add_request`` / ``step``; ``generate`` drives those.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from typing import Any, Iterable, Mapping, Sequence as Seq

import torch

from speculum.config import SpeculativeConfig
from speculum.engine_build import build_speculation, build_verifier
from speculum.errors import ConfigError, EngineDeadError, PluginError, RequestError
from speculum.interfaces import Backend, HiddenStateProposer, KVCacheFull
from speculum.loop import DraftVerifyLoop
from speculum.metrics import SpecDecodeMetrics
from speculum.model_source import resolve_model_path
from speculum.outputs import RequestOutput
from speculum.plugins import build_registry
from speculum.requests import RequestLimits, check_params, request_output, token_rules
from speculum.sampling import SamplingParams, make_generator, sample_params
from speculum.scheduler import Scheduler
from speculum.sequence import Sequence
from speculum.spec_length import make_policy
from speculum.threads import apply_threads
from speculum.tokenizer import Tokenizer
from speculum.tree import TreeProposer, check_tree_support

log = logging.getLogger(__name__)

Prompt = str | list[dict] | Mapping[str, Any]


class LLM:
    """An inference engine with optional speculative decoding.

    ``model``: a transformers directory, a ``.gguf`` file, or None for the default
    SmolLM2-135M-Instruct. ``speculative_config``: None, a dict, a JSON string or a
    :class:`SpeculativeConfig`. ``plugins``: extra in-process plugins (modules/objects with
    ``@speculum.hookimpl`` functions) besides the installed entry points. ``overlap``
    (CUDA only): a step without drafts starts the next forward before the host's
    bookkeeping of this one (outputs unchanged; see docs/architecture.md).
    """

    def __init__(self, model: str | None = None, speculative_config: Any = None, *,
                 dtype: str | torch.dtype = "auto", device: str | None = "auto", seed: int = 0,
                 backend: str = "torch", max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 tensor_parallel_size: int = 1, plugins: Iterable[Any] = (), tokenizer: str | None = None,
                 threads: int | None = None, max_logprobs: int = 20, overlap: bool = True,
                 **backend_options: Any):
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads must be an integer >= 1 (torch CPU threads), got {threads!r}; "
                              "leave it None for the default (the CPUs not busy with other processes)")
        #: torch's CPU threads for this process (logged; see speculum.threads)
        self.threads = apply_threads(threads)
        if tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size > 1 is not supported yet; use 1")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        spec_cfg = SpeculativeConfig.coerce(speculative_config, source="speculative_config")
        self.registry = build_registry(extra_plugins=plugins)
        try:
            self.backend: Backend = self.registry.backend(backend).factory(device=device, dtype=dtype,
                                                                           **backend_options)
        except TypeError as exc:
            raise ConfigError(f"backend {backend!r} does not accept these options: {exc}") from exc
        if not isinstance(self.backend, Backend):
            raise PluginError(f"backend {backend!r} ({type(self.backend).__name__}) does not implement the Backend "
                              "protocol of speculum.interfaces (load_model, register_cache, plan_memory, "
                              "kv_allocators, capture)")
        self.model_path = resolve_model_path(model)
        self.tokenizer = Tokenizer.load(resolve_model_path(tokenizer) if tokenizer else self.model_path)
        self.target = self.backend.load_model(self.model_path, role="target", max_model_len=max_model_len)
        eos = _config_eos(self.model_path)
        if eos:
            self.tokenizer = Tokenizer(self.tokenizer.hf, eos)
        self.max_model_len = int(self.target.max_model_len or max_model_len or 2048)
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        #: prompt tokens admitted (prefilled) per step at most; the first request always fits
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculative_config = spec_cfg
        proposer, hidden_layers = None, ()
        k = 0
        if spec_cfg is not None:
            if spec_cfg.max_model_len is not None:
                self.max_model_len = min(self.max_model_len, spec_cfg.max_model_len)
            verifier_name = spec_cfg.acceptance_method
            spec_cfg, proposer, self.method_spec = build_speculation(
                spec_cfg, self.registry, backend, backend=self.backend, target=self.target,
                target_path=self.model_path, vocab_size=self.target.vocab_size, tokenizer=self.tokenizer,
                max_model_len=self.max_model_len, tensor_parallel_size=tensor_parallel_size)
            self.speculative_config = spec_cfg
            k = spec_cfg.num_speculative_tokens
            if isinstance(proposer, HiddenStateProposer):
                hidden_layers = tuple(proposer.hidden_layers)
        else:  # no drafts: both sample the target; keyed noise makes seeded batch-invariant runs reproducible
            verifier_name = "exact_match" if getattr(self.backend, "batch_invariant", False) else "rejection_sampler"
        tree = spec_cfg.tree if spec_cfg is not None else None
        #: KV positions a step may add per sequence beyond its tokens, in every cache group
        #: (a tree's draft head may write more than the k nodes the target does)
        self.lookahead = max(k, proposer.kv_lookahead) if isinstance(proposer, TreeProposer) else k
        try:
            self.backend.plan_memory(self.max_model_len, self.max_num_seqs, lookahead=self.lookahead)
        except KVCacheFull as exc:
            raise ConfigError(str(exc)) from exc
        schedule = spec_cfg.length_schedule if spec_cfg is not None else None
        # a schedule may change k between steps: every q = 1..k+1 is then captured up front
        # (a tree is drafted whole or not at all: q = 1 and the tree's width)
        self._capture_graphs(k, hidden_layers, tree is not None, all_lengths=schedule is not None)
        #: picks each step's speculation length (speculum.spec_length): fixed, by batch size, or "auto"
        self.spec_length = make_policy(schedule, k, lambda: self._verify_cost(k), trees=tree is not None)
        self.verifier_spec, self.verifier = build_verifier(
            self.registry, verifier_name, spec_cfg.verifier_options if spec_cfg is not None else None)
        if tree is not None:
            check_tree_support(tree, spec_cfg.method, proposer, self.verifier, verifier_name, self.target)
        self.proposer = proposer
        #: steps without drafts start the next forward before the host's bookkeeping (CUDA only:
        #: a CPU computes the forward on the host thread itself)
        self.overlap = bool(overlap) and self.target.device.type == "cuda"
        self.loop = DraftVerifyLoop(self.target, self.verifier, self.tokenizer, proposer, k, hidden_layers,
                                    length=self.spec_length, trees=tree is not None, overlap=self.overlap,
                                    from_verdict=_from_verdict(spec_cfg, proposer))
        self.scheduler = Scheduler(self.backend.kv_allocators(), self.loop.finish, max_num_seqs=max_num_seqs,
                                   lookahead=self.lookahead, max_num_batched_tokens=max_num_batched_tokens)
        self._seed_gen = make_generator(seed)
        self._ids = itertools.count()
        #: each request's samples (one Sequence, or n / best_of of them) and parameters
        self._by_request: dict[str, list[Sequence]] = {}
        self._params: dict[str, SamplingParams] = {}
        self.stats = SpecDecodeMetrics(lossless=self.verifier_spec.lossless)
        self.num_generated_tokens = 0
        #: requests that finished with finish_reason="error"
        self.num_failed_requests = 0
        #: why the engine refuses work (its device failed), or None
        self.dead: str | None = None
        self.k = k
        self.limits = RequestLimits(self.target.vocab_size, k, max_logprobs,
                                    "logits_sink" in inspect.signature(self.target.add_many).parameters)
        log.info("engine ready: model=%s method=%s k=%d verifier=%s (%s)%s", self.model_path.name,
                 spec_cfg.method if spec_cfg else None, k, verifier_name,
                 "lossless" if self.verifier_spec.lossless else "LOSSY", f" ({tree.describe()})" if tree else "")

    def _capture_graphs(self, k: int, hidden_layers: tuple[int, ...] = (), tree: bool = False,
                        all_lengths: bool = False) -> None:
        """Capture CUDA graphs for the common decode/verify shapes up front (others lazily),
        returning the hidden states the proposer asked for, as the loop will request them.
        ``all_lengths``: every verify width 1..k+1 (a speculation length that varies)."""
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < self.max_num_seqs] + [self.max_num_seqs]
        t0 = time.perf_counter()
        if tree:  # verify steps are tree forwards
            n = self.backend.capture(self.target, sizes, [1], hidden_layers, tree_query_lens=[k + 1])
        else:
            qs = list(range(1, k + 2)) if all_lengths else sorted({1, k + 1})
            n = self.backend.capture(self.target, sizes, qs, hidden_layers)
        if n:
            log.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t0)

    def _verify_cost(self, k: int):
        """The target's verify cost curve on this machine (cached; speculum.cost_model)."""
        from speculum.cost_model import describe, load_or_profile
        context = min(128, max(8, self.max_model_len // 4))
        try:
            cost = load_or_profile(self.target, self.model_path, self.max_num_seqs, k, context=context)
        except KVCacheFull as exc:
            raise ConfigError(f"num_speculative_tokens_per_batch_size 'auto' profiles the target with "
                              f"{self.max_num_seqs} sequences of {context} tokens at start, which the KV cache "
                              f"cannot hold ({exc}); raise kv_cache_memory, lower max_num_seqs, or give batch-size "
                              "ranges instead of 'auto'") from exc
        log.info("verify cost (seconds of one target forward, and q tokens against 1):\n%s", describe(cost, k))
        return cost

    # -- requests -----------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Text, chat messages or ``{"prompt_token_ids": [...]}`` -> (text, token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
                if bad:
                    raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})")
                text = prompt.get("prompt")
                return (text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)), ids
            if "prompt" in prompt:
                return self.encode_prompt(prompt["prompt"])
            if "messages" in prompt:
                return self.tokenizer.chat_prompt(list(prompt["messages"]))
        if isinstance(prompt, list) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
            return self.tokenizer.chat_prompt(list(prompt))
        raise RequestError(
            "a prompt is a string, a list of chat messages ({'role', 'content'}), or "
            f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}"
        )

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a request; it runs on the following ``step()`` calls."""
        if self.dead:
            raise EngineDeadError(self.dead)
        params = params or SamplingParams()
        if request_id in self._by_request:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but the context holds {self.max_model_len}; "
                "shorten the prompt"
            )
        if params.stop and self.tokenizer.hf is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids")
        check_params(params, self.limits)
        rules = token_rules(params, self.tokenizer)
        n = params.num_samples
        seqs = []
        for i in range(n):
            p = sample_params(params, i) if n > 1 else params
            gen = None
            if not p.greedy:
                seed = p.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
                gen = make_generator(seed, self.target.device)
            seq = Sequence(request_id, next(self._ids), text, ids, p, gen, self.max_model_len, index=i, rules=rules,
                           seed=seed if gen is not None else None)
            seq.metrics.lossless = self.verifier_spec.lossless
            # per-request control: speculative=False or num_speculative_tokens=0 runs without drafts
            seq.max_k = min(p.num_speculative_tokens, self.k) if p.num_speculative_tokens is not None else None
            seq.speculative = bool(self.k) and p.speculative and seq.max_k != 0
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)
        self._by_request[request_id] = seqs
        self._params[request_id] = params

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV cache."""
        seqs = self._by_request.get(request_id)
        if seqs is None:
            return
        for seq in seqs:
            seq.abort()
            if self.scheduler.remove(seq):
                self.loop.finish(seq)
        del self._by_request[request_id]
        self._params.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def step(self, include_running: bool = True) -> list[RequestOutput]:
        """Admit waiting requests and run one draft-verify step.

        Returns an output for every request that advanced: ``finished=False`` while it
        runs (for streaming; left out with ``include_running=False``), ``finished=True``
        once, at the end. A request that fails finishes with ``finish_reason="error"``
        and its ``error``; the engine serves on. Only a failed device stops the engine
        (``EngineDeadError``: every request it held finishes with an error first).
        """
        if self.dead:
            raise EngineDeadError(self.dead)
        outputs: list[RequestOutput] = []
        sched = self.scheduler.schedule()
        for seq, why in sched.failed:
            seq.fail(why)
            self._retire(seq, outputs)
        if sched.admitted:
            try:
                self.loop.start(sched.admitted)
            except Exception as exc:
                self._batch_failed(sched.admitted, "prefill", exc, outputs)
        running = self.scheduler.running
        if not running:
            self.loop.idle()
            return outputs
        before = [s.num_output_tokens for s in running]
        try:
            # with requests waiting and a free slot, the next batch likely differs: nothing runs
            # ahead for it. A full batch (max_num_seqs running: batch 1 with a queue) changes
            # only when a row finishes, which drops a step run ahead anyway
            admit = self.scheduler.waiting and len(running) < self.scheduler.max_num_seqs
            self.loop.step(running, ahead=not admit)
        except Exception as exc:
            self._batch_failed(list(running), "step", exc, outputs)
            return outputs
        advanced: dict[str, None] = {}
        for s, b in zip(list(running), before):
            self.num_generated_tokens += s.num_output_tokens - b
            if s.finished:
                self.scheduler.remove(s)
                self.loop.finish(s)
                self._retire(s, outputs)
            elif include_running:
                advanced[s.request_id] = None
        done = {o.request_id for o in outputs}
        outputs += [self._output(rid) for rid in advanced if rid not in done and rid in self._by_request]
        if not self.scheduler.running and not self.scheduler.waiting:
            self.loop.idle()  # the wait for the next request is not the last step's cost
        return outputs

    def _retire(self, s: Sequence, outputs: list[RequestOutput]) -> None:
        """Bookkeeping of a sample that left the engine (not running, KV freed); its
        request's final output joins ``outputs`` once every sample of it finished."""
        self.stats.merge(s.metrics)
        if s.finish_reason == "error":
            self.num_failed_requests += 1
            log.warning("request %s failed: %s", s.request_id, s.error)
        seqs = self._by_request.get(s.request_id)
        if seqs is None or not all(x.finished for x in seqs):
            return
        outputs.append(self._output(s.request_id))
        del self._by_request[s.request_id]
        self._params.pop(s.request_id, None)

    def _batch_failed(self, seqs: list[Sequence], what: str, exc: Exception, outputs: list) -> None:
        """A target forward raised: its requests fail; if the device is gone, every request."""
        log.exception("the target %s failed for %d request(s)", what, len(seqs))
        broken = self._device_failure()
        if broken:
            self.dead = (f"the engine's device failed ({broken}) after {type(exc).__name__}: {exc}; it refuses new "
                         "work: restart the process")
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for s in seqs:
            if self.scheduler.remove(s) or what == "prefill":
                try:
                    self.loop.finish(s)
                except Exception:
                    log.exception("freeing request %s failed", s.request_id)
            s.fail(self.dead or f"the target model failed on this batch ({type(exc).__name__}: {exc})")
            self._retire(s, outputs)

    def _device_failure(self) -> str | None:
        """None if the target's device still computes, else what went wrong."""
        dev = self.target.device
        try:
            x = torch.ones(1, device=dev) + 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return None if float(x) == 2.0 else "a probe computed garbage"
        except Exception as probe:  # e.g. a CUDA error: the context is lost
            return f"{type(probe).__name__}: {probe}"

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self._by_request[request_id]
        first = seqs[0]
        return request_output(request_id, first.prompt, first.prompt_token_ids, seqs, self._params[request_id],
                              self.tokenizer)

    # -- convenience --------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or many; returns outputs in prompt order."""
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], Mapping) and "role" in prompts[0]):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        base = f"gen-{next(self._ids)}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params):
            self.add_request(rid, p, sp)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="generating", unit="req")
        while len(results) < len(ids):
            for out in self.step(include_running=False):
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the chat template applies)."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        return self.generate([{"messages": c} for c in convs], sampling_params, use_tqdm)

    @property
    def metrics(self) -> SpecDecodeMetrics:
        """Engine-wide speculation totals over finished requests."""
        return self.stats

    def get_tokenizer(self):
        """The transformers tokenizer of the target (None for a model without one)."""
        return self.tokenizer.hf

    def get_metrics(self) -> list:
        """Engine counters in vLLM's ``LLM.get_metrics()`` form: a list of
        :class:`speculum.metrics_reader.Counter` / ``Gauge`` / ``Vector`` snapshots named
        like the server's Prometheus metrics (``speculum:spec_decode_num_drafts``...)."""
        from speculum.metrics_reader import engine_metrics
        return engine_metrics(self)


def _config_eos(path) -> list[int]:
    import json
    from pathlib import Path
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        return []
    eos = json.loads(cfg_file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _from_verdict(spec_cfg, proposer) -> str:
    """What a step launches from the device verdict (the speculative config's ``from_verdict``):
    the config's value, else the proposer's ``from_verdict_default``, else ``"draft"``."""
    if spec_cfg is None:
        return "off"
    return spec_cfg.from_verdict or getattr(proposer, "from_verdict_default", None) or "draft"
