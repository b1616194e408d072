"""Self-distillation data: the target answers training prompts, its hidden states recorded.

Generation runs through :class:`speculum.LLM` (batched, greedy or sampled, on any device,
with CUDA graphs and overlapped steps on a GPU); each finished conversation then gets the
target's hidden states from one teacher-forced prefill over its tokens
(:mod:`speculum.train.generate`). What is answered is the data mix of
:mod:`speculum.train.mix`; this module selects the rows, keys and fills the cache.

The result is cached under ``$SPECULUM_CACHE/distill/<model>-<key>/`` in shards of
``shard_size`` source rows (``shard_00000.safetensors`` ...) with all their answers; an
interrupted run resumes at the missing shards, and a run asking for more prompts extends
the same cache. A shard without the hidden states (``python -m speculum.train.distill export``
copies a cache's answers only: megabytes instead of gigabytes, to carry them to another
machine) gets them from a teacher-forced prefill the next time the cache is used. Each
shard holds, for its ``S`` sequences of ``N`` tokens in all:
``tokens`` [N] int32, ``offsets`` [S + 1] int64, ``prompt_lens`` [S] int32, ``prompt_index``
[S] int32 (the row's group id: its row in the prompt file), ``kind`` [S] int32 (index in
:data:`speculum.train.mix.KINDS`), ``temperature`` [S] float32 and ``hidden.<layer>``
[N, H] bfloat16: the target's state at each position (the last token of a sequence has
none and gets zeros).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import torch

from speculum.errors import ConfigError
from speculum.train.generate import PromptIds, Shard, engine, prefill_features, stream_jobs
from speculum.train.mix import DATA_BASE, KINDS, Row, drop_overlaps, eval_texts, normalise, order_rows, read_rows

log = logging.getLogger(__name__)

#: fields keyed as they are (caches made before the others existed stay valid)
_ALWAYS_KEYED = ("model", "prompts", "max_prompt_tokens", "max_tokens", "temperature", "seed", "layers", "chat")


@attrs.frozen
class DistillSpec:
    """What to generate; its JSON (with the resolved model path) keys the cache."""

    model: str
    prompts: str
    num_prompts: int = 1024
    max_prompt_tokens: int = 192
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    layers: tuple[int, ...] = (-1,)
    chat: bool = True
    #: extra sampled answers per instruction-style prompt (sources other than ``t0/...``)
    extra_answers: int = 0
    #: their temperature, or temperatures taken in turn
    extra_temperature: float | tuple[float, ...] = 0.8
    #: long-form answers per instruction-style prompt (a request for detail appended)
    long_form: int = 0
    #: long-form answers per task-template prompt (T0: a request to explain the answer appended)
    template_long_form: int = 0
    #: fraction of single-turn prompts answered again after a follow-up the target writes
    second_turns: float = 0.0
    #: user turns answered per conversation (MT-bench and ``data`` rows may have several)
    max_turns: int = 1
    #: the user's own prompts or conversations (JSONL), all of them, before ``prompts``
    data: tuple[str, ...] = ()
    #: evaluation sets: rows whose user turns match one of theirs are dropped
    exclude: tuple[str, ...] = ()

    @property
    def extra_temperatures(self) -> tuple[float, ...]:
        t = self.extra_temperature
        return tuple(float(x) for x in t) if isinstance(t, (tuple, list)) else (float(t),)

    def key(self, file_ids: Mapping[str, list] | None = None) -> str:
        """Everything but ``num_prompts``: shards are a prefix-stable sequence, so a larger
        run extends a smaller one's cache and a smaller run reuses its first shards. Fields
        added later enter the key only when they differ from their defaults. A file enters
        by name and size; one that does not exist here by ``file_ids[path]`` (what
        :meth:`file_ids` recorded where the cache was made), else by its path."""
        defaults = {f.name: f.default for f in attrs.fields(type(self))}
        d = {k: v for k, v in attrs.asdict(self).items()
             if k != "num_prompts" and (k in _ALWAYS_KEYED or v != defaults[k])}
        known = file_ids or {}

        def file_id(f: str):
            p = Path(f)
            return [p.name, p.stat().st_size] if p.exists() else known.get(f, f)
        d["prompts"] = file_id(self.prompts)
        for k in ("data", "exclude"):
            if k in d:
                d[k] = [file_id(f) for f in d[k]]
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def file_ids(self) -> dict[str, list]:
        """How each prompt, data and exclude file that exists here enters :meth:`key`
        (name and size), by path: kept in ``meta.json`` so that answers imported where a
        file lies elsewhere, or is not yet written, keep their key."""
        out = {}
        for f in (self.prompts, *self.data, *self.exclude):
            p = Path(f)
            if p.exists():
                out[f] = [p.name, p.stat().st_size]
        return out


@attrs.define
class Selection:
    """The source rows of a spec, in cache order, and what the checks dropped."""

    rows: list[Row]
    #: rows dropped because they match an evaluation prompt
    dropped_overlaps: int = 0
    #: rows skipped because their first prompt is longer than ``max_prompt_tokens``
    too_long: int = 0


def select_rows(spec: DistillSpec, ids: PromptIds) -> Selection:
    """Rows to answer: every row of the ``data`` files, then ``num_prompts`` rows of the
    prompt file (shuffled with the seed, instruction-style first); rows matching an
    ``exclude`` set are dropped, rows whose first prompt exceeds ``max_prompt_tokens`` skipped."""
    texts = eval_texts(spec.exclude)
    data_rows = []
    for n, f in enumerate(spec.data):
        data_rows += read_rows(f, base=DATA_BASE * (n + 1), source=f"data:{Path(f).name}")
    data_rows, d1 = drop_overlaps(data_rows, texts)
    prompt_rows, d2 = drop_overlaps(order_rows(read_rows(spec.prompts), spec.seed), texts) \
        if spec.num_prompts > 0 else ([], 0)
    out, too_long, taken = [], 0, 0
    for r in data_rows:
        if len(ids.first_prompt(r, spec.chat)) <= spec.max_prompt_tokens:
            out.append(r)
        else:
            too_long += 1
    for r in prompt_rows:
        if taken >= spec.num_prompts:
            break
        if len(ids.first_prompt(r, spec.chat)) <= spec.max_prompt_tokens:
            out.append(r)
            taken += 1
        else:
            too_long += 1
    if d1 + d2:
        log.warning("self-distillation: dropped %d prompts that match the evaluation prompts (%s)", d1 + d2,
                    ", ".join(Path(e).name for e in spec.exclude))
    return Selection(out, d1 + d2, too_long)


def repeated_rows(rows: Sequence[Row]) -> int:
    """How many of ``rows`` have the same user turns (normalised) as an earlier one."""
    seen: set[tuple[str, ...]] = set()
    n = 0
    for r in rows:
        key = tuple(normalise(t) for t in r.turns) if r.turns else ("ids",) + tuple(map(str, r.token_ids or ()))
        n += key in seen
        seen.add(key)
    return n


def cache_dir(spec: DistillSpec, root: Path | None = None, file_ids: Mapping[str, list] | None = None) -> Path:
    from speculum.model_source import cache_root
    root = Path(root) if root else cache_root() / "distill"
    return root / f"{Path(spec.model).name}-{spec.key(file_ids)}"


def find_cache(spec: DistillSpec, root: Path | None = None) -> Path:
    """Where ``spec``'s answers are: its own cache folder when it exists, else a folder with
    the same answers keyed for other recorded ``layers`` (the answers do not depend on them;
    :func:`fill_features` adds the states this spec needs), else the folder to make. So
    answers made where every installed method's layers were recorded (four of the target's
    hidden states a token) serve a run that records fewer (``speculum train --record-for``):
    on a 64 GB disk, 2026-12-07, the four layers of 12 M tokens no longer fitted."""
    out = cache_dir(spec, root)
    if out.exists():
        return out
    for meta_file in sorted(out.parent.glob(f"{Path(spec.model).name}-*/meta.json")):
        try:
            layers = tuple(json.loads(meta_file.read_text())["spec"]["layers"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if layers != tuple(spec.layers) and cache_dir(attrs.evolve(spec, layers=layers), root) == meta_file.parent:
            log.info("self-distillation: the answers of %s (recorded for layers %s) serve layers %s",
                     meta_file.parent.name, list(layers), list(spec.layers))
            return meta_file.parent
    return out


def ensure_distill(spec: DistillSpec, root: Path | None = None, max_num_seqs: int = 32, device: str = "auto",
                   dtype: str = "auto", shard_size: int = 64, progress: bool = True, time_limit: float = 0,
                   max_model_len: int = 2048, generate: bool = True, states: bool = True) -> tuple[Path, list[str]]:
    """Generate (or reuse) the cached distillation data of ``spec``.

    Returns the cache directory and the finished shard files that make up
    ``spec.num_prompts`` (all of them, unless ``time_limit`` seconds of generation ran out
    first; with ``generate=False``, those made before, nothing new). ``meta.json`` there records the data mix (sequences and answer tokens per
    kind), the rows dropped as evaluation prompts and the generation time. Answers carried in
    without hidden states get them by prefill, unless ``states=False`` (a call that only makes
    answers for another to train on: the states would be thrown away).
    """
    from speculum.model_source import resolve_model_path
    from speculum.tokenizer import Tokenizer
    out = find_cache(spec, root)
    out.mkdir(parents=True, exist_ok=True)
    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {
        "spec": {k: v for k, v in attrs.asdict(spec).items() if k != "num_prompts"}, "shard_size": shard_size,
        "shards": [], "sizes": {}, "mix": {}}
    meta.setdefault("files", spec.file_ids())  # the key's file ids, for import_answers elsewhere
    shard_size = meta["shard_size"]
    known = meta.get("selections", {}).get(str(spec.num_prompts))

    def make_llm():
        return engine(spec, device, dtype, max_num_seqs, max_model_len)

    if known:  # selected before: no need to read and tokenise the prompts again
        finished = [n for n, k in zip(known["shards"], known["sizes"]) if meta["sizes"].get(n) == k]
        if len(finished) == len(known["shards"]) or not generate:
            # nothing written unless answers came without states: other processes may be reading
            if states:
                fill_features(out, finished, spec, make_llm)
            return out, finished
    ids = PromptIds(Tokenizer.load(resolve_model_path(spec.model)))
    sel = select_rows(spec, ids)
    shards = [Shard(i, sel.rows[s: s + shard_size]) for i, s in enumerate(range(0, len(sel.rows), shard_size))]
    names = [f"shard_{i:05d}.safetensors" for i in range(len(shards))]
    meta.setdefault("selections", {})[str(spec.num_prompts)] = {
        "shards": names, "sizes": [len(s.rows) for s in shards],
        "selection": {"rows": len(sel.rows), "dropped_overlaps": sel.dropped_overlaps, "too_long": sel.too_long}}
    # a shard is done when it holds all its rows (a smaller earlier run may have cut it)
    todo = [s for s, n in zip(shards, names) if meta["sizes"].get(n) != len(s.rows)]
    if states:
        fill_features(out, [n for s, n in zip(shards, names) if s not in todo], spec, make_llm)
    if not todo or not generate:
        _save_meta(meta_file, meta)
        return out, [n for s, n in zip(shards, names) if s not in todo]
    llm = make_llm()
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(sel.rows), desc="self-distillation", unit="prompt",
                   initial=len(sel.rows) - sum(len(s.rows) for s in todo))
    t0 = time.perf_counter()
    layers = list(spec.layers)  # emptied when the disk fills: the answers are kept without their states

    def write(shard: Shard) -> None:
        name = names[shard.index]
        pos = {r.index: i for i, r in enumerate(shard.rows)}
        # a fixed order, whatever order the answers finished in
        recs = sorted(shard.records, key=lambda r: (pos[r[0].row.index], r[0].turn, r[0].kind, r[0].seed))
        try:
            _write_shard(out / name, recs, layers)
        except OSError as e:
            if e.errno != errno.ENOSPC or not layers:
                raise
            log.warning("self-distillation: the disk under %s is full (%s): this shard's answers and the rest are "
                        "kept without their hidden states, for the prefill to fill where there is room", out, e)
            layers.clear()
            _write_shard(out / name, recs, layers)
        meta["shards"] = sorted(set(meta["shards"]) | {name})
        meta["sizes"][name] = len(shard.rows)
        meta["mix"][name] = mix_counts(recs)
        shard.records = []
        _save_meta(meta_file, meta)

    done = stream_jobs(llm, todo, spec, ids, write, time_limit, bar)
    if bar is not None:
        bar.close()
    meta["generation_seconds"] = round(meta.get("generation_seconds", 0) + time.perf_counter() - t0, 1)
    _save_meta(meta_file, meta)
    if done < len(todo):  # out of time: the shards finished so far
        names = [n for s, n in zip(shards, names) if meta["sizes"].get(n) == len(s.rows)]
    if states and len(layers) < len(spec.layers):  # the disk filled: states by prefill, or check_disk's clear error
        fill_features(out, names, spec, lambda: llm)
    return out, names


def parts(spec: DistillSpec) -> list[DistillSpec]:
    """The caches ``spec``'s data lives in: each ``data`` file's rows in one of its own
    (answered first, in the order given), the prompt file's ``num_prompts`` in another, keyed
    without the ``data`` files. So adding a ``--data`` file, or giving them in another order,
    reuses every answer already made (a carried cache, an earlier run's) and answers only the
    new file's rows; a file given twice (by name and size) is one part, its answers read once.
    (Until 2026-12-04 all data files shared one cache keyed by the whole list: a new file
    meant answering every earlier one again.)"""
    if not spec.data:
        return [spec]
    out, keys = [], set()
    for f in spec.data:
        part = attrs.evolve(spec, num_prompts=0, data=(f,))
        if part.key() not in keys:
            keys.add(part.key())
            out.append(part)
    return out + [attrs.evolve(spec, data=())]


def ensure_parts(spec: DistillSpec, root: Path | None = None, time_limit: float = 0, generate: bool = True,
                 **kw) -> list[tuple[Path, list[str]]]:
    """:func:`ensure_distill` for each of :func:`parts`, in order, sharing ``time_limit``:
    each part may spend at most its share of it (:func:`time_shares`: by rows), plus what
    the parts before it left unused; a part reached after the limit uses the shards
    finished before; time the later parts leave unused goes back to the parts stopped at
    their share. Returns each part's (cache directory, finished shards).

    Why shares: the ``data`` parts are answered first, and on the H200 (2026-12-02) 1,000 rows
    of the target's own requests with their extra answers took the whole 160 s, so the
    4,728 training prompts got none and the head trained on a narrower mix accepted less
    (expected acceptance on MT-bench's answers 2.78 -> 2.70)."""
    t0, out = time.perf_counter(), []
    pieces = parts(spec)
    rows = [r for part in pieces[:-1] if Path(part.data[0]).exists() for r in read_rows(part.data[0])]
    if repeats := repeated_rows(rows):  # answered as given (a cache's rows must not move), but said
        log.warning("self-distillation: %d rows of the --data files repeat an earlier row (the same user turns); "
                    "`python -m speculum.train.self_prompts --after FILE` writes requests that are new", repeats)
    # each part's deadline: the shares so far, the last part up to the whole limit
    ends = [time_limit * x for x in itertools.accumulate(time_shares(pieces, root))][:-1] + [time_limit]
    for part, end in zip(pieces, ends):
        left = end - (time.perf_counter() - t0) if time_limit > 0 else 0
        if time_limit > 0 and left <= 0:
            out.append(ensure_distill(part, root, generate=False, **kw))
        else:
            out.append(ensure_distill(part, root, time_limit=left, generate=generate, **kw))
    # what the later parts left unused goes to the parts stopped at their share, in order (the
    # H200, 2026-12-04: the training prompts finished in 165 of their 279 s while the target's own
    # requests stopped at their 182 s with 1,408 of 3,000 answered; the 114 s were lost)
    for i, part in enumerate(pieces):
        left = time_limit - (time.perf_counter() - t0)
        if time_limit <= 0 or not generate or left < MIN_SECONDS_AGAIN:
            break
        if _unfinished(out[i], part):
            out[i] = ensure_distill(part, root, time_limit=left, generate=True, **kw)
    return out


#: a part stopped at its share is taken up again only with at least this much of the limit left
#: (a new engine and its CUDA graphs cost ~10 s on the H200)
MIN_SECONDS_AGAIN = 30.0


def _unfinished(found: tuple[Path, list[str]], part: DistillSpec) -> bool:
    """Whether ``ensure_distill`` returned fewer finished shards than ``part`` selected."""
    d, names = found
    try:
        meta = json.loads((Path(d) / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    known = meta.get("selections", {}).get(str(part.num_prompts))
    return bool(known) and len(names) < len(known["shards"])


def time_shares(pieces: Sequence[DistillSpec], root: Path | None = None) -> list[float]:
    """Each part's share of a generation time limit, by the rows it has still to answer: its
    rows (as selected before, from its cache's ``meta.json``; else a ``data`` part's non-empty
    lines, the prompt part's ``num_prompts``) less those answered in its cache under ``root``.
    A part answered in full gets nothing: on the H200 (2026-12-04) the training prompts, all
    answered, were given 181 of 450 s by their rows and used none, while the target's own
    requests stopped at their share with 4,700 of 7,000 unanswered."""
    rows = []
    for part in pieces:
        meta_file = find_cache(part, root) / "meta.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        known = meta.get("selections", {}).get(str(part.num_prompts))
        if known:
            n = known["selection"]["rows"]
        else:
            n = part.num_prompts
            for f in part.data:
                try:
                    n += sum(1 for line in Path(f).read_text().splitlines() if line.strip())
                except OSError:
                    pass  # select_rows reports a missing file
        rows.append(max(0, n - sum(meta.get("sizes", {}).values())))
    total = sum(rows)
    return [r / total for r in rows] if total else [1.0 / len(rows)] * len(rows)


def parts_summary(found: Sequence[tuple[Path, Sequence[str]]], spec: DistillSpec) -> dict:
    """:func:`mix_summary` of every part, added up."""
    total: dict = {}
    for (path, shards), part in zip(found, parts(spec)):
        for k, v in mix_summary(path, shards, part.num_prompts).items():
            if isinstance(v, dict):
                d = total.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k) or 0
                total[k] = round(total[k] + v, 1) if isinstance(v, float) else total[k] + v
            else:  # None (a cache whose answers came from elsewhere: no generation time)
                total.setdefault(k, v)
    return total


def fill_features(path: Path, shards: Sequence[str], spec: DistillSpec, make_llm) -> int:
    """Give the shards of ``path`` that hold answers without ``spec.layers``' hidden states
    those states (teacher-forced prefill through ``make_llm()``'s target); returns how many
    shards were filled."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    want = {f"hidden.{l}" for l in spec.layers}
    todo, todo_tokens = [], 0
    for name in shards:
        with safe_open(str(Path(path) / name), "pt") as f:
            if not want <= set(f.keys()):
                todo.append(name)
                todo_tokens += f.get_slice("tokens").get_shape()[0]
    if not todo:
        return 0
    llm = make_llm()
    t0 = time.perf_counter()
    for i, name in enumerate(todo):
        data = load_file(str(Path(path) / name))
        offsets = data["offsets"].tolist()
        tokens = data["tokens"].tolist()
        seqs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        states = _hidden(prefill_features(llm, seqs, spec.layers), spec.layers)
        if i == 0:  # the first shard's states tell the bytes a token takes
            check_disk(Path(path), todo_tokens, states, len(tokens), spec.layers)
        data.update(states)
        _save_tensors(Path(path) / name, data)
    log.info("self-distillation: hidden states of %d shards of answers computed by prefill in %.1f s", len(todo),
             time.perf_counter() - t0)
    return len(todo)


def check_disk(path: Path, total: int, states: Mapping[str, torch.Tensor], tokens: int,
               layers: Sequence[int]) -> None:
    """Refuse, before writing any, the states of ``total`` tokens that the disk of ``path``
    would not have room for: ``states`` are the first shard's (``tokens`` tokens), the bytes
    a token takes. (2026-12-07: an H100's 64 GB disk filled while writing them, the call
    failed and the answers it had made were lost with it.)"""
    per_token = sum(t.numel() * t.element_size() for t in states.values()) / max(1, tokens)
    need, free = per_token * total, shutil.disk_usage(path).free
    if need > free:
        raise ConfigError(
            f"self-distillation: the hidden states of {total / 1e6:.1f} M tokens for layers {list(layers)} need "
            f"{need / 1e9:.1f} GB, and {path.parent} has {free / 1e9:.1f} GB free: record fewer layers "
            "(speculum train --record-for METHOD: the methods you train), give fewer --data files, or free disk. "
            "The answers are kept (python -m speculum.train.distill export copies them)")


def export_answers(src: Path, dst: Path) -> Path:
    """Copy the cache ``src`` to ``dst/<its name>`` with the answers only (no hidden states):
    what another machine needs to train on them (the states are recomputed there)."""
    from safetensors.torch import load_file
    src, out = Path(src), Path(dst) / Path(src).name
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((src / "meta.json").read_text())
    for name in meta["shards"]:
        data = {k: v for k, v in load_file(str(src / name)).items() if not k.startswith("hidden.")}
        _save_tensors(out / name, data)
    _save_meta(out / "meta.json", meta)
    return out


def import_answers(src: Path, model: str, root: Path | None = None) -> Path:
    """Put an exported cache ``src`` (answers, maybe without states) where this machine's
    training looks for it: keyed again for ``model`` as resolved here (a converted GGUF's
    folder, a checkpoint) and the prompt files found here (by name in speculum's data when
    the path they were read from does not exist). Returns the cache folder."""
    from speculum.datasets import data_path
    from speculum.model_source import resolve_model_path
    src = Path(src)
    meta = json.loads((src / "meta.json").read_text())
    spec = dict(meta["spec"], model=str(resolve_model_path(model)))

    def here(f: str) -> str:
        if Path(f).exists():
            return f
        try:
            return str(data_path(Path(f).name))
        except FileNotFoundError:
            return f
    recorded = meta.get("files", {})  # name and size of each file where the answers were made
    ids = {}
    for f in (spec["prompts"], *spec.get("data", []), *spec.get("exclude", [])):
        if not Path(here(f)).exists():
            if f in recorded:  # keyed as it was there: training finds it by any path with that name and size
                ids[f] = recorded[f]
            else:
                log.warning("%s: %s does not exist here and its size was not recorded (answers exported "
                            "before 2026-12-04): training finds these answers only if given that very path",
                            src.name, f)
    spec["prompts"] = here(spec["prompts"])
    for k in ("data", "exclude"):
        spec[k] = [here(f) for f in spec.get(k, [])]
    fields = {f.name for f in attrs.fields(DistillSpec)}
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k in fields}
    out = cache_dir(DistillSpec(**spec), root, ids)
    out.mkdir(parents=True, exist_ok=True)
    for name in meta["shards"]:
        if not (out / name).exists():
            shutil.copyfile(src / name, out / name)
    meta["spec"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}
    _save_meta(out / "meta.json", meta)
    return out


def _save_tensors(path: Path, data: dict) -> None:
    from safetensors.torch import save_file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(data, str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)  # a part written to a full disk would keep it full
        raise
    tmp.chmod(new_file_mode())  # safetensors writes 0600; the cache's other files get a new file's mode
    os.replace(tmp, path)


def new_file_mode() -> int:
    """The mode a new file gets under this process's umask (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _save_meta(path: Path, meta: dict) -> None:
    """Replace ``meta.json`` atomically (trainers started together read it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


def mix_counts(recs) -> dict[str, list[int]]:
    """{kind: [sequences, answer tokens]} of a shard's records."""
    out: dict[str, list[int]] = {}
    for job, tokens, P, _ in recs:
        c = out.setdefault(KINDS[job.kind], [0, 0])
        c[0] += 1
        c[1] += len(tokens) - P
    return out


def mix_summary(path: Path, shards: Sequence[str], num_prompts: int | None = None) -> dict:
    """The data mix of ``shards`` of a cache: sequences and answer tokens per kind, and what
    the selection of ``num_prompts`` prompts dropped (from ``meta.json``)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    selection = meta.get("selections", {}).get(str(num_prompts), {}).get("selection", {})
    kinds: dict[str, list[int]] = {}
    for n in shards:
        for k, (s, t) in meta.get("mix", {}).get(n, {}).items():
            c = kinds.setdefault(k, [0, 0])
            c[0] += s
            c[1] += t
    return {"sequences_per_kind": {k: v[0] for k, v in kinds.items()},
            "answer_tokens_per_kind": {k: v[1] for k, v in kinds.items()},
            **selection,
            "generation_seconds": meta.get("generation_seconds")}


def _write_shard(path: Path, recs, layers: Sequence[int]) -> None:
    tokens = torch.tensor([t for _, toks, _, _ in recs for t in toks], dtype=torch.int32)
    lens = torch.tensor([0] + [len(toks) for _, toks, _, _ in recs], dtype=torch.int64)
    data = {"tokens": tokens, "offsets": lens.cumsum(0),
            "prompt_lens": torch.tensor([P for _, _, P, _ in recs], dtype=torch.int32),
            "prompt_index": torch.tensor([j.row.index for j, _, _, _ in recs], dtype=torch.int32),
            "kind": torch.tensor([j.kind for j, _, _, _ in recs], dtype=torch.int32),
            "temperature": torch.tensor([j.temperature for j, _, _, _ in recs], dtype=torch.float32)}
    data.update(_hidden([f for _, _, _, f in recs], layers))
    _save_tensors(path, data)


def _hidden(feats: Sequence[dict[int, torch.Tensor]], layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """``hidden.<layer>`` [N, H] of a shard: its sequences' states, one after another."""
    return {f"hidden.{l}": torch.cat([f[l] for f in feats]).contiguous() if feats
            else torch.zeros(0, 1, dtype=torch.bfloat16) for l in layers}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m speculum.train.distill export SRC DST``: a cache's answers without states;
    ``... import SRC... --model M``: such copies into this machine's cache."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m speculum.train.distill",
                                 description="copy a self-distillation cache's answers without the hidden states "
                                             "(recomputed by prefill where the copy is used)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="copy SRC (a cache folder) to DST/<its name>, answers only")
    ex.add_argument("src", help="a cache folder: $SPECULUM_CACHE/distill/<model>-<key>")
    ex.add_argument("dst", help="where the copy goes (its folder name is kept: the cache key)")
    im = sub.add_parser("import", help="put exported answers (SRC...) into this machine's cache, keyed for MODEL")
    im.add_argument("src", nargs="+", help="folders written by export")
    im.add_argument("--model", required=True, help="the target as training will name it (a .gguf, a folder)")
    im.add_argument("--cache-root", help="the distill cache (default $SPECULUM_CACHE/distill)")
    args = ap.parse_args(argv)
    if args.cmd == "import":
        for src in args.src:
            print(f"imported {src} -> {import_answers(Path(src), args.model, args.cache_root)}")
        return 0
    if not (Path(args.src) / "meta.json").exists():  # a run that stopped before its first answer (a missing file)
        print(f"{args.src}: no meta.json, no answers: skipped")
        return 0
    out = export_answers(Path(args.src), Path(args.dst))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {len(list(out.glob('shard_*.safetensors')))} shards of answers, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
