"""``weightsync repro`` on real processes (acceptance 2): the model's shortest counterexample of each buggy
variant, compiled into router steps, hangs the real engines in mismatched or one-sided collectives (caught
by the collective timeout); two-phase-epoch completes the same schedules."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from weightsync.cli import main
from weightsync.impl.engine.repro import BUGGY, compile_counterexample, repro
from weightsync.model.check import check

DP = ("dp_step", "dp_sync", "resume_barrier")


@functools.cache
def counterexample(variant: str) -> dict[str, Any]:
    cx = check(variant, 2, progress=False)["counterexample"]
    assert cx is not None
    return dict(cx)


# the final state of each model counterexample: what the real ranks must be blocked in
MODEL_FINAL = {
    "idle-fast-path": {0: "weight_broadcast", 1: "dp_step"},
    "front-end-pause": {0: "dp_step", 1: "weight_broadcast"},
    "ignore-wave": {0: "dp_step"},
    "two-phase": {0: "dp_step"},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", BUGGY)
def test_compile_every_counterexample(variant: str) -> None:
    cx = check(variant, 2, mode="abort", progress=False)["counterexample"]
    steps = compile_counterexample(cx)
    assert len(steps) <= len(cx["labels"])
    ops = {s[0] for s in steps}
    assert ops <= {"add", "deliver", "step", "done", "coord", "call", "fe", "send", "refresh"}
    # every model step but the controller's fan-out continuations maps to exactly one router step
    fans = [lab for lab in cx["labels"] if lab[0] == "fan"]
    assert len(steps) == len(cx["labels"]) - len(fans) + sum(1 for s in steps if s[0] == "call")


def _check_reproduced(variant: str, r: Any) -> None:
    d = r.as_dict()
    assert r.result == "reproduced", d
    assert r.source == "model" and r.diverged_at is None, d  # the real run followed every model step
    assert r.seconds < 60, d
    for rank, kind in MODEL_FINAL[variant].items():
        assert r.collectives[rank].split("#")[0] == kind, d


# one buggy variant in the default suite (the others, and every one through the CLI, are slow)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "variant", [v if v == "front-end-pause" else pytest.param(v, marks=pytest.mark.slow) for v in BUGGY]
)
def test_buggy_variant_deadlock_reproduced_from_the_model(variant: str) -> None:
    (r,) = repro(variant, {variant: counterexample(variant)})
    _check_reproduced(variant, r)


# the resume-time race (the schedule that was once flaky by hand) in the default suite, the others slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "schedule", [s if s == "two-phase" else pytest.param(s, marks=pytest.mark.slow) for s in BUGGY]
)
def test_two_phase_epoch_completes_the_model_schedule(schedule: str) -> None:
    (r,) = repro("two-phase-epoch", {schedule: counterexample(schedule)}, only=[schedule])
    assert r.result == "completed", r.as_dict()
    assert r.source == "model" and r.seconds < 60


@pytest.mark.timeout(120)
def test_cli_repro_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["repro", "idle-fast-path", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variant"] == "idle-fast-path" and out["result"] == "reproduced"
    assert set(out) >= {"variant", "result", "seconds", "ranks", "collectives", "schedule_source"}
    assert out["schedule_source"] == "model"
    assert out["counterexample"]["steps"] == counterexample("idle-fast-path")["steps"]
    assert {k: v.split("#")[0] for k, v in out["collectives"].items()} == {
        "0": "weight_broadcast",
        "1": "dp_step",
    }
    assert main(["repro", "no-such-variant", "--json"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_repro_two_phase_epoch_runs_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["repro", "two-phase-epoch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["result"] == "completed" and out["schedule_source"] == "model"
    assert [s["schedule"] for s in out["schedules"]] == list(BUGGY)
    assert all(s["result"] == "completed" for s in out["schedules"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hand_written_fallback_says_so() -> None:
    (r,) = repro("two-phase")  # no model counterexample given: the hand-written schedule
    assert r.source == "hand-written" and r.as_dict()["schedule_source"] == "hand-written"
    assert r.result == "reproduced", r.as_dict()
