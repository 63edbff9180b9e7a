"""``weightsync bench por``: the partial-order reduction measurement (issue 19 item 2)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any, ClassVar

from weightsync.bench.por import CEILINGS, STRATEGIES, restricted_bfs
from weightsync.cli import main
from weightsync.model.compact import explore_compact
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


def test_bench_por_quick() -> None:
    """One run of ``weightsync bench por --quick --json`` (one test, so that ``-n 2`` runs it once):

    - its baseline is the checker's exploration of the same model;
    - the one set of this model's shape that comes near condition C1 (collective completions first) is
      used at thousands of states and leaves the state count as it is: every state it skips is reached
      along another interleaving;
    - only ignoring C1 for receipts saves much.
    """
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "por", "--quick", "--json"]) == 0
    por: dict[str, Any] = json.loads(buf.getvalue())
    row = next(r for r in por["rows"] if r["variant"] == "two-phase-epoch")
    model = Model(Config("two-phase-epoch", 2, ANY_MODE, "per-socket", Bounds()), silent_waves=True)
    ex, _ = explore_compact(model)
    assert row["full"]["states"] == len(ex.states) == 41_578
    assert row["full"]["violations"] == sorted(ex.violations) == []

    assert por["ok"]
    for r in por["rows"]:
        assert r["collective_first"]["proper"] > 0, r
        assert r["collective_first"]["states"] == r["full"]["states"], r
        assert r["collective_first"]["ratio"] == 1.0, r

    assert por["ceilings"] == list(CEILINGS)
    assert next(iter(STRATEGIES)) == "full"
    full = row["full"]["states"]
    assert row["quiet_step_first"]["states"] < full
    assert row["quiet_step_first"]["ratio"] < 1.2
    assert row["one_rank_first"]["ratio"] > 3
    for name in ("collective_first", *CEILINGS):
        assert row[name]["ratio"] == round(full / row[name]["states"], 3)
