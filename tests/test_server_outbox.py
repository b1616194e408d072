"""The engine thread hands a step's updates to the event loop together (one wake-up per
step, not one per request per step), in order, and nothing is lost."""

from __future__ import annotations

import asyncio

from speculum import SamplingParams
from speculum.server import async_engine
from speculum.server.async_engine import AsyncEngine
from speculum.testing import make_llm


def test_one_wakeup_per_step_carries_every_request_s_update(tiny_llama, monkeypatch):
    calls = []
    real = async_engine.deliver

    def counting(loop, items):
        calls.append(len(items))
        real(loop, items)
    monkeypatch.setattr(async_engine, "deliver", counting)
    llm = make_llm(tiny_llama, max_num_seqs=8)
    engine = AsyncEngine(llm)
    engine.start()
    n, max_tokens = 8, 12
    expected = llm.generate([{"prompt_token_ids": [5 + i, 7, 9]} for i in range(n)],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    async def one(i):
        rs = await engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 7, 9]},
                                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                      stream=True, num_prompt_tokens=3)
        got = []
        while True:
            u = await rs.get()
            got += u.new_token_ids
            if u.finished:
                assert u.token_ids == got
                return got

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(n)))
    try:
        outs = asyncio.run(all_of_them())
    finally:
        engine.shutdown()
    assert outs == [o.outputs[0].token_ids for o in expected]
    updates = sum(calls)
    # every request: "added", then a streamed update per step and the final one
    assert updates >= n * (1 + max_tokens // 2)
    # the updates of a step travel together: far fewer wake-ups than updates
    assert len(calls) <= updates / 4, (len(calls), updates)
