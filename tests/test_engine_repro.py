"""``weightsync repro`` on the reference engine (real processes, gloo on 127.0.0.1): the model's counterexample,
compiled from its labels and states by :mod:`weightsync.repro.schedule`, drives two DP ranks step by step, and the
run is judged against the model.

- ``two-phase`` is ``"reproduced"``: every model step followed (each row the step fires is the rank's next
  transition, same guard, same variables; every held message where the model has it), and rank 0 ends in
  ``dp_step`` until the collective timeout while rank 1 stays outside any collective, as the model's final
  state has them.
- ``two-phase-epoch`` is ``"completed"``: the same labels, on the fix's model, until step 20 (rank 0 stepping
  alone) becomes impossible; the fix's ``barrier_idle`` row named; then every request finishes.
- The oracle's negative side, without engines: an end where another rank is blocked, or in another
  collective, or that never timed out, or a rank that moved on, is rejected; a transition with another
  guard or other variables than the model's row is a step not followed.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

import pytest

from weightsync.cli import main
from weightsync.impl.engine.messages import (
    AddMsg,
    EngineFailure,
    FirstReq,
    Request,
    StartDPWave,
    StartWave,
    TransitionRecord,
    UtilityCall,
    WaveComplete,
)
from weightsync.impl.models.sampling import SamplingParams
from weightsync.model.check import build_model
from weightsync.repro.driver import TIMEOUT, ScheduleDriver, wire
from weightsync.repro.engine import BUGGY, end_check
from weightsync.repro.schedule import Action, FinalState, compile_schedule, final_state, model_counterexample
from weightsync.repro.schedule import wire as model_wire


@functools.cache
def counterexample(variant: str) -> dict[str, Any]:
    return model_counterexample(variant, "keep")


def _schedule(variant: str) -> tuple[list[Action], FinalState]:
    cx = counterexample(variant)
    labels = [list(x) for x in cx["labels"]]
    model = build_model(variant, 2, "keep")
    return compile_schedule(model, labels, list(cx["steps"]), "reference"), final_state(model, labels)


# ---------------------------------------------------------------------------------- the compiler (no engine)
def test_two_phase_compiles_for_the_reference_engine_from_labels_and_states() -> None:
    actions, end = _schedule("two-phase")
    assert [a.kind for a in actions] == [
        *("add", "call", "release", "step", "release", "step", "observe", "step", "step", "observe"),
        *("coord", "coord", "release", "refresh", "call", "release", "release", "observe", "release", "step"),
    ]
    late = actions[18]  # rank 0 takes the wave rank 1 dropped (step 13)
    assert (late.channel, late.message) == ((0, "wave"), ("START_DP_WAVE", 1, -1))
    assert [f[:3] for f in late.fired] == [(0, "START_DP_WAVE", "wave_for_me_not_ignoring")]
    assert late.fired[0][3]["engines_running"] is True and late.fired[0][3]["current_wave"] == 1
    assert [f[:3] for f in actions[12].fired] == [(1, "START_DP_WAVE", "wave_dropped")]
    assert actions[11].channel == (-1, "coord") and actions[11].message == ("FIRST_REQ", 0, 0)
    assert actions[11].channels[(1, "wave")] == [("START_DP_WAVE", 1, -1)]
    assert end.blocked == {0: "dp_step", 1: ""} and end.terminal and end.trainer == ""
    assert end.channels == {(0, "front"): [("ADD", 0, 0)]}  # the request never reaches rank 0


def test_engine_messages_and_model_messages_compare_in_one_form() -> None:
    req = Request("req-0", (1, 2, 3), SamplingParams())
    pairs = [
        (AddMsg(req, 1), ("ADD", 0, 1)),
        (StartDPWave(1, -1), ("W", 1, -1)),
        (UtilityCall(7, "pause", {"mode": "keep"}), ("U", "pause", 0)),
        (FirstReq(0, 0), ("FIRST_REQ", 0, 0)),
        (WaveComplete(3), ("wave_complete", 3, 0)),
        (StartWave(2, 1), ("start_wave", 2, 1)),
    ]
    for msg, m in pairs:
        assert wire(msg, {"req-0": 0}) == model_wire(m), msg
    assert wire(StartDPWave(1, 0), {}) != model_wire(("W", 1, -1))


# ------------------------------------------------------------------------------- the oracle (no engine)
def _rec(
    rank: int, event: str, guard: str, after: dict[str, Any], effects: tuple[str, ...] = ("x",)
) -> TransitionRecord:
    return TransitionRecord(rank, 0, event, {}, dict(after), dict(after), guard, effects, "", 0, 0.0)


def _timeout(rank: int, coll: str) -> EngineFailure:
    err = f"TransferTimeoutError: {coll}#3: timed out after 5.0 s waiting for rank(s) {1 - rank}"
    return EngineFailure(rank, f"{coll}#3", err, "TransferTimeoutError", coll, 3, (1 - rank,), {}, "running")


def test_end_check_accepts_only_the_models_final_state() -> None:
    _, end = _schedule("two-phase")
    v0, v1 = end.vars[0], end.vars[1]
    recs = {0: [_rec(0, "step", "step_plain", v0)], 1: [_rec(1, "resume_barrier_done", "always", v1)]}
    consumed = {0: 1, 1: 1}
    assert end_check(recs, consumed, {0: _timeout(0, "dp_step")}, end) == ({"0": "dp_step", "1": ""}, [])

    # another rank blocked: rank 1 in dp_step, rank 0 outside
    swapped = {0: [_rec(0, "step", "step_plain", v1)], 1: [_rec(1, "step", "step_plain", v0)]}
    ranks, bad = end_check(swapped, consumed, {1: _timeout(1, "dp_step")}, end)
    assert ranks == {"0": "", "1": "dp_step"}
    assert any("rank 0 ended in no collective" in b for b in bad)
    assert any("rank 1 ended in dp_step, the model's final state has none" in b for b in bad)
    assert any("rank 1 failed" in b for b in bad) and any(
        "rank 0 never timed out of dp_step" in b for b in bad
    )

    # the wrong collective: rank 0 waits in dp_sync
    wrong = {0: [_rec(0, "step", "step_sync", {**v0, "collective": "dp_sync"})], 1: recs[1]}
    _, bad = end_check(wrong, consumed, {0: _timeout(0, "dp_sync")}, end)
    assert any("rank 0 ended in dp_sync, the model's final state has dp_step" in b for b in bad)

    # blocked where the model says, but it never timed out (or failed otherwise)
    _, bad = end_check(recs, consumed, {}, end)
    assert bad == ["rank 0 never timed out of dp_step (the model has it blocked there for good)"]
    other = EngineFailure(0, "loop", "RuntimeError: boom", "RuntimeError", "", -1, (), {}, "running")
    _, bad = end_check(recs, consumed, {0: other}, end)
    assert bad and "not a timeout in dp_step" in bad[0]

    # a weight-transfer collective's timeout is a table event: the next transition carries it
    _, end2 = _schedule("front-end-pause")  # rank 0 in dp_step, rank 1 in weight_broadcast
    w0, w1 = end2.vars[0], end2.vars[1]
    out = _rec(1, "transfer_failed", "always", {**w1, "state": "failed", "collective": ""})
    for err, ok in (
        (f"{TIMEOUT}: update_weights: timed out after 5.0 s", True),
        ("WireMismatchError: x", False),
    ):
        out.args["error"] = err
        recs2 = {0: [_rec(0, "step", "step_plain", w0)], 1: [_rec(1, "update_weights", "always", w1), out]}
        ranks, bad = end_check(recs2, consumed, {0: _timeout(0, "dp_step")}, end2)
        assert ranks == {"0": "dp_step", "1": "weight_broadcast"}
        assert bad == ([] if ok else ["rank 1 moved on after the schedule: transfer_failed [always]"]), err

    # the idle rank moved on after the schedule, or ended with other variables
    moved = {0: recs[0], 1: [*recs[1], _rec(1, "step", "step_plain", v1)]}
    _, bad = end_check(moved, consumed, {0: _timeout(0, "dp_step")}, end)
    assert bad == ["rank 1 moved on after the schedule: step [step_plain]"]
    later = {0: recs[0], 1: [_rec(1, "resume_barrier_done", "always", {**v1, "current_wave": 2})]}
    _, bad = end_check(later, consumed, {0: _timeout(0, "dp_step")}, end)
    assert bad == ["rank 1's variables differ from the model's final state: current_wave: engine 2, model 1"]


class _Recorded:
    """The parts of a DPEngineClient the step oracle reads, holding given transitions (no processes)."""

    dp_size = 2

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.transitions: list[TransitionRecord] = []
        self.failures: dict[int, EngineFailure] = {}
        self.rank_vars: list[dict[str, Any]] = [{}, {}]
        self.held: dict[tuple[int, str], Any] = {}

    def set_step_gate(self, rank: int, value: int) -> None:
        pass

    def wait_for(self, pred: Any, timeout: float, what: str = "") -> None:
        if not pred():
            raise TimeoutError(what)


def _oracle(records: list[TransitionRecord]) -> ScheduleDriver:
    client = _Recorded()
    run = ScheduleDriver(
        client, "keep", True, 2, {}, lambda: None, 5.0, 0.1, time.monotonic() + 10, lambda _m: None
    )  # type: ignore[arg-type]
    client.transitions.extend(records)
    return run


def test_a_transition_other_than_the_models_row_is_not_followed() -> None:
    actions, _ = _schedule("two-phase")
    drop = actions[12]  # rank 1 receives START_DP_WAVE(1) while verified: the model drops it
    after = drop.vars_after[1]
    idle = _rec(1, "step", "idle", after, effects=())
    assert _oracle([idle, _rec(1, "START_DP_WAVE", "wave_dropped", after)]).expect_fired(drop) == ""
    why = _oracle([_rec(1, "START_DP_WAVE", "wave_for_me_not_ignoring", after)]).expect_fired(drop)
    assert (
        why == "rank 1 fired START_DP_WAVE [wave_for_me_not_ignoring], the model START_DP_WAVE [wave_dropped]"
    )
    why = _oracle(
        [_rec(1, "START_DP_WAVE", "wave_dropped", {**after, "engines_running": True})]
    ).expect_fired(drop)
    assert why == "rank 1 after START_DP_WAVE [wave_dropped]: engines_running: engine True, model False"
    assert "rank 1 fired no START_DP_WAVE [wave_dropped]" in _oracle(
        [_rec(0, "ADD", "x", after)]
    ).expect_fired(drop)


# --------------------------------------------------------------------------- real processes, default suite
def _repro(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc = main(["repro", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.timeout(180)
def test_two_phase_is_reproduced_where_the_model_ends(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _repro(capsys, "two-phase")
    assert rc == 0 and out["result"] == "reproduced", (
        out["reason"],
        out["steps"][-2:],
        out["events"],
        out["errors"],
    )
    n = len(counterexample("two-phase")["labels"])
    assert out["engine"] == "reference" and out["fix"] is None and out["schedule"] == "two-phase"
    assert out["diverged_at"] is None and out["followed_steps"] == n and len(out["steps"]) == n
    assert all(s["followed"] for s in out["steps"])
    assert out["ranks"] == out["expected_ranks"] == {"0": "dp_step", "1": ""}
    assert "dp_step" in out["errors"]["0"] and "timed out" in out["errors"]["0"] and "1" not in out["errors"]
    assert out["property"] == "no_one_sided_collective" and out["impossible_step"] is None


@pytest.mark.timeout(180)
def test_two_phase_epoch_completes_where_the_fix_makes_the_schedule_impossible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out = _repro(capsys, "two-phase-epoch")
    assert rc == 0 and out["result"] == "completed", (
        out["reason"],
        out["steps"][-2:],
        out["events"],
        out["errors"],
    )
    n = len(counterexample("two-phase")["labels"])
    assert out["fix"] == "two-phase-epoch" and out["schedule"] == "two-phase"
    assert out["impossible_step"] == out["diverged_at"] == n  # rank 0 stepping alone
    assert out["followed_steps"] == n - 1 and out["steps"][-1]["followed"] is False
    rows = {r["fix_row"] for r in out["fix_rows"]}
    assert "two-phase-epoch: resuming --resume_barrier_done--> [barrier_idle]" in rows
    assert f"step {n} is impossible under the fix" in out["reason"] and "[barrier_idle]" in out["reason"]
    assert out["requests_finished"] and all(v == 2 for v in out["requests_finished"].values())
    assert out["ranks"] == {"0": "", "1": ""} and out["errors"] == {}


# ------------------------------------------------------------------------------------------------ slow
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", [v for v in BUGGY if v != "two-phase"])
def test_every_buggy_variant_is_reproduced(capsys: pytest.CaptureFixture[str], variant: str) -> None:
    rc, out = _repro(capsys, variant)
    assert rc == 0 and out["result"] == "reproduced" and out["diverged_at"] is None, out
    _, end = _schedule(variant)
    assert out["ranks"] == {str(r): k for r, k in end.blocked.items()} and out["trainer"] == end.trainer


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", [v for v in BUGGY if v != "two-phase"])
def test_two_phase_epoch_completes_every_buggy_schedule(
    capsys: pytest.CaptureFixture[str], schedule: str
) -> None:
    rc, out = _repro(capsys, "two-phase-epoch", "--schedule", schedule)
    assert rc == 0 and out["result"] == "completed" and out["schedule"] == schedule, out
    assert all(v > 0 for v in out["requests_finished"].values())
