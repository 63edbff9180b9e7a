# SPDX-License-Identifier: Apache-2.0
"""Weight update calls only inside a DP pause; a failed update blocks resume
until a new update succeeds (patch 0002).

As shipped, start_weight_update runs while the engines serve: the worker
opens a layerwise reload under running forwards, and the engines die
(EngineDeadError) or serve a half-loaded model. With the patches it is refused
in the engine core before any worker is called, and the requests finish. A
weight update call that raises leaves the session failed: pause and resume are
refused, update and finish need a new session, and a new start is let through.
"""

import asyncio

import pytest

TIMEOUT_S = 60


def test_start_weight_update_while_serving_is_refused(dp_moe_engine, generate):
    llm, lt = dp_moe_engine

    async def scenario():
        requests = [asyncio.ensure_future(generate(llm, f"serving-{r}", r, 24)) for r in (0, 1)]
        await asyncio.sleep(1.0)
        with pytest.raises(Exception, match="not paused"):
            await asyncio.wait_for(llm.start_weight_update(), TIMEOUT_S)
        outs = await asyncio.wait_for(asyncio.gather(*requests), TIMEOUT_S)
        assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]

    lt.run(scenario(), 3 * TIMEOUT_S)


def test_a_failed_session_blocks_resume_until_a_new_start(dp_moe_engine, generate):
    llm, lt = dp_moe_engine

    async def scenario():
        await asyncio.wait_for(llm.pause_generation(mode="keep"), TIMEOUT_S)
        # No trainer connection was initialised: the workers' start raises, and
        # the session is failed (the weights may be partial after a real
        # failure): resume and pause are refused, nothing reaches a worker.
        with pytest.raises(Exception, match="init_weight_transfer_engine"):
            await asyncio.wait_for(llm.start_weight_update(), TIMEOUT_S)
        with pytest.raises(Exception, match=r"during a weight update \(failed\)"):
            await asyncio.wait_for(llm.resume_generation(), TIMEOUT_S)
        with pytest.raises(Exception, match=r"during a weight update \(failed\)"):
            await asyncio.wait_for(llm.pause_generation(mode="keep"), TIMEOUT_S)
        assert await llm.is_paused()
        # update and finish need a session; a new start is let through to the
        # workers (which raise again: still no trainer connection).
        with pytest.raises(Exception, match="without an active weight update"):
            await asyncio.wait_for(llm.finish_weight_update(), TIMEOUT_S)
        with pytest.raises(Exception, match="init_weight_transfer_engine"):
            await asyncio.wait_for(llm.start_weight_update(), TIMEOUT_S)

    lt.run(scenario(), 3 * TIMEOUT_S)
