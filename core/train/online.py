"""The target's hidden states made when a batch asks for them (``speculum train --states online``).

By default the self-distillation data holds the hidden states of every answer token
(``--states disk``): written once, read by every run. They take room: EAGLE-3 records
three of the target's layers and its final state, 4.6 KB a token in bf16 for the default
model, so 12 M answer tokens passed an H100's 64 GB disk (2026-12-07). ``--states online``
keeps the answers only (token ids: megabytes) and has the target prefill each training
and validation batch through the same engine that would have recorded them: no disk, no
prefill before training starts, a target forward per step instead (SpecForge calls this
its online mode). The states equal the recorded ones up to the kernels' rounding of a
different batch (``tests/test_train_online.py``).

Each sequence is prefilled from its first token, whatever the batch cuts from its start
(``--max-len``, ``--prompt-context``): a state depends on every token before it, and that
is what the recorded states saw.
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.train.generate import prefill_features


class OnlineStates:
    """Hidden states of ``layers`` for token sequences, by a teacher-forced prefill through
    ``llm``'s target (a :class:`speculum.LLM` with no proposer), returned on ``device``.

    Satisfies :class:`speculum.train.data.StateSource`."""

    def __init__(self, llm, layers: Sequence[int], device="cpu"):
        self.llm = llm
        self.layers = tuple(sorted(layers))
        self.device = torch.device(device)

    def __call__(self, seqs: Sequence[Sequence[int]]) -> list[dict[int, torch.Tensor]]:
        # the trainer's bf16 autocast must not reach the target's own kernels: the states are
        # the ones the target computes at its dtype, as recorded ones are
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            return prefill_features(self.llm, seqs, self.layers, to=self.device)


def online_states(spec, layers: Sequence[int], device, gen_device, dtype, batch_size: int,
                  max_model_len: int, prefill_chunk: int | None = None) -> OnlineStates:
    """The states source a training run on ``spec``'s answers uses: an engine of its own
    with KV room for one batch (``batch_size`` sequences: the memory plan caps the cache at
    what they can use), on ``gen_device`` (default: the training device) at ``dtype``. Its
    prefill takes whole sequences (``prefill_chunk`` = ``max_model_len``): a batch is then
    one or a few forwards (16,384 tokens each at most), every one a sequence's first chunk,
    which attends to its own keys only (the runner's flash path), where the default chunk
    of 512 tokens made passes of at most 4,096 and a masked second chunk past 512
    (``prefill_chunk``: another chunk, as ``speculum bench states`` compares)."""
    from speculum.train.generate import engine
    threads = torch.get_num_threads()
    llm = engine(spec, gen_device or device, dtype, max(1, batch_size), max_model_len,
                 prefill_chunk=prefill_chunk or max_model_len)
    torch.set_num_threads(threads)  # the engine applied its default; the run keeps its --threads
    return OnlineStates(llm, layers, device)
