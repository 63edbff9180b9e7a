# SPDX-License-Identifier: Apache-2.0
"""A pause retried after the DP pause consensus joins the pause in progress
(patch 0007).

Request A generates on DP rank 0. pause_scheduler("wait") is sent to both
ranks, and a retry of it to rank 1 at once. Both ranks set pending_pause, and
the next sync_dp_state (within dp_sync_interval steps) reaches the consensus:
pending_pause is cleared, ignore_start_dp_wave set, and the ranks keep
stepping together while rank 0 drains A. The retry then reaches rank 0. As
shipped, _pause_complete sets rank 0's pending_pause again, rank 1 never
does, sync_dp_state counts 1 of 2 pending and keeps has_unfinished true: the
ranks step dummy batches forever and no pause call returns. Patched, the
retry joins the pause in progress and every call returns once A drained.
"""

import asyncio

from vllm.sampling_params import SamplingParams

TIMEOUT_S = 60
#: tokens A must produce after the pause was sent before the retry to rank 0:
#: more than one dp_sync_interval (16), so the consensus round has passed
AFTER_CONSENSUS_TOKENS = 24
MAX_TOKENS = 120


def test_a_pause_retried_after_the_consensus_returns(dp_moe_engine):
    llm, lt = dp_moe_engine
    tokens: list[int] = []

    async def scenario():
        async def stream():
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            async for out in llm.generate(
                {"prompt_token_ids": [1, 5, 6, 7]}, params, request_id="a", data_parallel_rank=0
            ):
                tokens.append(len(out.outputs[0].token_ids))
            return out

        def pause_on(rank: int):
            engine = rank.to_bytes(2, "little")
            return asyncio.ensure_future(
                llm.engine_core._call_utility_async("pause_scheduler", "wait", False, engine=engine)
            )

        task = asyncio.ensure_future(stream())
        while not tokens:
            await asyncio.sleep(0.01)
        calls = [pause_on(0), pause_on(1), pause_on(1)]  # the pause, its retry to rank 1
        at_pause = tokens[-1]
        while tokens[-1] < at_pause + AFTER_CONSENSUS_TOKENS and not task.done():
            await asyncio.sleep(0.005)
        assert not task.done(), "A finished before the consensus round: the window was missed"
        calls.append(pause_on(0))  # the retry reaches rank 0 past the consensus
        out = await asyncio.wait_for(task, TIMEOUT_S)  # the wait pause drains A
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        await asyncio.wait_for(asyncio.gather(*calls), 30)  # as shipped: TimeoutError
        assert await llm.is_paused()
        await asyncio.wait_for(llm.resume_generation(), TIMEOUT_S)

    lt.run(scenario(), 4 * TIMEOUT_S)
