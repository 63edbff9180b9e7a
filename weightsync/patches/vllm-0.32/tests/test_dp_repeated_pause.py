# SPDX-License-Identifier: Apache-2.0
"""A pause on paused DP engines changes nothing; init_weight_transfer_engine
waits for the pause (patch 0006).

With 0001 alone, pause(mode="keep", clear_cache=False) followed by
pause(mode="wait") moves a paused rank to PAUSED_NEW: it schedules its kept
request alone while its DP peer idles, and the forward's DP collective times
out (EngineDeadError). As shipped the second pause drains the kept request
while the engines are meant to be paused.
"""

import asyncio

import pytest

TIMEOUT_S = 60


def test_a_second_pause_in_another_mode_leaves_the_kept_request_frozen(dp_moe_engine, generate):
    llm, lt = dp_moe_engine
    tokens: list[int] = []

    async def scenario():
        from vllm import SamplingParams

        async def stream():
            params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            async for out in llm.generate(
                {"prompt_token_ids": [1, 5, 6, 7]}, params, request_id="kept", data_parallel_rank=0
            ):
                tokens.append(len(out.outputs[0].token_ids))
            return out

        task = asyncio.ensure_future(stream())
        while not tokens:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(llm.pause_generation(mode="keep", clear_cache=False), TIMEOUT_S)
        frozen = tokens[-1]
        try:
            for mode in ("wait", "abort", "keep"):
                await asyncio.wait_for(llm.pause_generation(mode=mode, clear_cache=False), TIMEOUT_S)
            await asyncio.sleep(3.0)
            during = tokens[-1]
            assert await llm.is_paused()
        finally:  # the engine is shared by the module's tests
            await asyncio.wait_for(llm.resume_generation(), TIMEOUT_S)
        assert during == frozen, f"the kept request ran while paused: {frozen} -> {during}"
        out = await asyncio.wait_for(task, TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 48 and out.outputs[0].finish_reason == "length"
        # the engines serve on both ranks afterwards
        outs = await asyncio.wait_for(
            asyncio.gather(*(generate(llm, f"after-{r}", r, 4) for r in (0, 1))), TIMEOUT_S
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]

    lt.run(scenario(), 4 * TIMEOUT_S)


def test_init_weight_transfer_engine_during_a_pause_in_flight_is_refused(dp_moe_engine, generate):
    llm, lt = dp_moe_engine

    async def scenario():
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = asyncio.ensure_future(generate(llm, "draining", 0, 64))
        await asyncio.sleep(0.5)
        # clear_cache=False: with the default, pause_generation first awaits the
        # multi-modal cache clear and only then sends pause_scheduler, so an
        # init sent meanwhile can reach the engines before the pause does.
        pause = asyncio.ensure_future(llm.pause_generation(mode="wait", clear_cache=False))
        # is_paused is answered by every engine after the pause_scheduler call
        # sent to it before (one input queue per engine, taken in order).
        while not await asyncio.wait_for(llm.is_paused(), TIMEOUT_S):
            await asyncio.sleep(0.01)
        assert not pause.done(), "the wait-mode pause returned before its request drained"
        with pytest.raises(Exception, match="while a pause is in flight"):
            await asyncio.wait_for(
                llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={})), TIMEOUT_S
            )
        await asyncio.wait_for(pause, TIMEOUT_S)
        out = await asyncio.wait_for(request, TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 64
        await asyncio.wait_for(llm.resume_generation(), TIMEOUT_S)

    lt.run(scenario(), 4 * TIMEOUT_S)
