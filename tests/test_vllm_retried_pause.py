"""A retried pause livelocks vLLM 0.32's DP engines as shipped; weightsync's patch 0007 (on by default in the
plugin) makes the retry join the pause in progress (issue 19, item 1: found by ``weightsync check --variant
vllm-0.32-epoch --mode wait --repeat-pause``, ``progress_pause`` in 12 steps, before 0007; the row verifies
with it).

A real MoE DP=2 ``AsyncLLM``: rank 0 generates; ``pause_scheduler("wait")`` reaches both ranks and its retry
reaches rank 1 at once (idle, it takes both before it steps). A consensus round (``sync_dp_state``,
``config/parallel.py:850-875``: both ranks pending) clears both ranks' ``pending_pause`` while rank 0 still
drains. Then the retry reaches rank 0. As shipped (``WEIGHTSYNC_VLLM_FIX=none``) ``_pause_complete`` sets its
``pending_pause`` again, rank 1 never does, and ``sync_dp_state`` counts 1 of 2 pending, which keeps
``has_unfinished`` true on both: the ranks step dummy batches forever and no pause call returns. With the fix
every call returns once the request drained, and both ranks end idle with no pause pending.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

require_vllm()

from weightsync.vllm_tools.fix import DEFAULT_FIX, ENV_FIX, OFF  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

#: how long the engines are watched after the drained request finished, seconds
WATCH_S = 10.0


@pytest.mark.parametrize("fix", [OFF, DEFAULT_FIX])
def test_a_pause_retried_across_a_consensus_round(
    fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As shipped: the livelock. With the fix: every pause call returns after the drain."""
    from vllm import SamplingParams

    from weightsync.vllm_tools import probe
    from weightsync.vllm_tools.models import build_tiny_mixtral
    from weightsync.vllm_tools.serving import LoopThread, shutdown_async_llm, start_async_llm

    build_tiny_mixtral(tmp_path / "m")
    events = tmp_path / "events"
    monkeypatch.setenv(ENV_FIX, fix)  # the engines are fresh processes: their plugin reads it
    os.environ[probe.ENV_EVENTS] = str(events)
    lt = LoopThread("vllm-retried-pause")
    try:
        llm, _ = start_async_llm(lt, tmp_path / "m", dp=2)
    finally:
        os.environ.pop(probe.ENV_EVENTS, None)
    outs: list[Any] = []
    try:

        async def generate() -> None:
            sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            async for o in llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, sp, "gen", data_parallel_rank=0):
                outs.append(o)

        gen = lt.spawn(generate())
        deadline = time.monotonic() + 60
        while not outs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outs, "the request produced nothing"

        def pause_on(rank: int) -> Any:
            engine = rank.to_bytes(2, "little")
            return lt.spawn(
                llm.engine_core._call_utility_async("pause_scheduler", "wait", True, engine=engine)
            )

        def last(rank: int) -> dict[str, Any]:
            recs = probe.read_events(events).get(rank, [])
            return dict(recs[-1]["vllm"]) if recs else {}

        calls = [pause_on(0), pause_on(1), pause_on(1)]  # the pause, and its retry to rank 1 at once
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            v1 = last(1)
            if v1.get("ignore_start_dp_wave") and not v1.get("pending_pause"):
                break
            time.sleep(0.005)
        assert not gen.done(), "rank 0 finished before the consensus round: the window was missed"
        assert last(1).get("ignore_start_dp_wave") and not last(1).get("pending_pause"), last(1)
        calls.append(pause_on(0))  # the retry reaches rank 0 after the consensus round
        gen.result(120)  # the wait pause drains it
        if fix == DEFAULT_FIX:  # patch 0007: the retry joined the pause in progress
            for c in calls:
                c.result(30)
            time.sleep(0.5)
            v0, v1 = last(0), last(1)
            assert not v0["pending_pause"] and not v1["pending_pause"], (v0, v1)
            assert not v0["engines_running"] and not v1["engines_running"], (v0, v1)
            assert lt.run(llm.is_paused(), 30)
            lt.run(llm.resume_generation(), 30)
            return
        time.sleep(WATCH_S)
        assert not any(c.done() for c in calls), "a pause call returned: no livelock"
        v0, v1 = last(0), last(1)
        assert v0["pending_pause"] and not v1["pending_pause"], (v0, v1)
        assert v0["engines_running"] and v1["engines_running"], (v0, v1)
        steps = {
            r: sum(1 for x in rr if x.get("ev") == "step") for r, rr in probe.read_events(events).items()
        }
        time.sleep(2.0)
        later = {
            r: sum(1 for x in rr if x.get("ev") == "step") for r, rr in probe.read_events(events).items()
        }
        assert all(later[r] > steps[r] for r in (0, 1)), (steps, later)  # dummy batches, forever
    finally:
        shutdown_async_llm(llm, lt)
        lt.close()
