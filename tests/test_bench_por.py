"""``weightsync bench por``: the partial-order reduction measurement (issue 19 item 2)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from weightsync.bench.por import CEILINGS, STRATEGIES, restricted_bfs
from weightsync.cli import main
from weightsync.model.check import explore_model
from weightsync.model.system import Bounds, Config, Model
from weightsync.model.system.state import ANY_MODE


class _Graph:
    """A model-shaped graph: 0 -a-> 1, 0 -b-> 2, 1 -c-> 0 (a cycle), 1 -d-> 3; no invariant fails."""

    EDGES: ClassVar[dict[int, list[tuple[str, int]]]] = {
        0: [("a", 1), ("b", 2)],
        1: [("c", 0), ("d", 3)],
        2: [],
        3: [],
    }

    def initial(self) -> int:
        return 0

    def invariant(self, s: int) -> list[str]:
        return []

    def successors(self, s: int) -> list[tuple[str, int]]:
        return list(self.EDGES[s])


def test_the_cycle_proviso_expands_in_full_a_state_whose_restricted_set_leads_back() -> None:
    first: Any = lambda s, succ: succ[:1]  # noqa: E731
    out = restricted_bfs(_Graph(), first)  # type: ignore[arg-type]
    # at 0 the restricted set {a} leads to a new state; at 1, {c} leads back to 0: 1 is expanded in full
    assert (out["states"], out["proper"]) == (3, 1)
    assert restricted_bfs(_Graph(), None)["states"] == 4  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def por() -> dict[str, Any]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "por", "--quick", "--json"]) == 0
    out: dict[str, Any] = json.loads(buf.getvalue())
    return out


def test_the_baseline_is_the_checkers_count(por: dict[str, Any]) -> None:
    row = next(r for r in por["rows"] if r["variant"] == "two-phase-epoch")
    ex = explore_model(
        Model(Config("two-phase-epoch", 2, ANY_MODE, "per-socket", Bounds()), silent_waves=True)
    )
    assert row["full"]["states"] == len(ex.states) == 41_578
    assert row["full"]["violations"] == sorted(ex.violations) == []


def test_collective_completions_first_take_out_no_state(por: dict[str, Any]) -> None:
    """The one set of this model's shape that comes near condition C1 is used at thousands of states and
    leaves the state count as it is: every state it skips is reached along another interleaving."""
    assert por["ok"]
    for row in por["rows"]:
        assert row["collective_first"]["proper"] > 0
        assert row["collective_first"]["states"] == row["full"]["states"]
        assert row["collective_first"]["ratio"] == 1.0


def test_only_ignoring_condition_c1_for_receipts_saves_much(por: dict[str, Any]) -> None:
    assert por["ceilings"] == list(CEILINGS)
    assert next(iter(STRATEGIES)) == "full"
    row = next(r for r in por["rows"] if r["variant"] == "two-phase-epoch")
    full = row["full"]["states"]
    assert row["quiet_step_first"]["states"] < full
    assert row["quiet_step_first"]["ratio"] < 1.2
    assert row["one_rank_first"]["ratio"] > 3
    for name in ("collective_first", *CEILINGS):
        assert row[name]["ratio"] == round(full / row[name]["states"], 3)
