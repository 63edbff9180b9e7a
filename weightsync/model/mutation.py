"""Mutation testing of a variant's table: does the checker notice when one rule is broken?

Each mutant changes one row of the table: its guard is negated (``always`` becomes ``never``), or one of
its updates or effects is dropped. A mutant is *killed* when :func:`weightsync.model.check.check_mode`
reports any violated property (safety, progress or non-vacuity) in some pause mode under some of the
configurations in :data:`MUTATION_BOUNDS` (the default bounds, plus bounds that reach rows the default
never does: tokens not a multiple of the sync interval, a second cycle, the one-time transfer init, a
client ABORT). Non-vacuity is judged under the default bounds only (a configuration without requests
never sees a wave, by design).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from weightsync.model.check import SOMETIMES, VIOLATED, check_mode
from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.rank import GUARDS, RankVars, Table, get_variant
from weightsync.spec.states import PauseMode
from weightsync.spec.table import ALWAYS

NEVER = "never"


#: Configurations every mutant is checked under: ``(name, bounds, max_states per mode, exhaustive)``.
#: Exhaustive ones: ``max_states`` is about 10x the unmutated model's largest per-mode state count at N=2
#: under those bounds; a mutant past it made a bounded quantity unbounded and counts as killed
#: ("unbounded"). A non-exhaustive one is a bounded breadth-first search (safety only, first
#: ``max_states`` states per mode, about the first 24 BFS levels): a violation found there kills, running
#: out of budget does not.
class MutationConfig(NamedTuple):
    """One configuration of the mutation run (see :data:`MUTATION_BOUNDS`); ``modes`` None: every mode."""

    name: str
    bounds: Bounds
    max_states: int
    exhaustive: bool = True
    modes: tuple[PauseMode, ...] | None = None


MUTATION_BOUNDS: tuple[MutationConfig, ...] = (
    MutationConfig("default", Bounds(), 300_000),
    # tokens=3 with K=2: requests finish off the sync step, so pausing meets partial syncs and ADDs
    MutationConfig("tokens3", Bounds(tokens=3), 400_000),
    # two cycles with the one-time init (eager before serving, or lazy while paused) and one resume no
    # pause preceded (a `finally` path); no requests (with traffic a stray resume deadlocks, see notes)
    MutationConfig(
        "cycles2-init-stray", Bounds(requests=0, cycles=2, init_transfer=True, stray_resume=True), 40_000
    ),
    # a client ABORT of the request, in any state of the rank that holds it
    MutationConfig("client-abort", Bounds(client_aborts=1), 500_000),
    # two requests (a second wave, an ADD while a wait-mode pause drains; the rows it reaches are
    # wait-mode rows): 780k states exhaustively in wait mode, so a bounded search
    MutationConfig("requests2-wait-bounded", Bounds(requests=2), 150_000, False, (PauseMode.WAIT,)),
)


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
    max_states: int = 300_000,
    configs: tuple[MutationConfig, ...] | None = None,
) -> str | None:
    """The first violated property (``"config:mode:property"``) of ``table`` checked as ``variant``, or None.

    ``configs`` (default: ``(("default", bounds, max_states),)``; the full run passes
    :data:`MUTATION_BOUNDS`) are tried in order. Safety is checked first with ``stop_at_first`` (fast) in
    every configuration; only a mutant that survives all of them gets the full check with progress (and
    non-vacuity, under the first configuration only). A mutant whose state space exceeds a configuration's
    ``max_states`` made a bounded quantity unbounded (a wave or step counter that grows forever); it is
    reported as ``"config:mode:unbounded (...)"`` and counted as killed.
    """
    guards = mutation_guards()
    cfgs = configs if configs is not None else (MutationConfig("default", bounds or Bounds(), max_states),)
    for full in (False, True):
        for k, (cname, b, cap, exhaustive, cmodes) in enumerate(cfgs):
            if full and not exhaustive:
                continue
            for mode in modes if cmodes is None else cmodes:
                m = Model(Config(variant, ranks, mode, channels, b), table=table, guards=guards)
                r = check_mode(m, stop_at_first=not full, progress=full, max_states=cap)
                bad = [n for n, v in r.properties.items() if v == VIOLATED and (k == 0 or n not in SOMETIMES)]
                if bad:
                    cx = r.counterexample
                    prop = cx["property"] if cx and cx["property"] in bad else bad[0]
                    return f"{cname}:{mode.value}:{prop}"
                if not r.complete and exhaustive:
                    return f"{cname}:{mode.value}:unbounded (more than {cap} states)"
    return None


def _kill_one(job: tuple[str, int, dict[str, Any]]) -> str | None:
    variant, idx, kw = job
    table = next(t for k, (_, t) in enumerate(mutants(get_variant(variant).table)) if k == idx)
    return kills(variant, table, **kw)


def run_mutation(
    variant: str = "two-phase-epoch",
    *,
    limit: int | None = None,
    every: int = 1,
    workers: int = 1,
    **kw: Any,
) -> dict[str, Any]:
    """Check every ``every``-th mutant (at most ``limit``) of ``variant``'s table, in ``workers``
    processes; ``kw`` goes to :func:`kills` (e.g. ``configs=MUTATION_BOUNDS``).

    Returns ``{"mutants": n, "killed": k, "survivors": [names], "killed_by": {name: "config:mode:property"},
    "unbounded": [names], "seconds": wall time}``.
    """
    t0 = time.perf_counter()
    base = get_variant(variant).table
    picked: list[tuple[int, Mutant]] = []
    for idx, (mut, _) in enumerate(mutants(base)):
        if idx % every:
            continue
        if limit is not None and len(picked) >= limit:
            break
        picked.append((idx, mut))
    jobs = [(variant, idx, kw) for idx, _ in picked]
    if workers > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_kill_one, jobs, chunksize=1)
    else:
        results = [_kill_one(j) for j in jobs]
    killed_by: dict[str, str] = {}
    survivors: list[str] = []
    for (_, mut), why in zip(picked, results, strict=True):
        if why is None:
            survivors.append(mut.name)
        else:
            killed_by[mut.name] = why
    unbounded = [k for k, why in killed_by.items() if "unbounded" in why]
    return {
        "mutants": len(picked),
        "killed": len(killed_by),
        "survivors": survivors,
        "killed_by": killed_by,
        "unbounded": unbounded,
        "seconds": round(time.perf_counter() - t0, 1),
    }
