"""``weightsync bench por``: the partial-order reduction measurement (issue 19 item 2)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any, ClassVar

import pytest

from weightsync.bench.por import CEILINGS, DEADLOCK_ONLY, STRATEGIES, rank_persistent_set, restricted_bfs
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

    def terminal_check(self, s: int) -> list[str]:
        return ["no_deadlock"]

    def successors(self, s: int) -> list[tuple[str, int]]:
        return list(self.EDGES[s])


def test_the_cycle_proviso_expands_in_full_a_state_whose_restricted_set_leads_back() -> None:
    first: Any = lambda m, s, succ: succ[:1]  # noqa: E731
    out = restricted_bfs(_Graph(), first)  # type: ignore[arg-type]
    # at 0 the restricted set {a} leads to a new state; at 1, {c} leads back to 0: 1 is expanded in full
    assert (out["states"], out["proper"], out["terminals"]) == (3, 1, ["no_deadlock"])
    assert restricted_bfs(_Graph(), None)["states"] == 4  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.ci
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

    # the persistent set of one rank's moves: used, keeps every terminal verdict, takes out little
    assert por["deadlock_only"] == list(DEADLOCK_ONLY) == ["rank_persistent"]
    for r in por["rows"]:
        rp = r["rank_persistent"]
        assert rp["proper"] > 0, r
        assert rp["terminals"] == r["full"]["terminals"], r
        assert 1.0 < rp["ratio"] < 1.2, r
    assert next(r for r in por["rows"] if r["variant"] == "two-phase")["full"]["terminals"] == [
        "no_one_sided_collective"
    ]

    assert por["ceilings"] == list(CEILINGS)
    assert next(iter(STRATEGIES)) == "full"
    full = row["full"]["states"]
    assert row["quiet_step_first"]["states"] < full
    assert row["quiet_step_first"]["ratio"] < 1.2
    assert row["one_rank_first"]["ratio"] > 3
    for name in ("collective_first", *CEILINGS):
        assert row[name]["ratio"] == round(full / row[name]["states"], 3)


def _persistent_from(model: Model, s: Any, picked: list[tuple[Any, Any]], limit: int) -> int:
    """Check, on up to ``limit`` states reached from ``s`` by moves outside ``picked``, that every move of
    ``picked`` stays enabled and commutes with each such move (the diamond at every state of the region,
    which by induction along a path is persistence); returns the diamonds checked."""
    mine = [label for label, _ in picked]
    region = {s: dict(picked)}  # a state of the region -> the set's moves there (label -> successor)
    todo, diamonds = [s], 0
    while todo and len(region) < limit:
        u = todo.pop()
        from_set = {la: dict(model.successors(t)) for la, t in region[u].items()}
        for lx, x in model.successors(u):
            if lx in mine:
                continue
            after_x = dict(model.successors(x))
            assert all(la in after_x for la in mine), (s, u, lx)
            for la in mine:
                assert from_set[la].get(lx) == after_x[la], (s, u, la, lx)
                diamonds += 1
            if x not in region:
                region[x] = {la: after_x[la] for la in mine}
                todo.append(x)
    return diamonds


def test_a_rank_persistent_set_commutes_with_every_sequence_of_other_moves() -> None:
    """At states of ``two-phase-epoch`` N=2 keep where :func:`rank_persistent_set` picks a rank's moves,
    every sequence of moves outside the set (every state reached that way from each) leaves each of its
    moves enabled and commutes with it: persistence, checked rather than argued. Dropping the condition on
    the START_DP_WAVE FIFO, or the one that the client has sent everything, breaks it (checked); the others
    concern configurations with failures, aborts or a front-end gate, and this one has none."""
    model = Model(Config("two-phase-epoch", 2, bounds=Bounds()), silent_waves=True)
    init = model.initial()
    seen, stack, checked, diamonds = {init}, [init], 0, 0
    while stack:
        s = stack.pop()
        if model.invariant(s):
            continue
        succ = model.successors(s)
        picked = rank_persistent_set(model, s, succ) if succ else None
        if picked:
            checked += 1
            diamonds += _persistent_from(model, s, picked, 100_000)
        for _, t in succ:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    assert checked > 1000 and diamonds > 5000, (checked, diamonds)
