"""``weightsync bench por``: how much a partial-order reduction could take out of the model, measured.

Issue 19 item 2 asks for ample sets (conditions C0-C3: non-empty, persistent, invisible, the cycle
proviso). This bench measures, on the model itself, what ample sets of the shapes a process-based
reduction can form would save, before any proof of their conditions: every configuration is explored
breadth-first several times with the same successor function (:meth:`Model.successors`, silent-wave
reduction on, no symmetry), and the runs differ only in which successors of a state they expand.

- ``full``: every enabled move (the baseline; its count is ``weightsync check``'s with ``--silent-waves``
  and no symmetry).
- ``collective_first``: where a collective completion or timeout is enabled, only those. While every
  member of a collective is blocked in it, nothing but a completion or a timeout moves a member, which is
  as close to condition C1 as any move of this model comes.
- ``quiet_step_first`` (a ceiling, not sound): a rank's loop step alone, for the first rank that has a
  step enabled and nothing queued on any of its FIFOs. It ignores C1 for the messages that other processes
  may still send to that rank.
- ``one_rank_first`` (a ceiling, not sound): the moves of the first rank that has one enabled, alone. It
  ignores C1 for every receipt: the order in which a rank takes messages from different senders is then
  fixed, which is the race the checker exists to explore.

Each restricted run keeps the cycle proviso (C3): a restricted set is expanded only when every successor
it leads to is new, otherwise the state is expanded in full. A state violating an invariant is not
expanded (as :func:`~weightsync.model.explorer.explore`). The figures are state counts and, per strategy,
``ratio`` = full states / its states, measured in this process; ``proper`` counts the states a
restricted set was used at. ``violations`` lists the state properties each run found violated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from weightsync.model.system import Bounds, Config, Model
from weightsync.model.system.state import ANY_MODE, GlobalState, Label, ModeSetting
from weightsync.spec.states import PauseMode

#: A strategy: (state, its successors) -> the successors to expand in place of all of them (None: all).
Strategy = Callable[[GlobalState, list[tuple[Label, GlobalState]]], list[tuple[Label, GlobalState]] | None]


def _collective_first(
    s: GlobalState, succ: list[tuple[Label, GlobalState]]
) -> list[tuple[Label, GlobalState]]:
    return [e for e in succ if e[0][0] in ("done", "timeout")]


def _quiet_step_first(
    s: GlobalState, succ: list[tuple[Label, GlobalState]]
) -> list[tuple[Label, GlobalState]] | None:
    for label, t in succ:
        if label[0] == "step" and not any(s.ranks[label[1]].inq):
            return [(label, t)]
    return None


def _one_rank_first(
    s: GlobalState, succ: list[tuple[Label, GlobalState]]
) -> list[tuple[Label, GlobalState]] | None:
    for label, _ in succ:
        if label[0] in ("recv", "step"):
            i = label[1]
            return [e for e in succ if e[0][0] in ("recv", "step") and e[0][1] == i]
    return None


#: The strategies, in the order they run (``full`` first: the baseline of every ratio).
STRATEGIES: dict[str, Strategy | None] = {
    "full": None,
    "collective_first": _collective_first,
    "quiet_step_first": _quiet_step_first,
    "one_rank_first": _one_rank_first,
}
#: The strategies that ignore condition C1 (ceilings: what they save, a sound reduction cannot exceed on
#: that shape of set; their verdicts are not verdicts).
CEILINGS = ("quiet_step_first", "one_rank_first")


def restricted_bfs(model: Model, strategy: Strategy | None) -> dict[str, Any]:
    """Breadth-first exploration of ``model`` expanding, at each state, the successors ``strategy`` picks
    when they are fewer than all and every one is new (the cycle proviso), else all of them.

    Returns:
        ``states`` (distinct states reached), ``proper`` (states expanded with the restricted set),
        ``violations`` (sorted names of the state properties violated in some reached state) and
        ``seconds`` (wall time).
    """
    t0 = time.perf_counter()
    init = model.initial()
    seen = {init}
    queue = deque([init])
    proper = 0
    violated: set[str] = set()
    while queue:
        s = queue.popleft()
        bad = model.invariant(s)
        if bad:
            violated.update(bad)
            continue
        succ = model.successors(s)
        if strategy is not None:
            picked = strategy(s, succ)
            if picked and len(picked) < len(succ) and all(t not in seen for _, t in picked):
                succ = picked
                proper += 1
        for _, t in succ:
            if t not in seen:
                seen.add(t)
                queue.append(t)
    return {
        "states": len(seen),
        "proper": proper,
        "violations": sorted(violated),
        "seconds": round(time.perf_counter() - t0, 2),
    }


#: The configurations: (variant, ranks, pause mode or any, requests); ``quick`` takes the first two.
CONFIGS: tuple[tuple[str, int, ModeSetting, int], ...] = (
    ("two-phase", 2, PauseMode.KEEP, 1),
    ("two-phase-epoch", 2, ANY_MODE, 1),
    ("two-phase-epoch", 3, PauseMode.KEEP, 1),
)


def run_por_bench(quick: bool = False) -> dict[str, Any]:
    """Every strategy of :data:`STRATEGIES` on every configuration of :data:`CONFIGS` (the first two with
    ``quick``), in this process.

    Returns:
        ``rows``: one per configuration (``variant``, ``ranks``, ``mode``, ``requests``, and per strategy its
        :func:`restricted_bfs` figures with ``ratio``, full states over its states); ``ceilings``: the
        strategies that ignore C1; ``ok``: every sound-shaped strategy found the violations ``full`` found.
    """
    rows = []
    ok = True
    for variant, n, mode, requests in CONFIGS[:2] if quick else CONFIGS:
        config = Config(variant, n, mode, "per-socket", Bounds(requests=requests))
        row: dict[str, Any] = {"variant": variant, "ranks": n, "mode": mode.value, "requests": requests}
        for name, strategy in STRATEGIES.items():
            row[name] = restricted_bfs(Model(config, silent_waves=True), strategy)
        for name in STRATEGIES:
            row[name]["ratio"] = round(row["full"]["states"] / row[name]["states"], 3)
        ok = ok and row["collective_first"]["violations"] == row["full"]["violations"]
        rows.append(row)
    return {"rows": rows, "ceilings": list(CEILINGS), "ok": ok}


__all__ = ["CEILINGS", "CONFIGS", "STRATEGIES", "restricted_bfs", "run_por_bench"]
