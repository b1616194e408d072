"""Target hidden states on demand: prefill and verify positions, both runners, and the loop.

Hidden layer ``i >= 0`` is the output stream of decoder layer ``i``; ``-1`` is the final
normed state. Both runners must agree with transformers' own forward over the whole
sequence, whether the positions came from the prefill or from verify steps, and the loop
must hand a proposer exactly the states of the positions the target accepted.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculum
from speculum.backends.torch.backend import TorchBackend
from speculum import SamplingParams
from speculum.interfaces import Draft
from speculum.testing import make_llm

RUNNERS = ["native", "hf"]
LAYERS = (0, -1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Teacher-forced hidden states from transformers: ids -> {layer: [n, H]}."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    def run(ids: list[int]) -> dict[int, torch.Tensor]:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        # (embeddings, layer 0, ..., layer L-2, final normed)
        return {0: hs[1][0], -1: hs[-1][0]}

    return run


def load_runner(model_dir, runner: str):
    backend = TorchBackend(device="cpu", dtype="float32", runner=runner,
                                                   kv_cache_memory=4 << 20)
    r = backend.load_model(model_dir, role="target")
    backend.plan_memory(256)
    return r


@pytest.mark.parametrize("runner", RUNNERS)
def test_prefill_returns_hidden_states_of_every_position(tiny_llama, reference, runner):
    r = load_runner(tiny_llama, runner)
    prompts = {1: [5, 6, 7, 8, 9, 10, 11], 2: [40, 41], 3: []}
    out = r.add_many(list(prompts), list(prompts.values()), hidden_layers=LAYERS)
    assert set(out) == set(prompts)
    for sid, ids in prompts.items():
        assert set(out[sid]) == set(LAYERS)
        for layer in LAYERS:
            assert out[sid][layer].shape == (len(ids), 64)
            if ids:
                torch.testing.assert_close(out[sid][layer].float(), reference(ids)[layer], atol=1e-4, rtol=1e-4)
    # no layers asked: nothing computed, nothing returned
    assert r.add_many([4], [[1, 2, 3]]) == {4: {}}


@pytest.mark.parametrize("runner", RUNNERS)
def test_verify_hidden_states_continue_the_prefill(tiny_llama, reference, runner):
    r = load_runner(tiny_llama, runner)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    r.add(1, ids[:5])
    r.add(2, [3, 4])
    out = r.forward([1, 2], torch.tensor([ids[5:9], [9, 9, 0, 0]]), [4, 2], hidden_layers=LAYERS)
    ref = reference(ids)
    for layer in LAYERS:
        assert out.hidden_states[layer].shape == (2, 4, 64)
        torch.testing.assert_close(out.hidden_states[layer][0].float(), ref[layer][5:9], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden_states[layer][1, :2].float(), reference([3, 4, 9, 9])[layer][2:],
                                   atol=1e-4, rtol=1e-4)


def test_transformers_runner_names_the_layers_it_cannot_return(tiny_llama):
    r = load_runner(tiny_llama, "hf")
    with pytest.raises(ValueError, match="hidden layers 0..0 and -1"):
        r.add(1, [5, 6, 7], hidden_layers=(1,))  # the last layer's pre-norm output


class HiddenRecorder:
    """Drafts a fixed guess and records every hidden state the loop hands over."""

    hidden_layers = LAYERS

    def __init__(self, ctx=None):
        self.prefill: dict[int, dict] = {}
        self.steps: list = []
        self.accepted: dict[int, dict[int, list[torch.Tensor]]] = {}

    def add_request(self, seq, hidden_states=None):
        assert hidden_states is not None and set(hidden_states) == set(LAYERS)
        assert all(h.shape[0] == len(seq.token_ids) - 1 for h in hidden_states.values())
        self.prefill[seq.seq_id] = {k: v.clone() for k, v in hidden_states.items()}
        self.accepted[seq.seq_id] = {k: [v.clone()] for k, v in hidden_states.items()}

    def remove_request(self, seq_id):
        pass

    def propose(self, batch):
        k = batch.num_speculative_tokens
        # a guess that is sometimes right: the token two back, repeated
        ids = torch.tensor([[s.token_ids[-2] if len(s.token_ids) > 1 else 5] * k for s in batch.seqs])
        return Draft(token_ids=ids)

    def observe(self, fb):
        hs = fb.hidden_states
        assert set(hs) == set(LAYERS)
        for b, (sid, a) in enumerate(zip(fb.seq_ids, fb.num_accepted)):
            for layer in LAYERS:
                # states of the last token and of the accepted drafts only
                self.accepted[sid][layer].append(hs[layer][b, : a + 1].clone())
        self.steps.append(list(fb.num_accepted))


class RecorderPlugin:
    @staticmethod
    @speculum.hookimpl
    def speculum_register_proposers(register):
        register("hidden_recorder", HiddenRecorder)


@pytest.mark.parametrize("runner", RUNNERS)
def test_loop_hands_prefill_and_accepted_states_to_the_proposer(tiny_llama, reference, runner):
    llm = make_llm(tiny_llama, {"method": "hidden_recorder", "num_speculative_tokens": 3}, runner=runner,
                   plugins=[RecorderPlugin])
    assert llm.loop.hidden_layers == LAYERS
    prompts = [[10, 11, 12, 13, 10, 11, 12, 13], [7], [30, 31, 30, 31, 30]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    rec = llm.proposer
    assert any(a > 0 for step in rec.steps for a in step)  # some drafts accepted
    for sid, p, o in zip(sorted(rec.prefill), prompts, outs):
        assert rec.prefill[sid][-1].shape[0] == len(p) - 1
        full = p + o.token_ids
        ref = reference(full[:-1])  # every position but the last token's
        for layer in LAYERS:
            got = torch.cat(rec.accepted[sid][layer])
            # prefill + accepted verify positions = positions 0..n-2, in order
            assert got.shape[0] == len(full) - 1
            torch.testing.assert_close(got.float(), ref[layer], atol=1e-4, rtol=1e-4)
