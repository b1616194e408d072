"""Distillation data in memory, its train/validation split, and padded training batches.

Positions: sequence ``i`` has tokens ``x_0..x_{n-1}`` (prompt of ``P`` tokens, then the
target's answer) and the target's hidden state ``h_t`` at every position but the last.
``h_t`` is what the target had when it predicted ``x_{t+1}``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, Sequence

import attrs
import torch


@attrs.define(eq=False)
class Batch:
    """Right-padded sequences of one training step (everything on the training device)."""

    # [B, T] token ids (0 padded)
    tokens: torch.Tensor
    # layer -> [B, T, H] float32 target hidden states (zeros where there is none)
    hidden: dict[int, torch.Tensor]
    # [B, T] position t has a hidden state (t < n - 1)
    valid: torch.Tensor
    # [B, T] the token after position t belongs to the answer (t + 1 >= P)
    answer_next: torch.Tensor
    # [B] the row's answer is the target's greedy one (its tokens are the argmax: what a
    # greedy chain drafts when every earlier draft was accepted)
    greedy: torch.Tensor | None = None

    def target_mask(self, shift: int, loss_on: str = "answer") -> torch.Tensor:
        """[B, T - shift] anchors ``t`` whose position ``t + shift`` is a training target.

        Position ``s = t + shift`` must have a hidden state (it gives the target's
        distribution of ``x_{s+1}``) and, for ``loss_on="answer"``, ``x_{s+1}`` must be
        part of the answer.
        """
        m = self.valid[:, shift:]
        if loss_on == "answer":
            m = m & self.answer_next[:, shift:]
        return m


def shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x[:, shift:]`` padded back to ``T`` with zeros at the end (dim 1)."""
    if shift == 0:
        return x
    pad = x.new_zeros((x.shape[0], shift, *x.shape[2:]))
    return torch.cat([x[:, shift:], pad], dim=1)


class StateSource(Protocol):
    """Where a batch's hidden states come from when the data holds none (``speculum train
    --states online``: :class:`speculum.train.online.OnlineStates`)."""

    #: the target layers it gives
    layers: tuple[int, ...]

    def __call__(self, seqs: Sequence[Sequence[int]]) -> list[dict[int, torch.Tensor]]:
        """Per sequence ``{layer: [n, H]}``: the target's state at each of its ``n`` positions
        given the tokens before it (zeros at the last), on the training device."""
        ...


#: how :meth:`DistillData.split` places prompts, recorded in each head's training report
#: (``data.val_split``): a head continued from one trained on another split may have
#: trained on today's validation prompts
VAL_SPLIT = "prompt-hash"


def cache_shards(path: Path | str) -> list[str]:
    """Every shard of the distillation cache at ``path`` (its ``meta.json``), by full path."""
    meta = Path(path) / "meta.json"
    if not meta.exists():
        from speculum.errors import ConfigError
        raise ConfigError(f"{path}: not a distillation cache (no meta.json); give $SPECULUM_CACHE/distill/<folder>")
    return [str(Path(path) / n) for n in json.loads(meta.read_text())["shards"]]


@attrs.define(eq=False)
class DistillData:
    tokens: torch.Tensor        # [N] int64
    offsets: torch.Tensor       # [S + 1]
    prompt_lens: torch.Tensor   # [S]
    prompt_index: torch.Tensor  # [S] group id of the source row (its row in the prompt file)
    hidden: dict[int, torch.Tensor]  # layer -> [N, H] bfloat16
    #: [S] kind of each answer (index in speculum.train.mix.KINDS; 0 for older caches)
    kind: torch.Tensor | None = None
    #: [S] sampling temperature of each answer (0: greedy; 0 for older caches)
    temperature: torch.Tensor | None = None
    #: [S] which cache directory each sequence came from (the prompt file's answers, each --data
    #: file's): ``prompt_index`` counts rows within one file, so groups are (part, prompt_index)
    part: torch.Tensor | None = None
    #: with ``hidden`` empty: what computes each batch's states (``--states online``)
    states: StateSource | None = None
    #: ``tokens`` on the host, for ``states`` (made once)
    _host_tokens: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    @classmethod
    def load(cls, path: Path, layers: Sequence[int] | None = None, shards: Sequence[str] | None = None,
             device="cpu") -> "DistillData":
        """Read ``shards`` (default: every shard in ``meta.json``), keeping only ``layers``.

        Tokens and hidden states go into tensors of their final size on ``device`` one
        shard at a time, so the host never holds more than one shard beyond them.
        """
        from safetensors import safe_open
        files = cache_shards(path) if shards is None else [str(Path(path) / n) for n in shards]
        sizes, keep = [], None
        for f in files:  # sizes first (headers only)
            with safe_open(f, "pt") as h:
                sizes.append(h.get_slice("tokens").get_shape()[0])
                names = [k for k in h.keys() if k.startswith("hidden.")]
                found = {int(k.split(".", 1)[1]): h.get_slice(k).get_shape()[-1] for k in names}
                keep = keep or {l: H for l, H in found.items() if layers is None or l in layers}
        if not sum(sizes):
            raise ValueError(f"no distillation data in the shards of {path}")
        N = sum(sizes)
        tokens = torch.empty(N, dtype=torch.int64, device=device)
        hidden = {l: torch.empty(N, H, dtype=torch.bfloat16, device=device) for l, H in keep.items()}
        offs, plens, pidx, kinds, temps, parts, at = [0], [], [], [], [], [], 0
        dirs = {}  # a shard's directory -> its part number
        for f, n in zip(files, sizes):
            if n == 0:  # every prompt of the shard was skipped
                continue
            with safe_open(f, "pt") as h:
                S = h.get_slice("prompt_lens").get_shape()[0]
                parts.append(torch.full((S,), dirs.setdefault(str(Path(f).parent), len(dirs)), dtype=torch.int64))
                tokens[at: at + n] = h.get_tensor("tokens").long()
                offs += (h.get_tensor("offsets")[1:] + at).tolist()
                plens.append(h.get_tensor("prompt_lens").long())
                pidx.append(h.get_tensor("prompt_index").long())
                have = set(h.keys())
                kinds.append(h.get_tensor("kind").long() if "kind" in have else torch.zeros(S, dtype=torch.int64))
                temps.append(h.get_tensor("temperature").float() if "temperature" in have else torch.zeros(S))
                for l, t in hidden.items():
                    t[at: at + n] = h.get_tensor(f"hidden.{l}")
            at += n
        return cls(tokens, torch.tensor(offs), torch.cat(plens), torch.cat(pidx), hidden, torch.cat(kinds),
                   torch.cat(temps), torch.cat(parts))

    @staticmethod
    def nbytes(path: Path, layers: Sequence[int] | None, shards: Sequence[str]) -> int:
        """Bytes :meth:`load` would hold (tokens as int64, hidden states as bf16)."""
        from safetensors import safe_open
        total = 0
        for n in shards:
            with safe_open(str(Path(path) / n), "pt") as h:
                N = h.get_slice("tokens").get_shape()[0]
                total += N * 8
                for k in h.keys():
                    if k.startswith("hidden.") and (layers is None or int(k.split(".", 1)[1]) in layers):
                        total += 2 * N * h.get_slice(k).get_shape()[-1]
        return total

    def __len__(self) -> int:
        return self.prompt_lens.shape[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.states.layers if self.states is not None else self.hidden))

    def split(self, val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
        """Disjoint train / validation sequence ids, split by prompt (the answers of one
        prompt stay on one side); at least one prompt on each side.

        A prompt's side is fixed by its content: a hash of ``seed`` and its shortest prompt
        (the plain request; sampled answers share it, long-form and second-turn prompts
        extend it), below ``val_fraction`` is validation. So the split stays put when the
        data grows (more rows answered, another --data file): a prompt trained on once never
        moves into validation, and the same request in two files lands on one side. (Until
        2026-12-06 the prompts were shuffled in the order the shards listed them; answering
        1,592 more rows reordered them, and a continued head's validation then held answers
        it had trained on: ``--keep-best`` kept step 0.)
        """
        if val_fraction <= 0:
            return list(range(len(self))), []
        parts = self.part.tolist() if self.part is not None else [0] * len(self)
        offsets, plens = self.offsets.tolist(), self.prompt_lens.tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        root: dict[tuple[int, int], int] = {}  # each group's sequence with the shortest prompt
        for i, row in enumerate(self.prompt_index.tolist()):
            g = (parts[i], row)
            groups.setdefault(g, []).append(i)
            if g not in root or plens[i] < plens[root[g]]:
                root[g] = i
        tokens = self.tokens.cpu()

        def place(g) -> float:  # in [0, 1): the group's prompt's hash
            i = root[g]
            ids = tokens[offsets[i]: offsets[i] + plens[i]].numpy().astype("<i8").tobytes()
            digest = hashlib.sha256(seed.to_bytes(8, "little", signed=True) + ids).digest()
            return int.from_bytes(digest[:8], "little") / 2 ** 64
        at = {g: place(g) for g in groups}
        val = [g for g in groups if at[g] < val_fraction]
        if not val:
            val = [min(groups, key=at.get)]
        elif len(val) == len(groups):
            val.remove(max(groups, key=at.get))
        val_set = set(val)
        pick = lambda ks: sorted(i for k in ks for i in groups[k])  # noqa: E731
        return pick(g for g in groups if g not in val_set), pick(val)

    def answer_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        """All answer tokens of the sequences ``ids`` (for vocabulary statistics), gathered in one op."""
        i = torch.as_tensor(list(ids), dtype=torch.int64)
        if i.numel() == 0:
            return self.tokens[:0]
        starts = self.offsets[i] + self.prompt_lens[i]
        lens = self.offsets[i + 1] - starts
        first = torch.cumsum(lens, 0) - lens  # where each answer starts in the output
        idx = torch.repeat_interleave(starts - first, lens) + torch.arange(int(lens.sum()))
        return self.tokens[idx.to(self.tokens.device)]

    def num_tokens(self, ids: Sequence[int]) -> int:
        return int(sum(int(self.offsets[i + 1] - self.offsets[i]) for i in ids))

    def to(self, device) -> "DistillData":
        """The same data with tokens and hidden states on ``device`` (a GPU: batches are then
        gathered there, with no per-step host copies)."""
        return attrs.evolve(self, tokens=self.tokens.to(device), hidden={l: h.to(device) for l, h in self.hidden.items()})

    def batch(self, ids: Sequence[int], max_len: int, device="cpu", prompt_context: int = 0,
              answer_tokens: int = 0) -> Batch:
        """Pad the sequences ``ids`` into a Batch: at most ``max_len`` tokens of each, and at
        most ``prompt_context`` prompt tokens before the answer (0: no limit); what is cut
        is the start of the prompt. ``answer_tokens`` > 0 keeps only the first that many
        answer tokens (as a generation with that ``max_tokens`` would have made). Gathered
        where the data lives, then moved to ``device``."""
        rows = []
        for i in ids:
            s, e, P = int(self.offsets[i]), int(self.offsets[i + 1]), int(self.prompt_lens[i])
            end = e
            if answer_tokens:
                e = min(e, s + P + answer_tokens)
            start = max(s, e - max_len, s + P - prompt_context if prompt_context else s)
            rows.append((start, e, s + P, s, end))
        B, T = len(rows), max(r[1] - r[0] for r in rows)
        starts = torch.tensor([r[0] for r in rows]).unsqueeze(1)
        ends = torch.tensor([r[1] for r in rows]).unsqueeze(1)
        answer = torch.tensor([r[2] for r in rows]).unsqueeze(1)
        flat = starts + torch.arange(T).unsqueeze(0)  # [B, T] positions in the flat arrays
        present = flat < ends
        valid = flat < ends - 1                      # the last token has no hidden state
        answer_next = (flat + 1 >= answer) & valid   # token t + 1 belongs to the answer
        where = self.tokens.device
        idx = torch.where(present, flat, 0).to(where)
        keep = present.to(where)
        tokens = torch.where(keep, self.tokens[idx], 0)
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        if self.states is None:
            hidden = {l: to(h[idx].float() * keep.unsqueeze(-1)) for l, h in self.hidden.items()}
        else:
            hidden = self._computed_states(rows, T, device)
        temps = self.temperature if self.temperature is not None else torch.zeros(len(self))
        greedy = torch.tensor([float(temps[i]) == 0.0 for i in ids])
        return Batch(to(tokens), hidden, to(valid), to(answer_next), to(greedy))

    def _computed_states(self, rows, T: int, device) -> dict[int, torch.Tensor]:
        """The states of the batch's ``rows`` (start, stop, answer start, sequence start,
        sequence end) from :attr:`states`: each sequence prefilled from its first token up to
        the token after the last position kept (a state depends on every token before it;
        the recorded ones saw them all), so the last position kept has its state unless it
        ends the sequence (then zeros, as recorded)."""
        if self._host_tokens is None:
            self._host_tokens = self.tokens.cpu()
        host = self._host_tokens
        feats = self.states([host[s: min(e + 1, end)].tolist() for start, e, _, s, end in rows])
        out = {}
        for l in self.states.layers:
            H = feats[0][l].shape[-1]
            h = torch.zeros(len(rows), T, H, dtype=torch.float32, device=device)
            for b, ((start, e, _, s, _), f) in enumerate(zip(rows, feats)):
                h[b, : e - start] = f[l][start - s: e - s].to(device, torch.float32)
            out[l] = h
        return out
