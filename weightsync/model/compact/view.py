"""An exploration by the compact engine, read as one of :class:`GlobalState` values."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import overload

from weightsync.model.compact.codec import FIELD_MASK, Compact
from weightsync.model.compact.engine import CompactEngine
from weightsync.model.explorer import Exploration, Violation, explore_checked
from weightsync.model.system import GlobalState, Model


class DecodedStates(Sequence[GlobalState]):
    """An exploration's encoded states, read as :class:`GlobalState` (decoded on access)."""

    def __init__(self, engine: CompactEngine, states: Sequence[Compact]) -> None:
        self.engine = engine
        self.compact = states

    def __len__(self) -> int:
        return len(self.compact)

    @overload
    def __getitem__(self, i: int) -> GlobalState: ...

    @overload
    def __getitem__(self, i: slice) -> list[GlobalState]: ...

    def __getitem__(self, i: int | slice) -> GlobalState | list[GlobalState]:
        if isinstance(i, slice):
            return [self.engine.decode(c) for c in self.compact[i]]
        return self.engine.decode(self.compact[i])

    def __iter__(self) -> Iterator[GlobalState]:
        decode = self.engine.decode
        return (decode(c) for c in self.compact)

    def where_by_statuses(self, preds: Sequence[Callable[[GlobalState], bool]]) -> list[list[int]]:
        """For each predicate of ``preds``, the indices of the states satisfying it (ascending). Each
        predicate reads the state outside the ranks and each rank's ``status`` only (the progress goals,
        :meth:`Model.goal_pause` and the like), so the states are grouped once by (rest, statuses) and each
        predicate is evaluated once per group, on a decoded state."""
        e = self.engine
        status, shifts, mask, rest_shift = e._status, e.shifts, FIELD_MASK, e.rest_shift
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(self.compact):
            key = (c >> rest_shift, *[status[(c >> sh) & mask] for sh in shifts])
            g = groups.get(key)
            if g is None:
                groups[key] = [i]
            else:
                g.append(i)
        out: list[list[int]] = []
        for pred in preds:
            found: list[int] = []
            for members in groups.values():
                if pred(e.decode(self.compact[members[0]])):
                    found += members
            found.sort()
            out.append(found)
        return out


class DecodedIndex(Mapping[GlobalState, int]):
    """An exploration's state -> index map, keyed by :class:`GlobalState` (encoded on lookup)."""

    def __init__(self, engine: CompactEngine, index: Mapping[Compact, int]) -> None:
        self.engine = engine
        self.compact = index

    def __getitem__(self, s: GlobalState) -> int:
        e = self.engine
        ids = [e.rank_ids.get(r, -1) for r in s.ranks]
        rest = e.rest_ids.get(tuple(s[1:]), -1)
        if rest < 0 or min(ids) < 0:
            raise KeyError(s)
        return self.compact[e.pack(ids, rest)]

    def __len__(self) -> int:
        return len(self.compact)

    def __iter__(self) -> Iterator[GlobalState]:
        return iter(DecodedStates(self.engine, list(self.compact)))


def explore_compact(
    model: Model,
    *,
    symmetry: bool = False,
    keep_edges: bool = False,
    keep_labels: bool = False,
    max_states: int = 50_000_000,
    stop_at_first: bool = False,
    verify: bool = False,
    deadline: float | None = None,
) -> tuple[Exploration[GlobalState], CompactEngine]:
    """Explore ``model`` with the compact engine: the same exploration as
    ``explore([model.initial()], model.successors, invariant=..., edge_check=..., terminal_check=...,
    canon=...)`` (same states in the same order, same counts, violations and paths; under symmetry at N > 3
    an edge violation's ``target`` may be another state of its orbit, see :meth:`CompactEngine.successors`),
    its states decoded on access; and the engine (its memo figures: :meth:`CompactEngine.stats`)."""
    engine = CompactEngine(model, verify=verify, symmetry=symmetry)
    ex = explore_checked(
        engine.initial(),
        engine.successors,
        invariant=engine.invariant,
        terminal_check=engine.terminal_check,
        canon=engine.canon if symmetry else None,
        keep_edges=keep_edges,
        keep_labels=keep_labels,
        max_states=max_states,
        stop_at_first=stop_at_first,
        deadline=deadline,
    )
    violations = {
        name: Violation(v.property, v.state, v.label, None if v.target is None else engine.decode(v.target))
        for name, v in ex.violations.items()
    }
    out: Exploration[GlobalState] = Exploration(
        states=DecodedStates(engine, ex.states),
        index=DecodedIndex(engine, ex.index),
        parent=ex.parent,
        via=ex.via,
        level=ex.level,
        transitions=ex.transitions,
        src=ex.src,
        dst=ex.dst,
        labels=ex.labels,
        violations=violations,
        complete=ex.complete,
        seconds=ex.seconds,
        terminal=ex.terminal,
        levels_expanded=ex.levels_expanded,
    )
    return out, engine
