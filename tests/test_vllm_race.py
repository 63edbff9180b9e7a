"""The resume-time race on a real vLLM 0.32 DP deployment, and real vLLM traces replayed by the model.

Each test starts a real ``AsyncLLM(data_parallel_size=2)`` of a tiny Mixtral (MoE: lockstep
``DPEngineCoreProc`` ranks) on CPU, 50-70 s on this machine, so they are ``slow``; ``.ci/run`` runs the
two marked ``ci`` once (``make test-slow-ci``: the race as shipped and the plugin's default fix), ``make
test-slow`` all of them.

- ``weightsync repro vllm-0.32 --engine vllm``: vLLM as shipped follows every step of the model's
  shortest counterexample, rank 0 ends inside its DP step and rank 1 idle, and rank 0's collective raises
  gloo's timeout (shortened to 30 s; the plugin's default fix is turned off for that run); with ``--fix
  epoch`` (the patch grafted into the engines by the plugin's default, no variable set) the engines follow the fix's model up to the step it makes impossible, that step does not
  happen, and after every held message is released every request finishes.
- ``weightsync repro vllm-0.32 --engine vllm --mode abort --property front_end_belief``: the late request's
  counterexample followed step by step, then vLLM's front-end believing paused, idle engines running.
- ``weightsync repro vllm-0.32 --engine vllm --mode wait --property wait_drains``: a request added just before
  a wait-mode pause, still queued when the pause returns.
- ``weightsync record --engine vllm --cycles 20``: 20 pause / weight round / resume cycles with random
  traffic; ``weightsync replay --variant vllm-0.32`` accepts the engines' trace (every recorded event an
  edge of the table, vLLM's variables equal to the table's after each, collective outcomes equal to the
  model's arithmetic).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_util import require_vllm

require_vllm()

from weightsync.impl.trace_replay import replay_trace  # noqa: E402
from weightsync.model.replay import TraceChecker  # noqa: E402
from weightsync.repro.vllm.run import run_vllm_repro  # noqa: E402
from weightsync.vllm_tools.fix import ENV_FIX, OFF  # noqa: E402
from weightsync.vllm_tools.trace import record_cycles  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.ci
def test_the_race_reproduces_on_vllm_as_shipped() -> None:
    res = run_vllm_repro("vllm-0.32", timeout_s=30)
    d = res.as_dict()
    print(
        json.dumps(
            {k: d[k] for k in ("result", "followed_steps", "diverged_at", "ranks", "seconds", "reason")}
        )
    )
    assert res.fix == OFF  # the plugin's default fix was turned off for this run
    assert res.result == "reproduced", (res.reason, res.steps[-3:], res.events)
    assert res.diverged_at is None and res.followed_steps == len(res.steps) == 17
    assert res.ranks == {"0": "dp_sync", "1": ""}
    assert "timed out" in res.errors["0"].lower()
    assert set(res.errors) == {"0"}


def test_the_front_ends_stale_belief_reproduces_on_vllm_as_shipped() -> None:
    """Issue 24: the model's shortest ``front_end_belief`` counterexample (abort pause, then a late request
    whose FIRST_REQ the paused ranks drop) followed step by step on vLLM; its front-end then reports the
    engines running, with both ranks paused and idle, until the coordinator's periodic publish (at most its
    5 s poll timeout, ``v1/engine/coordinator.py:264-290``; the driver sends the ADD right after one)."""
    res = run_vllm_repro("vllm-0.32", mode="abort", timeout_s=30, of="front_end_belief")
    print(json.dumps({k: getattr(res, k) for k in ("result", "followed_steps", "belief_stale_s", "reason")}))
    assert res.result == "reproduced", (res.reason, res.steps[-3:], res.events)
    assert res.property == "front_end_belief" and res.fix == OFF
    assert res.diverged_at is None and res.followed_steps == len(res.steps) == 13
    assert res.belief_stale_s is not None and 0.0 < res.belief_stale_s <= 6.0
    assert res.ranks == {"0": "", "1": ""} and not res.errors


def test_the_wait_pause_leaves_a_queued_request_on_vllm_as_shipped() -> None:
    """Issue 24: the model's shortest ``wait_drains`` counterexample (an ADD, then pause(wait) on the same
    rank before it steps: the probe holds its busy loop after the ADD until the pause is in) followed step by
    step on vLLM; the pause returns, the request produces nothing while paused and finishes after resume."""
    res = run_vllm_repro("vllm-0.32", mode="wait", timeout_s=30, of="wait_drains")
    print(json.dumps({k: getattr(res, k) for k in ("result", "followed_steps", "reason")}))
    assert res.result == "reproduced", (res.reason, res.steps[-3:], res.events)
    assert res.property == "wait_drains" and res.fix == OFF
    assert res.diverged_at is None and res.followed_steps == len(res.steps) == 8
    assert res.requests_finished == {"req-0": 4} and not res.errors


def test_the_fix_makes_the_same_schedule_complete() -> None:
    res = run_vllm_repro("vllm-0.32", fix="epoch", timeout_s=30)
    assert res.result == "completed", (res.reason, res.steps[-3:], res.events)
    assert res.impossible_step == res.diverged_at == 17 and res.followed_steps == 16
    assert any("[barrier_idle]" in r["fix_row"] for r in res.fix_rows)
    assert res.requests_finished and all(n > 0 for n in res.requests_finished.values())
    assert res.ranks == {"0": "", "1": ""} and not res.errors


def test_twenty_real_cycles_replay_on_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM as shipped (the plugin's fix turned off) follows the ``vllm-0.32`` model, cycle after cycle."""
    monkeypatch.setenv(ENV_FIX, OFF)
    out = tmp_path / "vllm-20.jsonl"
    summary = record_cycles(out, cycles=20, seed=1)
    assert summary["variant"] == "vllm-0.32"
    assert summary["versions"][-1] == "step-20" and summary["requests"] > 0
    checker = TraceChecker()
    res = replay_trace(out, checker, variant="vllm-0.32")
    assert res.ok, res.divergence
    assert res.collectives > 40 and checker.outcomes_checked > 20 and checker.has_work_checked > 40


@pytest.mark.ci
def test_the_fix_is_on_by_default_and_follows_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the plugin installed and no WEIGHTSYNC_VLLM_FIX set, the engines run the resume-epoch fix (issue
    22): their trace follows ``vllm-0.32-epoch`` and not ``vllm-0.32`` (the resume barrier adopts MAX + 1)."""
    monkeypatch.delenv(ENV_FIX, raising=False)
    out = tmp_path / "vllm-default.jsonl"
    summary = record_cycles(out, cycles=6, seed=1)
    assert summary["variant"] == "vllm-0.32-epoch" and summary["versions"][-1] == "step-6"
    assert replay_trace(out, TraceChecker(), variant="vllm-0.32-epoch").ok
    shipped = replay_trace(out, TraceChecker(), variant="vllm-0.32")
    assert not shipped.ok and shipped.divergence is not None
    assert "current_wave" in shipped.divergence.reason, shipped.divergence
