# SPDX-License-Identifier: Apache-2.0
"""A resume that no pause preceded must not deadlock data-parallel MoE engines
(vllm-project/vllm#55229; patch 0001).

Rank 0 serves a request and steps into its DP collective; rank 1 is idle and
has not yet taken the wave's START_DP_WAVE (the front-end's FIRST_REQ to the
coordinator is held). A resume then reaches both ranks. As shipped, rank 1's
resume_scheduler takes engines_running=False for "paused" and enters the
resume barrier alone, so neither rank returns. With the patch a resume of an
unpaused rank is a no-op: once FIRST_REQ is released, rank 1 joins the wave and
the request finishes.
"""

import asyncio

TIMEOUT_S = 60


class HeldSocket:
    """Stands in for the front-end's FIRST_REQ socket and keeps every message."""

    def __init__(self, socket) -> None:
        self.socket = socket
        self.held: list = []

    async def send(self, msg, *args, **kwargs):
        self.held.append((msg, args, kwargs))

    async def release(self) -> None:
        for msg, args, kwargs in self.held:
            await self.socket.send(msg, *args, **kwargs)
        self.held.clear()


def test_stray_resume_while_one_rank_serves(dp_moe_engine, generate):
    llm, lt = dp_moe_engine

    async def scenario():
        # Warm up both ranks, then let the wave end (the engines go idle).
        await asyncio.gather(*(generate(llm, f"warm-{r}", r, 2) for r in (0, 1)))
        await asyncio.sleep(2.0)
        client = llm.engine_core
        held = HeldSocket(client.first_req_send_socket)
        client.first_req_send_socket = held
        try:
            request = asyncio.ensure_future(generate(llm, "served", 0, 8))
            await asyncio.sleep(3.0)  # rank 0 is in its DP collective
            assert held.held, "the front-end sent no FIRST_REQ"
            resume = asyncio.ensure_future(llm.resume_generation())  # no pause preceded it
            await asyncio.sleep(3.0)  # rank 1 takes the resume before the wave
        finally:
            client.first_req_send_socket = held.socket
        await held.release()
        await asyncio.wait_for(resume, TIMEOUT_S)
        out = await asyncio.wait_for(request, TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 8

    lt.run(scenario(), 3 * TIMEOUT_S)
