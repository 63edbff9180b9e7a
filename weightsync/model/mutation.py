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

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from weightsync.model.check import check_mode
from weightsync.model.properties import SOMETIMES, VIOLATED
from weightsync.model.system import Bounds, Config, Model
from weightsync.model.system.state import ANY_MODE, ModeSetting
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
    modes: tuple[ModeSetting, ...] | None = None


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
    # two cycles with one request: a flag left over from cycle 1 meets a peer still serving in cycle 2
    # (430k-560k states per mode unmutated)
    MutationConfig("cycles2", Bounds(cycles=2), 6_000_000),
    # one injected weight-transfer failure (init, start, broadcast or finish) with the one-time init, no
    # requests: the failed state, its refusals, the recovery round and the per-member timeouts
    MutationConfig("failures-init", Bounds(requests=0, init_transfer=True, failures=1), 60_000),
    # the one-time init with a request (abort mode: 108,590 states unmutated): the init gate's rows
    # (alone_or_never_served) meet traffic (without requests, a gate that refuses every init only loops the
    # controller's retries: progress_run)
    MutationConfig("init-traffic", Bounds(init_transfer=True), 500_000, True, (PauseMode.ABORT,)),
    # stray and retried resumes around one request (keep mode; 680k states exhaustively, so bounded)
    MutationConfig(
        "stray-repeat-bounded",
        Bounds(stray_resume=True, repeat_resume=True),
        120_000,
        False,
        (PauseMode.KEEP,),
    ),
    # a second pause while the first is in flight or returned, before the round (the pause-while-paused
    # rows: the mode again before the consensus, a join after it, a no-op once verified), in each mode
    # (154k-228k states per mode unmutated), and with the controller picking each pause's mode (a wait
    # after a keep in flight: 975k states exhaustively, so bounded)
    MutationConfig("repeat-pause", Bounds(repeat_pause=True), 2_500_000),
    MutationConfig("any-mode-repeat-pause-bounded", Bounds(repeat_pause=True), 200_000, False, (ANY_MODE,)),
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
    modes: tuple[ModeSetting, ...] = tuple(PauseMode),
    max_states: int = 300_000,
    configs: tuple[MutationConfig, ...] | None = None,
    same_as_unmutated: frozenset[tuple[str, ModeSetting]] = frozenset(),
) -> str | None:
    """The first violated property (``"config:mode:property"``) of ``table`` checked as ``variant``, or None.

    ``configs`` (default: ``(("default", bounds, max_states),)``; the full run passes
    :data:`MUTATION_BOUNDS`) are tried in order, each mode in turn, with one exploration each: it stops at
    the first safety violation, and when it completes without one the progress properties are checked on
    the same graph (exhaustive configurations only; non-vacuity under the first configuration only). A
    mutant whose state space exceeds a configuration's ``max_states`` made a bounded quantity unbounded (a
    wave or step counter that grows forever); it is reported as ``"config:mode:unbounded (...)"`` and
    counted as killed.

    ``same_as_unmutated``: ``(configuration, mode)`` pairs where every table lookup the unmutated model
    makes gives the mutant's table the same result (:func:`differs_in` is None). There the mutant's
    reachable graph is the unmutated one's, which satisfies every property (:func:`reachable_firings`
    checked it), so they are skipped.
    """
    guards = mutation_guards()
    cfgs = configs if configs is not None else (MutationConfig("default", bounds or Bounds(), max_states),)
    for k, (cname, b, cap, exhaustive, cmodes) in enumerate(cfgs):
        for mode in modes if cmodes is None else cmodes:
            if (cname, mode) in same_as_unmutated:
                continue
            m = Model(Config(variant, ranks, mode, channels, b), table=table, guards=guards)
            r = check_mode(m, stop_at_first=True, progress=exhaustive, max_states=cap)
            bad = [n for n, v in r.properties.items() if v == VIOLATED and (k == 0 or n not in SOMETIMES)]
            if bad:
                cx = r.counterexample
                prop = cx["property"] if cx and cx["property"] in bad else bad[0]
                return f"{cname}:{mode.value}:{prop}"
            if not r.complete and exhaustive:
                return f"{cname}:{mode.value}:unbounded (more than {cap} states)"
    return None


class Firings(NamedTuple):
    """Every table lookup the unmutated model made in one configuration and mode: the model (for its
    ``n``, ``K`` and guards) and the ``(vars, event, rank, extra) -> (transition, vars)`` results."""

    config: str
    mode: ModeSetting
    model: Model
    results: dict[tuple[Any, ...], tuple[Any, RankVars]]


def _unmutated_job(
    job: tuple[str, MutationConfig, ModeSetting, bool, str, int],
) -> tuple[str | None, dict[Any, Any]]:
    """Explore the unmutated ``variant`` in one configuration and mode: ``(why it fails or None, every table
    lookup made)``. Progress is checked in exhaustive configurations (as :func:`kills` does for a survivor),
    non-vacuity only in the first configuration."""
    variant, c, mode, first, channels, ranks = job
    m = Model(Config(variant, ranks, mode, channels, c.bounds), guards=mutation_guards())
    r = check_mode(m, progress=c.exhaustive, max_states=c.max_states)
    bad = [n for n, v in r.properties.items() if v == VIOLATED and (first or n not in SOMETIMES)]
    why = None
    if bad:
        why = f"{c.name}:{mode.value}:{bad[0]}"
    elif not r.complete and c.exhaustive:
        why = f"{c.name}:{mode.value}:unbounded (more than {c.max_states} states)"
    return why, dict(m._cache)


def reachable_firings(
    variant: str,
    configs: tuple[MutationConfig, ...] = MUTATION_BOUNDS,
    *,
    ranks: int = 2,
    channels: str = "per-socket",
    workers: int = 1,
) -> list[Firings]:
    """Explore the unmutated ``variant`` under each configuration and mode exactly as :func:`kills`
    does (same caps; the bounded configurations' first ``max_states`` states) and return every table
    lookup made. The model's only use of the table is :meth:`Model.fire`, so these are all the places
    where a mutant can behave differently. The same explorations check the unmutated table (a mutant is
    killed only by what the original does not violate). ``workers`` processes share the (configuration,
    mode) explorations.

    Raises:
        RuntimeError: the unmutated table fails a configuration (naming it, the mode and the property).
    """
    jobs = [
        (variant, c, mode, k == 0, channels, ranks)
        for k, c in enumerate(configs)
        for mode in (c.modes if c.modes is not None else tuple(PauseMode))
    ]
    if workers > 1:
        from weightsync.model.check import worker_context

        with worker_context().Pool(workers) as pool:
            results = pool.map(_unmutated_job, jobs, chunksize=1)
    else:
        results = [_unmutated_job(j) for j in jobs]
    out: list[Firings] = []
    for (_, c, mode, _, _, _), (why, cache) in zip(jobs, results, strict=True):
        if why is not None:
            raise RuntimeError(f"the unmutated {variant} table fails {why}: fix it before mutating")
        m = Model(Config(variant, ranks, mode, channels, c.bounds), guards=mutation_guards())
        out.append(Firings(c.name, mode, m, cache))
    return out


def differs_in(mutant: Table, f: Firings) -> str | None:
    """The first of ``f``'s reachable table lookups where ``mutant`` fires differently from the unmutated
    table (another row, other effects, or other resulting variables), as ``"config:mode: state/event
    args"``; None when there is none (then, by induction over the exploration, the mutant's reachable
    graph under ``f``'s configuration and mode is the unmutated one's)."""
    m = Model(f.model.config, table=mutant, guards=f.model.guards)
    for key, (tr, after) in f.results.items():
        v, event, i, extra = key
        tr2, after2 = m.fire(i, v, event, extra)
        effects = None if tr is None else tr.effects
        effects2 = None if tr2 is None else tr2.effects
        if effects != effects2 or after2 != after:
            args = ", ".join(f"{k}={val}" for k, val in extra)
            return f"{f.config}:{f.mode.value}: rank {i} {v.state.value}/{event.value}({args})"
    return None


def first_difference(mutant: Table, firings: list[Firings]) -> str | None:
    """The first reachable table lookup where ``mutant`` fires differently from the unmutated table
    (:func:`differs_in` over every configuration and mode); None when there is none: then the mutant's
    transition system is identical to the original's under these configurations (an *equivalent* mutant:
    no checker can kill it there)."""
    for f in firings:
        d = differs_in(mutant, f)
        if d is not None:
            return d
    return None


def row_fire_counts(table: Table, firings: list[Firings]) -> dict[tuple[str, str, int], int]:
    """How many distinct reachable lookups selected each row ``(state, event, index)`` of ``table``."""
    counts: dict[tuple[str, str, int], int] = {}
    for f in firings:
        for (v, event, _, _), (tr, _) in f.results.items():
            if tr is None:
                continue
            rows = table.get((v.state, event), ())
            # by value: lookups computed in worker processes come back as copies of the rows
            k = next(j for j, r in enumerate(rows) if r == tr)
            key = (str(v.state.value), str(event.value), k)
            counts[key] = counts.get(key, 0) + 1
    return counts


def classify_survivors(
    variant: str,
    survivors: list[str],
    configs: tuple[MutationConfig, ...] = MUTATION_BOUNDS,
    firings: list[Firings] | None = None,
) -> dict[str, dict[str, Any]]:
    """For each surviving mutant (by :attr:`Mutant.name`): ``equivalent`` (no reachable lookup differs:
    see :func:`first_difference`), ``row_fires`` (reachable lookups that select the mutated row in the
    unmutated model) and ``first_difference`` (None when equivalent). ``firings``: the
    :func:`reachable_firings` of ``configs`` when the caller already has them."""
    if firings is None:
        firings = reachable_firings(variant, configs)
    base = get_variant(variant).table
    counts = row_fire_counts(base, firings)
    wanted = set(survivors)
    out: dict[str, dict[str, Any]] = {}
    for mut, table in mutants(base):
        if mut.name not in wanted:
            continue
        diff = first_difference(table, firings)
        out[mut.name] = {
            "equivalent": diff is None,
            "row_fires": counts.get((mut.state, mut.event, mut.index), 0),
            "first_difference": diff,
        }
    return out


#: Set in the parent before forking the workers of :func:`run_mutation` (shared copy-on-write).
_FIRINGS: list[Firings] | None = None
#: Verdict of a mutant whose transition system equals the unmutated one's (see :func:`first_difference`).
EQUIVALENT = "equivalent"


def _kill_one(job: tuple[str, int, dict[str, Any]]) -> str | None:
    variant, idx, kw = job
    table = next(t for k, (_, t) in enumerate(mutants(get_variant(variant).table)) if k == idx)
    if _FIRINGS is None:
        return kills(variant, table, **kw)
    same = frozenset((f.config, f.mode) for f in _FIRINGS if differs_in(table, f) is None)
    if len(same) == len(_FIRINGS):
        return EQUIVALENT
    return kills(variant, table, same_as_unmutated=same, **kw)


def run_mutation(
    variant: str = "two-phase-epoch",
    *,
    limit: int | None = None,
    every: int = 1,
    workers: int = 1,
    on_result: Callable[[str, str | None], None] | None = None,
    firings: list[Firings] | None = None,
    decided: Mapping[str, str | None] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Check every ``every``-th mutant (at most ``limit``) of ``variant``'s table, in ``workers``
    processes; ``kw`` goes to :func:`kills` (e.g. ``configs=MUTATION_BOUNDS``). ``on_result(name, why)``
    is called as each mutant's verdict arrives (in table order).

    With ``configs`` given, the unmutated model's reachable table lookups are computed first
    (:func:`reachable_firings`) and a mutant that fires identically on all of them is not re-checked: its
    transition system is the original's, so it survives as ``equivalent`` (the unmutated table verifies
    under every configuration; the slow test checks that). ``firings`` passes lookups already computed.
    ``decided``: verdicts already known (by mutant name, from an interrupted run of the same table:
    :func:`read_checkpoint`); those mutants are not re-checked and ``on_result`` is not called for them.

    Returns ``{"mutants": n, "killed": k, "survivors": [names], "killed_by": {name: "config:mode:property"},
    "unbounded": [names], "equivalent": [names], "seconds": wall time}``.
    """
    global _FIRINGS
    t0 = time.perf_counter()
    configs = kw.get("configs")
    if firings is None and configs is not None:  # also checks the unmutated table under every one
        firings = reachable_firings(variant, configs, workers=workers)
    _FIRINGS = firings
    base = get_variant(variant).table
    picked: list[tuple[int, Mutant]] = []
    for idx, (mut, _) in enumerate(mutants(base)):
        if idx % every:
            continue
        if limit is not None and len(picked) >= limit:
            break
        picked.append((idx, mut))
    known = dict(decided or {})
    todo = [(idx, mut) for idx, mut in picked if mut.name not in known]
    jobs = [(variant, idx, kw) for idx, _ in todo]
    verdicts: dict[str, str | None] = {mut.name: known[mut.name] for _, mut in picked if mut.name in known}

    def collect(it: Iterator[str | None]) -> None:
        for (_, mut), why in zip(todo, it, strict=False):
            verdicts[mut.name] = why
            if on_result is not None:
                on_result(mut.name, why)

    try:
        if workers > 1:
            import multiprocessing

            with multiprocessing.get_context("fork").Pool(workers) as pool:
                collect(pool.imap(_kill_one, jobs, chunksize=1))
        else:
            collect(_kill_one(j) for j in jobs)
    finally:
        _FIRINGS = None
    killed_by: dict[str, str] = {}
    survivors: list[str] = []
    equivalent: list[str] = []
    for _, mut in picked:
        why = verdicts[mut.name]
        if why is None or why == EQUIVALENT:
            survivors.append(mut.name)
            if why == EQUIVALENT:
                equivalent.append(mut.name)
        else:
            killed_by[mut.name] = why
    unbounded = [k for k, why in killed_by.items() if "unbounded" in why]
    return {
        "mutants": len(picked),
        "killed": len(killed_by),
        "survivors": survivors,
        "killed_by": killed_by,
        "unbounded": unbounded,
        "equivalent": equivalent,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def read_checkpoint(path: Path, digest: str) -> dict[str, str | None]:
    """The verdicts in checkpoint ``path`` (JSON lines: a header ``{"table_digest": ...}``, then one
    ``{"mutant": name, "why": verdict}`` per checked mutant, appended as they arrive) when its header's
    digest is ``digest``; ``{}`` when the file is missing or belongs to another table. A last line cut
    short by an interrupted run is ignored.

    Raises:
        ValueError: a line other than the last is not JSON.
    """
    if not path.is_file():
        return {}
    lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if not lines or json.loads(lines[0]).get("table_digest") != digest:
        return {}
    out: dict[str, str | None] = {}
    for k, line in enumerate(lines[1:], 2):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if k == len(lines):
                break
            raise ValueError(f"{path}:{k}: not JSON: {exc}") from exc
        out[str(rec["mutant"])] = rec["why"]
    return out


def checkpoint_writer(path: Path, digest: str) -> Callable[[str, str | None], None]:
    """An ``on_result`` that appends each verdict to checkpoint ``path`` (see :func:`read_checkpoint`),
    starting the file with its header unless it already belongs to ``digest``."""
    if not path.is_file() or not _header_is(path, digest):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"table_digest": digest}) + "\n", encoding="utf-8")

    def write(name: str, why: str | None) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"mutant": name, "why": why}) + "\n")

    return write


def _header_is(path: Path, digest: str) -> bool:
    first = path.read_text(encoding="utf-8").splitlines()[:1]
    return bool(first) and json.loads(first[0]).get("table_digest") == digest


#: verdicts of an unfinished run, one JSON line each (:func:`read_checkpoint`); removed by ``--write``
CHECKPOINT_FILE = "mutation.checkpoint.jsonl"


def mutation_digest(variant: str = "two-phase-epoch") -> str:
    """The digest a mutation report is valid for: the mutated variant's table (with its environment flags)
    and the worker table. Other variants do not enter a mutant's model, so adding or changing them leaves
    the report fresh."""
    from weightsync.spec.rank import get_variant
    from weightsync.spec.table import table_digest
    from weightsync.spec.worker import worker_table_digest

    return table_digest((), get_variant(variant).digest(), worker_table_digest())
