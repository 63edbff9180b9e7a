"""``weightsync check --mode any`` (the controller picks the pause mode at each pause) and ``--repeat-pause``
(a second pause to every rank while the first is outstanding or after it returned, before the round):
issue 19, item 1. A model with one mode explores exactly the state space it did before either existed.
The two full explorations under ``--mode any`` (half a minute to a minute and a half on 2 cores) are
``slow`` and run in CI's second pass; ``proofs/`` holds the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync.model.check import build_model, check, check_mode
from weightsync.model.system import Bounds
from weightsync.model.system.state import ANY_MODE, ghost_base, ghost_replied, ghost_with_mode
from weightsync.spec.rank import get_variant
from weightsync.spec.rank_tables import Table
from weightsync.spec.states import PauseMode, RankEvent, RankState

ROOT = Path(__file__).resolve().parents[1]


def test_a_model_with_one_mode_is_unchanged() -> None:
    """Regression: the proofs' row, re-explored, has the same state and transition counts."""
    want = json.loads((ROOT / "proofs" / "two-phase-epoch__ordered__n2.json").read_text())
    got = check("two-phase-epoch", 2, channels="ordered", workers=1)
    assert (got["verdict"], got["states"], got["transitions"]) == (
        want["verdict"],
        want["states"],
        want["transitions"],
    )


def test_the_controller_picks_each_mode_and_the_message_carries_it() -> None:
    m = build_model("two-phase-epoch", 2, "any", bounds=Bounds(requests=0))
    assert m.mode is ANY_MODE and m.pause_modes == tuple(PauseMode)
    s0 = m.initial()
    fans = {lab: t for lab, t in m.successors(s0) if lab[0] == "fan"}
    assert set(fans) == {("fan", "pause", -1, mode.value) for mode in PauseMode}
    for lab, t in fans.items():
        assert {r.inq[m.f_ctrl][-1] for r in t.ranks} == {("U", "pause", 0, lab[3])}, lab


def test_a_ghost_names_its_pause_mode_only_under_any() -> None:
    assert ghost_with_mode(1, None) == 1 and ghost_with_mode(0, PauseMode.WAIT) == 0
    for mode in PauseMode:
        g = ghost_with_mode(1, mode)
        assert ghost_base(g) == 1 and ghost_base(ghost_replied(g)) == 2
        m = build_model("vllm-0.32-epoch", 2, "any")
        assert m.ghost_mode(g) is mode and m.ghost_mode(ghost_replied(g)) is mode
    with pytest.raises(ValueError, match="carries no mode"):
        build_model("vllm-0.32-epoch", 2, "any").ghost_mode(1)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("variant", ["two-phase-epoch", "vllm-0.32-epoch"])
def test_the_fixes_verify_when_each_pause_picks_its_mode(variant: str) -> None:
    out = check(variant, 2, mode="any", workers=1)
    assert out["verdict"] == "verified", out.get("counterexample")
    assert set(out["per_mode"]) == {"any"}


def _without_rows(variant: str, guard: str, states: tuple[RankState, ...]) -> Table:
    """``variant``'s table without its rows named ``guard`` at ``states`` (the table before a fix)."""
    return {
        (s, e): tuple(tr for tr in trs if not (tr.guard == guard and s in states))
        for (s, e), trs in get_variant(variant).table.items()
    }


def test_a_retried_wait_pause_livelocks_vllm_032_epoch_without_patch_0007() -> None:
    """The retry reaches rank 1 before the consensus round and rank 0 after it: without patch 0007's row
    (``pause_joins_consensus``) rank 0 sets pending_pause again, rank 1 never does, and ``sync_dp_state``
    (``config/parallel.py:850-875``) keeps both ranks stepping with no consensus: the pause never returns
    (reproduced on the real engines: ``tests/test_vllm_retried_pause.py``). With the row it verifies."""
    out = check("vllm-0.32-epoch", 2, mode="wait", bounds=Bounds(repeat_pause=True), workers=1)
    assert out["verdict"] == "verified", out.get("counterexample")
    before = _without_rows("vllm-0.32-epoch", "pause_joins_consensus", (RankState.PAUSING, RankState.PAUSED))
    model = build_model("vllm-0.32-epoch", 2, "wait", bounds=Bounds(repeat_pause=True), table=before)
    cx = check_mode(model).counterexample
    assert cx is not None and cx["property"] == "progress_pause" and len(cx["steps"]) == 12, cx
    text = "\n".join(cx["steps"])
    assert "fans out pause(wait) to every rank again (untracked) (a repeated pause" in text
    assert "complete dp_sync(sum_unfinished=1, sum_pending_pause=2)" in text
    assert "rank 0 receives pause(wait) (pause_must_drain: pausing->pausing)" in cx["steps"][10]


def test_a_repeated_pause_is_taken_in_two_phase_epoch_and_illegal_without_its_rows() -> None:
    """weightsync's own table takes a pause at a rank whose pause is in flight as the patches 0005-0007 make
    vLLM 0.32 take it (``spec/rank_tables.py`` ``_repeated_pause_rows``): the row verifies. Without those
    rows (the table before this change) the second pause is illegal at a paused rank: ``phase_bracketing``,
    5 steps."""
    bounds = Bounds(repeat_pause=True)
    out = check("two-phase-epoch", 2, mode="abort", bounds=bounds, workers=1)
    assert out["verdict"] == "verified", out.get("counterexample")
    table = get_variant("two-phase-epoch").table
    before = {
        k: trs
        for k, trs in table.items()
        if not (k[1] is RankEvent.PAUSE and k[0] in (RankState.PAUSING, RankState.PAUSED, RankState.VERIFIED))
    }
    assert len(before) == len(table) - 3
    cx = check_mode(build_model("two-phase-epoch", 2, "abort", bounds=bounds, table=before)).counterexample
    assert cx is not None and cx["property"] == "phase_bracketing" and len(cx["steps"]) == 5, cx
    assert "illegal in paused: protocol error" in cx["steps"][-2], cx["steps"]


def test_an_untracked_pause_never_answered_is_a_deadlock() -> None:
    """A legitimate end owes no reply (``Properties.is_end``): with the verified rank's reply to a repeated
    pause dropped, the retry never returns and the run ends in a deadlock of that call."""
    table = dict(get_variant("two-phase-epoch").table)
    (row,) = table[(RankState.VERIFIED, RankEvent.PAUSE)]
    table[(RankState.VERIFIED, RankEvent.PAUSE)] = (row._replace(effects=()),)
    bounds = Bounds(repeat_pause=True)
    model = build_model("two-phase-epoch", 2, "abort", bounds=bounds, table=table)
    cx = check_mode(model, stop_at_first=True).counterexample
    assert cx is not None and cx["property"] == "no_deadlock", cx
    assert "pause(abort) to every rank again (untracked)" in "\n".join(cx["steps"])


@pytest.mark.slow
@pytest.mark.ci
def test_keep_then_wait_drains_the_queue_only_with_the_keep_case_of_patch_0005() -> None:
    """Under ANY_MODE a wait that a rank takes up while its keep pause is in flight (PauseState PAUSED_ALL
    to PAUSED_NEW) is judged as a wait pause. Patch 0005 first recorded the queue only when the scheduler
    left UNPAUSED (the drain row at ``running`` alone), and a request queued before the keep stayed queued
    (``wait_drains``, 11 steps; the real engines showed it: the keep case of the series' test fails 3 of 3
    with that version). Recording it on entering PAUSED_NEW from PAUSED_ALL too, the row verifies."""
    bounds = Bounds(repeat_pause=True)
    out = check("vllm-0.32-epoch", 2, mode="any", bounds=bounds, workers=1)
    assert out["verdict"] == "verified", out.get("counterexample")
    before = _without_rows(
        "vllm-0.32-epoch", "pause_drains_queued_entering_paused_new", (RankState.PAUSING, RankState.PAUSED)
    )
    model = build_model("vllm-0.32-epoch", 2, ANY_MODE, bounds=bounds, table=before)
    cx = check_mode(model, counterexample_of="wait_drains").counterexample
    assert cx is not None and cx["property"] == "wait_drains" and len(cx["steps"]) == 11, cx
    text = "\n".join(cx["steps"])
    assert "pause(keep) to every rank (atomic)" in text and "pause(wait) to every rank again" in text
