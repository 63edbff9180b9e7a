"""Issue 24, item 2: which requests a wait-mode pause drains. vLLM 0.32 (and PR #39366 as shipped) leave a
request queued on the rank when the pause arrives queued until the resume; the fixed variants drain it
(patch 0005). The model's counterexamples, and the same schedules driven on the reference engine (30 s each:
``slow``, run once by CI)."""

from __future__ import annotations

import json

import pytest

from weightsync.cli import main
from weightsync.model.check import check
from weightsync.spec.rank import VARIANTS


def _cx(variant: str) -> dict[str, object]:
    out = check(variant, 2, mode="wait", workers=1, progress=False, counterexample_of="wait_drains")
    props = out["properties"]
    assert isinstance(props, dict) and props["wait_drains"] == "violated", props
    cx = out["counterexample"]
    assert isinstance(cx, dict) and cx["property"] == "wait_drains"
    return cx


def test_vllm_032_leaves_a_request_queued_before_the_wait_pause_queued() -> None:
    """The shortest counterexample: the ADD reaches rank 0, the pause follows before any step, and the pause
    completes (sum_unfinished=0: vLLM 0.32 does not count a queued request under PAUSED_NEW) with it queued."""
    cx = _cx("vllm-0.32")
    steps = [str(s) for s in cx["steps"]]  # type: ignore[union-attr]
    assert len(cx["labels"]) == 8, steps  # type: ignore[arg-type]
    assert "receives ADD" in steps[1] and "receives pause(wait)" in steps[3]
    assert "pause_drains_now" in steps[3] and "sum_unfinished=0" in steps[7]
    assert all("a dummy batch" in s for s in steps if " steps " in s), steps  # no step ran the request


@pytest.mark.parametrize("variant", ["two-phase-epoch", "vllm-0.32-epoch"])
def test_the_fixed_variants_drain_it(variant: str) -> None:
    out = check(variant, 2, mode="wait", workers=1)
    assert out["verdict"] == "verified" and out["properties"]["wait_drains"] == "holds"  # type: ignore[index]
    rows = [tr for trs in VARIANTS[variant].table.values() for tr in trs if "admit_waiting" in tr.effects]
    # patch 0005's drain rows: wherever a wait enters PAUSED_NEW (also from keep's PAUSED_ALL);
    # two-phase-epoch's row at running drains whatever its PauseState (a running rank is UNPAUSED)
    assert rows and all(tr.effects == ("admit_waiting",) for tr in rows)
    want = {"pause_drains_queued_entering_paused_new"}
    assert {tr.guard for tr in rows} == (
        want | {"pause_drains_queued"} if variant == "two-phase-epoch" else want
    )


def test_only_wait_drains_before_return() -> None:
    """abort empties the queue and keep holds everything by design: the property judges wait only."""
    for mode in ("abort", "keep"):
        out = check("vllm-0.32", 2, mode=mode, workers=1, progress=False)
        assert out["properties"]["wait_drains"] == "holds", mode  # type: ignore[index]


def _repro(capsys: pytest.CaptureFixture[str], variant: str) -> tuple[int, dict[str, object]]:
    rc = main(["repro", variant, "--mode", "wait", "--property", "wait_drains", "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(180)
def test_two_phase_leaves_it_queued_on_the_reference_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """Real processes and gloo: every model step followed, the pause returns, the request produces no token
    while paused, and it finishes after the resume."""
    rc, out = _repro(capsys, "two-phase")
    assert rc == 0 and out["result"] == "reproduced", out["reason"]
    assert out["diverged_at"] is None and out["property"] == "wait_drains"
    assert "still queued: no token in" in str(out["reason"])
    assert out["requests_finished"] == {"req-0": 2}


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(180)
def test_two_phase_epoch_drains_it_before_the_pause_returns(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _repro(capsys, "two-phase-epoch")
    assert rc == 0 and out["result"] == "completed", out["reason"]
    assert "the pause returned with every request added before it finished" in str(out["reason"])
    rows = {str(r["fix_row"]) for r in out["fix_rows"]}  # type: ignore[union-attr]
    assert "two-phase-epoch: running --pause--> [pause_drains_queued]" in rows
