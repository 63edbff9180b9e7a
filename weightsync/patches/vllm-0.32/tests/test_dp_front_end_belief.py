# SPDX-License-Identifier: Apache-2.0
"""After a request added while data-parallel engines are paused, the front-end
must not keep believing the engines run (vllm-project/vllm#51481; patch 0004).

The engines are paused (mode "abort") and idle. A late request reaches the
front-end, which forwards a FIRST_REQ to the coordinator. As shipped the
front-end sets engines_running=True when it forwards it; the coordinator
neither latches nor publishes for a FIRST_REQ, and the paused engines discard
the START_DP_WAVE it sends, so dp_engines_running() stays True until the
coordinator's next periodic publish (up to 5 s) while nothing runs. With the
patch the front-end leaves the belief to the coordinator's stats: it is False
within 1 s. After the resume the late request finishes.
"""

import asyncio
import time

TIMEOUT_S = 60
#: how long after the late request the belief must be False, seconds
WITHIN_S = 1.0
#: how long it is then watched, seconds (shorter than the coordinator's 5 s poll timeout, measured from
#: the publish the test waits for before adding the request)
WATCH_S = 2.0


async def _until(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


def test_late_request_during_abort_pause_leaves_belief_false(dp_moe_engine, generate):
    llm, lt = dp_moe_engine
    client = llm.engine_core

    async def scenario():
        await asyncio.gather(*(generate(llm, f"warm-{r}", r, 2) for r in (0, 1)))
        await llm.pause_generation(mode="abort")
        assert await _until(lambda: not client.dp_engines_running(), 10.0), "engines still believed running"
        # Wait for one of the coordinator's periodic publishes (it replaces lb_engines), so the next one
        # is about 5 s away and cannot correct the belief inside the window watched below.
        marker = object()
        client.lb_engines = marker
        assert await _until(lambda: client.lb_engines is not marker, 10.0), "no stats from the coordinator"
        late = asyncio.ensure_future(generate(llm, "late", 0, 4))
        await asyncio.sleep(WITHIN_S)
        seen = []
        end = time.monotonic() + WATCH_S
        while time.monotonic() < end:
            seen.append(client.dp_engines_running())
            await asyncio.sleep(0.05)
        assert not late.done()  # paused: the late request waits
        believed = sum(seen)
        await llm.resume_generation()
        out = await asyncio.wait_for(late, TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 4
        assert believed == 0, (
            f"dp_engines_running() was True in {believed} of {len(seen)} samples taken "
            f"{WITHIN_S}-{WITHIN_S + WATCH_S} s after a request added during the pause"
        )

    lt.run(scenario(), 3 * TIMEOUT_S)
