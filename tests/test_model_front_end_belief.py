"""Property ``front_end_belief`` (issue 24, item 1): vLLM 0.32's front-end sets ``engines_running`` when it
forwards a FIRST_REQ (``v1/engine/core_client.py:1540-1549``) and its coordinator publishes nothing for a
FIRST_REQ it takes while idle (``v1/engine/coordinator.py:363-375``), so after a late request during a pause
the front-end believes paused, idle engines running until the coordinator's 5 s poll timeout. The fix
(``front_end_latches=False``, patch 0004) leaves the belief to the coordinator's stats."""

from __future__ import annotations

from weightsync.model.check import build_model, check, check_mode
from weightsync.spec.front_end import FrontEvent, FrontState, front_end_table
from weightsync.spec.rank import VARIANTS
from weightsync.spec.states import PauseMode


def test_vllm_032_front_end_believes_paused_idle_engines_running_after_a_late_request() -> None:
    out = check("vllm-0.32", 2, mode="abort", counterexample_of="front_end_belief", workers=1)
    assert out["properties"]["front_end_belief"] == "violated"
    cx = out["counterexample"]
    assert cx["property"] == "front_end_belief" and cx["mode"] == "abort"
    steps = cx["steps"]
    assert len(steps) == 14  # 13 steps, then the violation
    text = "\n".join(steps)
    # the pause completes, then the late request's FIRST_REQ wakes no paused rank and publishes nothing
    order = ["pause(abort)", "complete dp_sync", "sends ADD(req=0", "receives FIRST_REQ", "START_DP_WAVE"]
    at = [text.index(s) for s in order]
    assert at == sorted(at), text
    assert "wave_dropped" in steps[-2] and "front_end_belief violated" in steps[-1]
    assert out["violations"]["abort"]["front_end_belief"] == 14


def test_the_fixes_do_not_latch_and_keep_the_belief_right_in_every_mode() -> None:
    for name in ("vllm-0.32-epoch", "two-phase-epoch"):
        assert not VARIANTS[name].front_end_latches, name
    assert VARIANTS["vllm-0.32"].front_end_latches
    for mode in PauseMode:
        fixed = build_model("vllm-0.32-epoch", 2, mode)
        assert check_mode(fixed, progress=False).properties["front_end_belief"] == "holds", mode
    # the same model with vLLM 0.32's front-end (the latch): the belief goes stale again
    shipped = build_model("vllm-0.32-epoch", 2, PauseMode.ABORT)
    shipped.front_table = front_end_table(latches=True)
    r = check_mode(shipped, progress=False)
    assert r.properties["front_end_belief"] == "violated"
    assert r.counterexample is not None and r.counterexample["property"] == "front_end_belief"


def test_without_the_latch_only_the_first_req_row_changes() -> None:
    shipped, fixed = front_end_table(), front_end_table(latches=False)
    assert set(shipped) == set(fixed)
    for key in shipped:
        if key == (FrontState.IDLE, FrontEvent.SEND_REQUEST):
            (h0, l0), (h1, l1) = shipped[key], fixed[key]
            assert h0 == h1  # the gate's hold row
            assert l0.target is FrontState.RUNNING and l1.target is FrontState.IDLE
            assert l0.effects == l1.effects == ("send_add", "send_first_req")
        else:
            assert shipped[key] == fixed[key]
