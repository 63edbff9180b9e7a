"""Issue 24, item 4: a real MoE DP=2 ``AsyncLLM`` (vLLM 0.32, tiny Mixtral, CPU) driven through each pause
mode with requests in flight (one generating, one added just before the pause), a late request during the
pause, a weightsync round between pause and resume, and the resume. After every step the test compares what
vLLM reports with what the model of the variant the engines follow allows, and at the end the model replays
the probe's whole trace (every engine event an edge of the table, vLLM's per-rank variables equal to the
table's after each). Run without the fix (``vllm-0.32``) and with it (``vllm-0.32-epoch``, the plugin's
default).

What "allows" means, step by step, from the spec (not per fix by hand):

- after ``pause_generation``: ``is_paused()``, and each rank's PauseState is ``PAUSE_STATE_OF_MODE[mode]``;
  the generating request ended with a reason in ``IN_FLIGHT_FINISH[mode]`` where the mode finishes it
  before the pause returns (abort aborts it, wait drains it) and made no progress under keep; the request
  added just before the pause is finished where the variant's table drains queued requests
  (``admit_waiting``) and the mode drains before returning (``DRAINS_BEFORE_RETURN``), and may be either
  where it does not (vLLM 0.32's race);
- during the pause: the late request produces nothing; the front-end's belief is False within 1 s where the
  variant's front-end does not latch (``front_end_latches``), and may be stale where it does;
- after the round and the resume: ``is_paused()`` is False, vLLM's ``get_weight_version()`` is the round's,
  every request the pause did not abort finishes with its full length.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

require_vllm()

from weightsync.impl.trace_replay import replay_trace  # noqa: E402
from weightsync.model.replay import TraceChecker  # noqa: E402
from weightsync.spec.rank import VARIANTS  # noqa: E402
from weightsync.spec.states import (  # noqa: E402
    DRAINS_BEFORE_RETURN,
    IN_FLIGHT_FINISH,
    PAUSE_STATE_OF_MODE,
    PauseMode,
    PauseState,
)
from weightsync.vllm_tools.fix import ENV_FIX, OFF, VARIANT  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LONG, SHORT = 40, 4
PROMPT = {"prompt_token_ids": [1, 5, 6, 7]}


class _Run:
    """One engine, its trainer and its request outputs."""

    def __init__(self, tmp: Path) -> None:
        from weightsync.vllm.clients import AsyncLLMWeightSyncClient
        from weightsync.vllm_tools import probe
        from weightsync.vllm_tools.models import build_tiny_mixtral
        from weightsync.vllm_tools.serving import LoopThread, connect_trainer, start_async_llm

        self.events = tmp / "events"
        self.hf = build_tiny_mixtral(tmp / "tiny-mixtral")
        import os

        os.environ[probe.ENV_EVENTS] = str(self.events)
        self.lt = LoopThread("vllm-conformance-loop")
        try:
            self.llm, _ = start_async_llm(self.lt, tmp / "tiny-mixtral", dp=2)
        finally:
            os.environ.pop(probe.ENV_EVENTS, None)
        client = AsyncLLMWeightSyncClient(self.llm, self.lt.loop, timeout_s=120)
        self.trainer = connect_trainer(
            self.llm, self.hf, client=client, packed_buffer_size_bytes=96 << 10, timeout_s=60
        )
        self.outputs: dict[str, list[Any]] = {}

    def request(self, rid: str, rank: int, max_tokens: int) -> Any:
        """Start a greedy request on DP rank ``rank``; its outputs collect in ``self.outputs[rid]``."""
        from vllm import SamplingParams

        self.outputs[rid] = []

        async def go() -> None:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in self.llm.generate(PROMPT, sp, rid, data_parallel_rank=rank):
                self.outputs[rid].append(out)

        return self.lt.spawn(go())

    def tokens(self, rid: str) -> int:
        outs = self.outputs[rid]
        return len(outs[-1].outputs[0].token_ids) if outs else 0

    def finish(self, rid: str) -> str | None:
        outs = self.outputs[rid]
        return str(outs[-1].outputs[0].finish_reason) if outs and outs[-1].finished else None

    def pause_states(self) -> dict[int, int]:
        from weightsync.vllm_tools.probe import read_events

        return {r: int(rr[-1]["vllm"]["pause_state"]) for r, rr in read_events(self.events).items()}

    def close(self) -> None:
        from weightsync.vllm_tools.serving import shutdown_async_llm

        self.trainer.shutdown()
        shutdown_async_llm(self.llm, self.lt)
        self.lt.close()


def _until(pred: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _cycle(run: _Run, variant: str, mode: PauseMode, k: int) -> None:
    from weightsync.vllm_tools.models import checkpoint_state, perturbed_state

    v = VARIANTS[variant]
    drains_queued = any("admit_waiting" in tr.effects for trs in v.table.values() for tr in trs)
    a, b, late = f"{mode}-gen", f"{mode}-added", f"{mode}-late"
    futs = [run.request(a, 0, LONG)]
    assert _until(lambda: run.tokens(a) > 0, 60), "the generating request produced nothing"
    client = run.llm.engine_core

    async def add_then_pause() -> Any:  # add_request returns once the ADD is sent; the pause follows at once
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=SHORT, temperature=0.0, ignore_eos=True)
        collector = await run.llm.add_request(b, PROMPT, sp, data_parallel_rank=0)
        await run.llm.pause_generation(mode=mode.value)
        return collector

    collector = run.lt.run(add_then_pause(), 120)
    run.outputs[b] = []

    async def drain() -> None:
        while not (run.outputs[b] and run.outputs[b][-1].finished):
            run.outputs[b].append(await collector.get())

    futs.append(run.lt.spawn(drain()))
    time.sleep(0.2)  # outputs already produced reach the list
    # -- after the pause returned
    assert run.lt.run(run.llm.is_paused(), 30) is True
    want_state = int(PAUSE_STATE_OF_MODE[mode])
    assert _until(lambda: set(run.pause_states().values()) == {want_state}, 5), run.pause_states()
    done_a, done_b = run.finish(a), run.finish(b)
    if mode is PauseMode.KEEP:
        frozen = run.tokens(a)
        time.sleep(0.5)
        assert done_a is None and run.tokens(a) == frozen, "keep: the request advanced while paused"
        assert done_b is None
    else:  # abort finishes it at once, wait drains it: either way before the pause returns
        assert done_a in IN_FLIGHT_FINISH[mode], (mode, done_a)
        if mode is PauseMode.ABORT:
            assert done_b == "abort" or (done_b is None and run.tokens(b) == 0), done_b
    if mode in DRAINS_BEFORE_RETURN and drains_queued:
        assert done_b == "length", f"{variant}: the pause returned with {b} unfinished"
    # -- a late request during the pause
    futs.append(run.request(late, 0, SHORT))
    time.sleep(1.0)
    assert run.tokens(late) == 0, "the late request ran during the pause"
    if not v.front_end_latches:
        assert _until(lambda: not client.dp_engines_running(), 1.0), "belief still True 2 s after the add"
    # -- a weightsync round, then the resume
    run.hf.load_state_dict(perturbed_state(run.hf, seed=100 + k, scale=0.02))
    run.trainer.send_weights(checkpoint_state(run.hf), weight_version=f"conf-{k}")
    run.lt.run(run.llm.resume_generation(), 120)
    assert run.lt.run(run.llm.is_paused(), 30) is False
    assert _until(lambda: set(run.pause_states().values()) == {int(PauseState.UNPAUSED)}, 5)
    assert str(run.lt.run(run.llm.get_weight_version(), 60)) == f"conf-{k}"
    for f in futs:
        f.result(120)
    for rid, n in ((a, LONG), (b, SHORT), (late, SHORT)):
        reason = run.finish(rid)
        if reason == "abort":
            assert mode is PauseMode.ABORT and rid != late, (rid, reason)
        else:
            assert reason == "length" and run.tokens(rid) == n, (rid, reason, run.tokens(rid))


@pytest.mark.parametrize("fix", [OFF, pytest.param("epoch", marks=pytest.mark.ci)])
def test_every_pause_mode_conforms_to_the_model(
    fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightsync.vllm_tools import fix as fix_mod
    from weightsync.vllm_tools.probe import read_events
    from weightsync.vllm_tools.trace import to_replay_trace

    monkeypatch.setenv(ENV_FIX, fix)
    variant = VARIANT[fix]
    # vLLM loads plugins once per process, so this process's front-end (patch 0004) takes the setting here,
    # as the plugin would in a fresh one; the engines are fresh processes and load it themselves
    if fix == OFF:
        fix_mod.uninstall()
    else:
        fix_mod.install_from_env()
    run = _Run(tmp_path)
    try:
        for k, mode in enumerate((PauseMode.ABORT, PauseMode.WAIT, PauseMode.KEEP)):
            _cycle(run, variant, mode, k)
    finally:
        run.close()
    out = tmp_path / "conformance.jsonl"
    to_replay_trace(read_events(run.events), out, variant=variant)
    checker = TraceChecker()
    res = replay_trace(out, checker, variant=variant)
    assert res.ok, res.divergence
    assert checker.outcomes_checked > 0 and checker.has_work_checked > 0
