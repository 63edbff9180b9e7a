"""``weightsync bench explorer``'s time-to-verdict rows (weightsync/bench/reach.py): one check per row in a
process of its own, its figures back as JSON, a budget that stops it."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from weightsync.bench.reach import time_to_verdict

PROOFS = Path(__file__).resolve().parent.parent / "proofs"


def test_a_row_reports_the_checks_verdict_and_the_proofs_state_count() -> None:
    """N=2, every mode, safety, deadlock and progress: the row's figures are the proof row's."""
    proof = json.loads((PROOFS / "two-phase-epoch__per-socket__n2.json").read_text())
    row = time_to_verdict(2, progress=True, budget_s=300)
    assert row["verdict"] == proof["verdict"] == "verified"
    assert (row["states"], row["transitions"]) == (proof["states"], proof["transitions"])
    assert row["ranks"] == 2 and row["engine"] == "compact" and row["reductions"] == []
    assert row["properties"] == ["safety", "deadlock", "progress"]
    assert row["peak_rss_bytes"] > 10 * 2**20
    assert 0 < row["seconds"] < 300


def test_a_row_past_its_budget_stops_exploring_and_gives_a_bounded_verdict() -> None:
    """N=4 in 3 s: the exploration stops at 90% of the budget and the row says how many BFS levels every
    mode explored completely."""
    row = time_to_verdict(4, progress=True, budget_s=3.0)
    assert row["verdict"] == "incomplete", row
    assert row["states"] > 0 and row["peak_rss_bytes"] > 0
    assert 1 <= row["levels_expanded"] < row["depth"]
    assert row["seconds"] < 3.0 + 30
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_a_row_that_does_not_answer_is_stopped_and_reported_as_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backstop: a row whose process has not answered :data:`GRACE_S` after its budget (here its
    exploration's deadline lies beyond the budget, and no grace) is killed with its process group."""
    import weightsync.bench.reach as reach

    monkeypatch.setattr(reach, "DEADLINE_SHARE", 1000.0)
    monkeypatch.setattr(reach, "GRACE_S", 0.0)
    row = reach.time_to_verdict(4, progress=True, budget_s=1.0)
    assert row["verdict"] == "timeout"
    assert row["states"] is None and row["peak_rss_bytes"] is None and row["levels_expanded"] is None
    assert row["reductions"] == ["symmetry"] and row["budget_s"] == 1.0
    assert 1.0 <= row["seconds"] < 30
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize(("ranks", "budget"), [(1, 10.0), (2, 0.0), (2, float("nan"))])
def test_bad_input_is_refused_before_a_process_starts(ranks: int, budget: float) -> None:
    with pytest.raises(ValueError, match=r"ranks must be >= 2|budget_s must be > 0"):
        time_to_verdict(ranks, progress=False, budget_s=budget)


@pytest.mark.slow
def test_the_quick_bench_prints_the_issue_fields() -> None:
    """``weightsync bench explorer --quick``'s figures (about 90 s)."""
    from weightsync.bench.explorer import run_explorer_bench

    out = run_explorer_bench(quick=True, budget_s=300)
    assert out["ok"] and out["speedup_vs_baseline"] > 1  # compact vs baseline engine, N=2 keep (quick)
    assert [(r["ranks"], r["reductions"]) for r in out["rows"]] == [
        (2, []),
        (3, ["symmetry"]),
        (3, ["symmetry", "silent-waves"]),
    ]
    n3, n3_silent = out["rows"][1], out["rows"][2]
    # the silent-wave reduction: the same verdict on fewer states (it is measured, not assumed)
    assert n3_silent["verdict"] == n3["verdict"] == "verified" and n3_silent["states"] < n3["states"]
    assert out["n3_seconds"] == n3["seconds"] and out["n3_states_per_second"] > 0
    sv = out["spin_vs_compact"][0]  # the explorer against SPIN on the generated Promela, N=2 keep
    assert not sv["available"] or sv["spin_verdict"] == sv["compact_verdict"] == "verified"
    for r in out["rows"]:
        assert {
            "ranks",
            "engine",
            "reductions",
            "bounds",
            "verdict",
            "states",
            "seconds",
            "peak_rss_bytes",
        } <= r.keys()


def test_a_row_whose_process_dies_raises_naming_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's process that dies before it sends its figures is an error, not a hang or a timeout."""
    import weightsync.bench.reach as reach

    monkeypatch.setattr(reach, "worker_context", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(reach, "_row_child", _die)
    with pytest.raises(RuntimeError, match=r"the N=2 row's process exited with code 3 and no result"):
        reach.time_to_verdict(2, progress=False, budget_s=60)


def _die(*_args: object) -> None:
    import os

    os._exit(3)
