# SPDX-License-Identifier: Apache-2.0
"""A wait-mode pause must drain every request added before it, also one still
queued when the pause arrives (patch 0005).

Request A is generating on DP rank 0. Request B is added to the same rank and
pause_generation(mode="wait") follows at once, so both messages usually reach
the engine while it is inside one step. _process_input_queue then handles the
add and the pause before the next step, and B is still queued when the
scheduler enters PAUSED_NEW. As shipped, B stays queued: the pause returns once
A finished, and B produces nothing until the resume. With the patch the pause
drains B too, and returns only after B finished. Each trial ends with a resume
after which both requests have finished.
"""

import asyncio

from vllm.sampling_params import RequestOutputKind, SamplingParams

TIMEOUT_S = 60
TRIALS = 3
PROMPT = {"prompt_token_ids": [1, 5, 6, 7]}


async def _final(collector, timeout_s: float):
    """The collector's final output within ``timeout_s``, or None."""
    try:
        return await asyncio.wait_for(collector.get(), timeout_s)
    except TimeoutError:
        return None


def _drained_in_each_trial(llm, lt, prefix: str, pause) -> list[bool]:
    """TRIALS times: A generates on DP rank 0, B is added to it, then
    ``await pause()``; whether B finished before the pause returned. Each
    trial ends with a resume after which both requests have finished."""

    async def trial(k: int) -> bool:
        long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        short = SamplingParams(
            max_tokens=4,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        a = await llm.add_request(f"{prefix}a-{k}", PROMPT, long, data_parallel_rank=0)
        first = await asyncio.wait_for(a.get(), TIMEOUT_S)
        assert not first.finished  # A is generating: the engine is stepping
        b = await llm.add_request(f"{prefix}b-{k}", PROMPT, short, data_parallel_rank=0)
        await asyncio.wait_for(pause(), TIMEOUT_S)
        out = first
        while not out.finished:  # A was running: wait mode drained it
            out = await asyncio.wait_for(a.get(), 1.0)
        drained = await _final(b, 1.0)
        await llm.resume_generation()
        final = drained or await asyncio.wait_for(b.get(), TIMEOUT_S)
        assert final.finished and len(final.outputs[0].token_ids) == 4
        return drained is not None

    async def scenario():
        return [await trial(k) for k in range(TRIALS)]

    return lt.run(scenario(), TRIALS * 3 * TIMEOUT_S)


def test_wait_pause_drains_a_request_added_just_before_it(dp_moe_engine):
    llm, lt = dp_moe_engine
    drained = _drained_in_each_trial(llm, lt, "", lambda: llm.pause_generation(mode="wait"))
    assert all(drained), (
        f"pause_generation(mode='wait') returned with a request added before it "
        f"still queued in {drained.count(False)} of {TRIALS} trials"
    )


def test_a_wait_after_a_keep_in_flight_drains_the_requests_queued_before_it(dp_moe_engine):
    """pause(mode="keep") and pause(mode="wait") sent back to back while A
    generates and B is queued on DP rank 0: both reach the rank before the
    keep's consensus, the keep sets PAUSED_ALL and the wait PAUSED_NEW. The
    wait must drain B too, which was added before it; as shipped (and with
    0005 recording the queue only on leaving UNPAUSED) B stays queued until
    the resume."""
    llm, lt = dp_moe_engine

    def keep_then_wait():
        # Both tasks send before either awaits a reply, keep first: the rank
        # handles both between two steps.
        keep = asyncio.ensure_future(llm.pause_generation(mode="keep", clear_cache=False))
        wait = asyncio.ensure_future(llm.pause_generation(mode="wait", clear_cache=False))
        return asyncio.gather(keep, wait)

    drained = _drained_in_each_trial(llm, lt, "k", keep_then_wait)
    assert all(drained), (
        f"pause_generation(mode='wait') after a keep in flight returned with a "
        f"request added before both still queued in {drained.count(False)} of {TRIALS} trials"
    )
