"""The breadth-first explorer of :mod:`weightsync.model.explorer` for successor functions that check their
own edges.

:func:`explore_checked` is :func:`~weightsync.model.explorer.explore` with one difference: ``successors``
yields triples ``(label, next_state, violated)``, where ``violated`` names the transition properties the edge
violates (what ``edge_check(state, label, next_state)`` returns), so a successor function that memoises
its transitions (:mod:`weightsync.model.compact`) memoises their edge checks with them and the explorer
makes no call per edge. Everything else is the same: BFS order, indexing, parent pointers, counting (TLC
conventions), the first violation kept per property, states violating an invariant not expanded,
``canon`` applied to unknown successors only, ``max_states`` and ``stop_at_first``. The same inputs give
the same :class:`~weightsync.model.explorer.Exploration`, field for field.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

from weightsync.model.explorer import Exploration, Label, Violation, _gc_paused

S = TypeVar("S", bound=Hashable)

#: ``state -> iterable of (label, next_state, names of the transition properties the edge violates)``
CheckedSuccessors = Callable[[S], Iterable[tuple[Label, S, Sequence[str]]]]


@_gc_paused
def explore_checked(
    initial: Iterable[S],
    successors: CheckedSuccessors[S],
    *,
    invariant: Callable[[S], Sequence[str]] | None = None,
    terminal_check: Callable[[S], Sequence[str]] | None = None,
    canon: Callable[[S], S] | None = None,
    keep_edges: bool = False,
    keep_labels: bool = False,
    max_states: int = 50_000_000,
    stop_at_first: bool = False,
) -> Exploration[S]:
    """Breadth-first exploration of every state reachable from ``initial``; see the module docstring and
    :func:`~weightsync.model.explorer.explore` (same arguments, less ``edge_check``)."""
    t0 = time.perf_counter()
    states: list[S] = []
    index: dict[S, int] = {}
    parent: array[int] = array("q")
    via: list[Label] = []
    level: array[int] = array("l")
    src: array[int] | None = array("q") if keep_edges else None
    dst: array[int] | None = array("q") if keep_edges else None
    labels: list[Label] | None = [] if keep_labels else None
    violations: dict[str, Violation] = {}
    bad: set[int] = set()

    def note(names: Sequence[str], i: int, label: Label | None = None, target: Any = None) -> None:
        for n in names:
            if n not in violations:
                violations[n] = Violation(n, i, label, target)

    for s0 in initial:
        c = canon(s0) if canon is not None else s0
        if c in index:
            continue
        index[c] = len(states)
        states.append(c)
        parent.append(-1)
        via.append(None)
        level.append(1)
        if invariant is not None:
            v = invariant(c)
            if v:
                note(v, len(states) - 1)
                bad.add(len(states) - 1)

    transitions = 0
    complete = True
    terminal: list[int] = []
    index_get = index.get
    i = 0
    while i < len(states):
        if stop_at_first and violations:
            complete = False
            break
        if i in bad:
            i += 1
            continue
        s = states[i]
        n = 0
        lvl = level[i] + 1
        for label, t, ev in successors(s):
            n += 1
            if ev:
                note(ev, i, label, t)
            j = index_get(t)
            c = t
            if j is None and canon is not None:
                c = canon(t)
                if c is not t:
                    j = index_get(c)
            if j is None:
                j = len(states)
                index[c] = j
                states.append(c)
                parent.append(i)
                via.append(label)
                level.append(lvl)
                if invariant is not None:
                    v = invariant(c)
                    if v:
                        note(v, j)
                        bad.add(j)
            if src is not None and dst is not None:
                src.append(i)
                dst.append(j)
            if labels is not None:
                labels.append(label)
        transitions += n
        if n == 0:
            terminal.append(i)
            if terminal_check is not None:
                tv = terminal_check(s)
                if tv:
                    note(tv, i)
        i += 1
        if len(states) >= max_states and i < len(states):
            complete = False
            break
    ex: Exploration[S] = Exploration(
        states=states,
        index=index,
        parent=parent,
        via=via,
        level=level,
        transitions=transitions,
        src=src,
        dst=dst,
        labels=labels,
        violations=violations,
        complete=complete,
        terminal=terminal,
    )
    ex.seconds = time.perf_counter() - t0
    return ex
