"""Mutation testing of a variant's table: does the checker notice when one rule is broken?

Each mutant changes one row of the table: its guard is negated (``always`` becomes ``never``), or one of
its updates or effects is dropped. A mutant is *killed* when :func:`weightsync.model.check.check_mode`
reports any violated property (safety, progress or non-vacuity) in some pause mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.model.check import VIOLATED, check_mode
from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.rank import GUARDS, RankVars, Table, get_variant
from weightsync.spec.states import PauseMode
from weightsync.spec.table import ALWAYS

NEVER = "never"


@dataclass(frozen=True)
class Mutant:
    """One mutation: row ``(state, event, index)`` of the table, the kind ("guard", "update", "effect")
    and what was changed (the guard's name, or the dropped update/effect)."""

    state: str
    event: str
    index: int
    kind: str
    what: str

    @property
    def name(self) -> str:
        """``state/event#index: <kind> <what>``."""
        verb = "negate guard" if self.kind == "guard" else f"drop {self.kind}"
        return f"{self.state}/{self.event}#{self.index}: {verb} {self.what}"


def mutation_guards() -> dict[str, Callable[[RankVars, Mapping[str, Any]], bool]]:
    """:data:`GUARDS` plus ``not:<guard>`` for every guard and ``never``."""
    g: dict[str, Callable[[RankVars, Mapping[str, Any]], bool]] = dict(GUARDS)
    for name, fn in GUARDS.items():
        g[f"not:{name}"] = (lambda f: lambda v, a: not f(v, a))(fn)
    g[NEVER] = lambda v, a: False
    return g


def mutants(table: Table) -> Iterator[tuple[Mutant, Table]]:
    """Every single-row mutant of ``table``, in table order, with the mutated table."""
    for (state, event), rows in table.items():
        for k, tr in enumerate(rows):
            changes: list[tuple[str, str, Any]] = []
            neg = NEVER if tr.guard == ALWAYS else f"not:{tr.guard}"
            changes.append(("guard", tr.guard, tr._replace(guard=neg)))
            for j, u in enumerate(tr.updates):
                changes.append(("update", u, tr._replace(updates=tr.updates[:j] + tr.updates[j + 1 :])))
            for j, e in enumerate(tr.effects):
                changes.append(("effect", e, tr._replace(effects=tr.effects[:j] + tr.effects[j + 1 :])))
            for kind, what, new in changes:
                t2 = dict(table)
                t2[(state, event)] = (*rows[:k], new, *rows[k + 1 :])
                yield Mutant(str(state.value), str(event.value), k, kind, what), t2


def kills(
    variant: str,
    table: Table,
    *,
    ranks: int = 2,
    channels: str = "per-socket",
    bounds: Bounds | None = None,
    modes: tuple[PauseMode, ...] = tuple(PauseMode),
    max_states: int = 250_000,
) -> str | None:
    """The first violated property (``"mode:property"``) of ``table`` checked as ``variant``, or None.

    Safety is checked first with ``stop_at_first`` (fast); only a mutant that survives it gets the full
    check with progress and non-vacuity. A mutant whose state space exceeds ``max_states`` (the unmutated
    model has ~28k states per mode at the default bounds) made a bounded quantity unbounded (a wave or
    step counter that grows forever); it is reported as ``"mode:unbounded (...)"`` and counted as killed.
    """
    guards = mutation_guards()
    b = bounds or Bounds()
    for full in (False, True):
        for mode in modes:
            m = Model(Config(variant, ranks, mode, channels, b), table=table, guards=guards)
            r = check_mode(m, stop_at_first=not full, progress=full, max_states=max_states)
            bad = [n for n, v in r.properties.items() if v == VIOLATED]
            if bad:
                return f"{mode.value}:{r.counterexample['property'] if r.counterexample else bad[0]}"
            if not r.complete:
                return f"{mode.value}:unbounded (more than {max_states} states)"
    return None


def run_mutation(
    variant: str = "two-phase-epoch", *, limit: int | None = None, every: int = 1, **kw: Any
) -> dict[str, Any]:
    """Check every ``every``-th mutant (at most ``limit``) of ``variant``'s table.

    Returns ``{"mutants": n, "killed": k, "survivors": [names], "killed_by": {name: "mode:property"},
    "unbounded": [names]}``.
    """
    base = get_variant(variant).table
    killed_by: dict[str, str] = {}
    survivors: list[str] = []
    n = 0
    for idx, (mut, table) in enumerate(mutants(base)):
        if idx % every:
            continue
        if limit is not None and n >= limit:
            break
        n += 1
        why = kills(variant, table, **kw)
        if why is None:
            survivors.append(mut.name)
        else:
            killed_by[mut.name] = why
    unbounded = [k for k, why in killed_by.items() if "unbounded" in why]
    return {
        "mutants": n,
        "killed": len(killed_by),
        "survivors": survivors,
        "killed_by": killed_by,
        "unbounded": unbounded,
    }
