"""The compiler behind ``weightsync repro`` on both engines (:mod:`weightsync.repro.schedule`; no engine is started:
the model only). First for ``--engine vllm``:

- The model's shortest vllm-0.32 counterexample compiles, from its labels and the states the successor
  function gives along them, into driver actions: the ADD and FIRST_REQ held, the pause and resume
  fanned out, each receipt a release of the named message (START_DP_WAVE through the engine's probe),
  and the expected vLLM variables (``current_wave``, ``ignore_start_dp_wave``...) taken from the model.
- Under the fix (vllm-0.32-epoch) the same labels stop being edges at the step where rank 0 would step
  alone, and the rows that differ before it are the fix's: the resume barrier re-bases the wave, so the
  late START_DP_WAVE is dropped.
- A label that is not an edge is refused with its index.

Then for the reference engine (its runs are in ``tests/test_engine_repro.py``): a fix's schedule is compiled
on the fix's model up to the step it makes impossible and ends with that step on the buggy model's terms;
labels no driver drives (injected failures, timeouts) and channels the engines do not have are refused.
"""

from __future__ import annotations

import pytest

from weightsync.model.check import build_model
from weightsync.repro.fixed import fix_divergence, fix_schedule
from weightsync.repro.schedule import channels, compile_schedule, fired_events, model_counterexample


@pytest.fixture(scope="module")
def cx() -> dict[str, object]:
    return model_counterexample("vllm-0.32", "keep")


def test_the_counterexample_compiles_to_held_and_released_messages(cx: dict[str, object]) -> None:
    labels = [list(x) for x in cx["labels"]]  # type: ignore[attr-defined]
    actions = compile_schedule(build_model("vllm-0.32", 2, "keep"), labels, list(cx["steps"]))  # type: ignore[call-overload]
    kinds = [(a.kind, a.rank, a.arg) for a in actions]
    assert kinds[0] == ("add", 0, {"first_req": True})
    assert ("call", -1, "pause") in kinds and ("call", -1, "resume") in kinds
    releases = [a for a in actions if a.kind == "release"]
    assert [a.rank for a in releases] == [1, 0]  # rank 1 drops the wave while paused, rank 0 takes it after
    late = releases[-1]
    assert late.expect == [(0, "START_DP_WAVE", {"wave": 1, "held": False})]
    assert late.model_vars[0]["engines_running"] is True and late.model_vars[0]["current_wave"] == 1
    first = releases[0]
    assert first.model_vars[1]["ignore_start_dp_wave"] is True  # dropped: phase 2 reached
    last = actions[-1]
    assert (last.kind, last.rank) == ("observe", 0)
    assert last.expect == [(0, "step", {"has_work": False, "sync": True})]
    coord = [a for a in actions if a.kind == "coord"]
    assert [a.arg for a in coord] == ["wave_complete", "FIRST_REQ"]
    assert coord[1].expect == [
        (0, "START_DP_WAVE", {"wave": 1, "held": True}),
        (1, "START_DP_WAVE", {"wave": 1, "held": True}),
    ]


def test_the_fix_makes_the_lone_step_impossible_and_names_its_rows(cx: dict[str, object]) -> None:
    labels = [list(x) for x in cx["labels"]]  # type: ignore[attr-defined]
    div = fix_divergence(
        build_model("vllm-0.32", 2, "keep"), build_model("vllm-0.32-epoch", 2, "keep"), labels
    )
    assert div["impossible_step"] == len(labels)  # the last step: rank 0 stepping alone
    rows = div["fix_rows"]
    assert rows and rows[0]["label"] == ["done", "resume_barrier"]
    assert rows[0]["buggy"]["current_wave"] == 1 and rows[0]["fix"]["current_wave"] == 2
    assert "[barrier_idle]" in rows[0]["fix_row"]
    dropped = [r for r in rows if r["label"][0] == "recv"]
    assert (
        dropped and dropped[-1]["fix"]["engines_running"] is False and dropped[-1]["buggy"]["engines_running"]
    )


def test_a_label_that_is_no_edge_is_refused() -> None:
    with pytest.raises(ValueError, match=r"label 1 \['step', 0\] is not an edge of vllm-0.32"):
        compile_schedule(build_model("vllm-0.32", 2, "keep"), [["step", 0]], [])


# ------------------------------------------------------------------- the same compiler, reference engine
def test_a_fix_schedule_ends_with_the_step_the_fix_makes_impossible() -> None:
    """two-phase's labels on two-phase-epoch: steps 1-19 on the fix's model (its rows and its text), then
    step 20 on the buggy model's terms (rank 0 stepping alone into dp_step), which the driver must not see."""
    cx = model_counterexample("two-phase", "keep")
    labels = [list(x) for x in cx["labels"]]
    buggy, fixed = build_model("two-phase", 2, "keep"), build_model("two-phase-epoch", 2, "keep")
    actions, div = fix_schedule(buggy, fixed, labels, list(cx["steps"]), "reference")
    assert div["impossible_step"] == len(labels) == len(actions) == 20
    late = actions[18]
    assert [f[:3] for f in late.fired] == [(0, "START_DP_WAVE", "wave_dropped")]  # the fix's row
    assert "wave_dropped" in late.text and "wave_for_me_not_ignoring" in cx["steps"][18]
    assert late.fired[0][3]["current_wave"] == 2 and late.fired[0][3]["engines_running"] is False
    barrier = actions[17]
    assert {f[2] for f in barrier.fired} == {"barrier_idle"}
    last = actions[-1]
    assert (last.kind, last.rank, last.text) == ("step", 0, cx["steps"][19])
    assert [f[:3] for f in last.fired] == [(0, "step", "step_plain")] and last.blocked_after[0] == "dp_step"


def test_the_reference_compiler_refuses_what_no_driver_drives() -> None:
    model = build_model("two-phase", 2, "keep")
    s = model.initial()
    with pytest.raises(ValueError, match="injected failures are not driven"):
        fired_events(model, s, ["done", "weight_broadcast", "fail"], s)
    with pytest.raises(ValueError, match="is not driven on real processes"):
        fired_events(model, s, ["timeout", 0, "weight_broadcast"], s)
    with pytest.raises(ValueError, match="one FIFO per socket"):
        channels(build_model("two-phase", 2, "keep", channels="ordered"), s)
    with pytest.raises(ValueError, match="engine 'sglang'"):
        compile_schedule(model, [["send", 0]], [], "sglang")
