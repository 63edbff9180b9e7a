# SPDX-License-Identifier: Apache-2.0
"""init_weight_transfer_engine only before the engines serve or while they are
paused (patch 0008).

As shipped (and with 0001-0007) the call reaches the workers while the engines
serve. On a MoE DP engine each rank takes it between two steps of its wave, so
one rank can wait in the transfer group's rendezvous while its peer waits for
it in the step's collective. With the patch the call is refused in the engine
core, naming the wave, before any worker is called: while a wave runs, and
between waves once the engines served. Once the engines are paused it reaches
the workers (which reject the empty init_info themselves).
"""

import asyncio

import pytest

TIMEOUT_S = 60


def test_init_after_the_engines_served_is_refused_until_they_pause(dp_moe_engine, generate):
    llm, lt = dp_moe_engine

    async def scenario():
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        def init():
            request = WeightTransferInitRequest(init_info={})
            return asyncio.wait_for(llm.init_weight_transfer_engine(request), TIMEOUT_S)

        requests = [asyncio.ensure_future(generate(llm, f"serving-{r}", r, 48)) for r in (0, 1)]
        await asyncio.sleep(1.0)
        with pytest.raises(Exception, match="while the engines serve"):
            await init()
        outs = await asyncio.wait_for(asyncio.gather(*requests), TIMEOUT_S)
        assert [len(o.outputs[0].token_ids) for o in outs] == [48, 48]
        # idle between waves: a new request could start a wave while a rank
        # sits in the rendezvous, so still refused
        with pytest.raises(Exception, match="while the engines serve"):
            await init()
        await asyncio.wait_for(llm.pause_generation(mode="keep", clear_cache=False), TIMEOUT_S)
        with pytest.raises(Exception, match="init_info is missing required field"):
            await init()
        await asyncio.wait_for(llm.resume_generation(), TIMEOUT_S)
        out = await asyncio.wait_for(generate(llm, "after", 1, 8), TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 8

    lt.run(scenario(), 4 * TIMEOUT_S)
