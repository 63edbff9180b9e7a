"""The compiler behind ``weightsync repro vllm-0.32 --engine vllm`` (:mod:`weightsync.schedule`; no engine is
started: the model only).

- The model's shortest vllm-0.32 counterexample compiles, from its labels and the states the successor
  function gives along them, into driver actions: the ADD and FIRST_REQ held, the pause and resume
  fanned out, each receipt a release of the named message (START_DP_WAVE through the engine's probe),
  and the expected vLLM variables (``current_wave``, ``ignore_start_dp_wave``...) taken from the model.
- Under the fix (vllm-0.32-epoch) the same labels stop being edges at the step where rank 0 would step
  alone, and the rows that differ before it are the fix's: the resume barrier re-bases the wave, so the
  late START_DP_WAVE is dropped.
- A label that is not an edge is refused with its index.
"""

from __future__ import annotations

import pytest

from weightsync.model.check import build_model
from weightsync.schedule import compile_schedule, fix_divergence, model_counterexample


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
