"""``weightsync check``: explore a variant's N-rank product and check every named property.

Properties (name -> statement, source) are listed in :data:`PROPERTIES`. Safety properties are checked on
the fly by :func:`weightsync.model.explorer.explore`; progress properties by reverse reachability over the
integer-indexed edge list (every reachable state must be able to reach a goal state; this also catches
livelocks); non-vacuity ("sometimes") properties by witnesses seen while exploring.
With ``symmetry`` on (the default from N=3), states are explored up to permutations of ranks 1..N-1
(:meth:`weightsync.model.system.Model.canon`). Every property here survives that reduction: the invariants,
edge checks, terminal checks, progress goals and witnesses are symmetric (none names a rank other than 0),
and the reduced graph is bisimilar to the full one, so "every reachable state can reach a goal" (a CTL
``AG EF`` property) holds in one iff it holds in the other (Emerson and Sistla, "Symmetry and model
checking", 1996; Ip and Dill, 1996). ``tests/test_model_symmetry.py`` checks the automorphism and compares
reduced and full explorations state for state.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weightsync.model.compact import DecodedStates
from weightsync.model.counterexample import concrete_path as concrete_path
from weightsync.model.counterexample import counterexample_record as counterexample_record
from weightsync.model.counterexample import violation_text as violation_text
from weightsync.model.engines import DEFAULT_ENGINE as DEFAULT_ENGINE
from weightsync.model.engines import ENGINES as ENGINES
from weightsync.model.engines import explore_model as explore_model
from weightsync.model.explorer import (
    Exploration,
    Violation,
    build_reverse_csr,
    reverse_reachable_csr,
)
from weightsync.model.properties import (
    HOLDS,
    NOT_CHECKED,
    PRIORITY,
    PROGRESS,
    PROPERTIES,
    SAFETY,
    SOMETIMES,
    VIOLATED,
)
from weightsync.model.stalls import CLIENT_TRAFFIC as CLIENT_TRAFFIC
from weightsync.model.stalls import stranded_counts as stranded_counts
from weightsync.model.system import Bounds, Config, G, Model
from weightsync.model.system.state import ANY_MODE, ModeSetting
from weightsync.spec.states import PauseMode

#: Submission order of the pause modes' explorations (keep's state space is the largest).
_MODE_WEIGHT: dict[ModeSetting, int] = {
    ANY_MODE: -1,
    PauseMode.KEEP: 0,
    PauseMode.WAIT: 1,
    PauseMode.ABORT: 2,
}


def mode_setting(mode: ModeSetting | str) -> ModeSetting:
    """A pause mode, or :data:`ANY_MODE` for ``"any"`` (the controller picks the mode at each pause).

    Raises:
        ValueError: ``mode`` is neither."""
    return ANY_MODE if mode in (ANY_MODE, ANY_MODE.value) else PauseMode(mode)


@dataclass
class ModeResult:
    """The check of one pause mode.

    Attributes:
        mode: the pause mode.
        states, transitions, depth, seconds: exploration figures (depth: BFS levels, TLC convention).
        properties: name -> holds / violated / not checked.
        counterexample: the shortest violation's record (see :func:`counterexample_record`), or None.
        complete: False if ``max_states`` or the deadline stopped the exploration.
        levels_expanded: BFS levels explored completely (:attr:`Exploration.levels_expanded`): ``depth``
            when ``complete``.
        model, exploration: kept when asked (``keep=True``) for export / replay.
        peak_rss_mb: peak resident set (MB) of the process that checked the mode, when it finished (a
            worker's own: :func:`_peak_rss_mb` in the caller cannot see a forkserver's children).
        omission_bound: 0 for an exhaustive search; SPIN with hash-compact storage: a bound on the
            probability that a reachable state was left out (:func:`weightsync.model.spin.run.omission_bound`).
    """

    mode: ModeSetting
    states: int
    transitions: int
    depth: int
    seconds: float
    properties: dict[str, str]
    counterexample: dict[str, Any] | None
    complete: bool
    model: Model | None = None
    exploration: Exploration[G] | None = field(default=None, repr=False)
    violation_depths: dict[str, int] = field(default_factory=dict)
    stranded: dict[str, int] | None = None
    peak_rss_mb: float = 0.0
    levels_expanded: int = 0
    omission_bound: float = 0.0


def build_model(
    variant: str,
    ranks: int,
    mode: ModeSetting | str = PauseMode.KEEP,
    channels: str = "per-socket",
    bounds: Bounds | None = None,
    **model_kwargs: Any,
) -> Model:
    """The model of ``variant`` with ``ranks`` DP ranks, one pause mode, channel semantics and bounds."""
    return Model(Config(variant, ranks, mode_setting(mode), channels, bounds or Bounds()), **model_kwargs)


def check_mode(
    model: Model,
    *,
    symmetry: bool = False,
    progress: bool = True,
    max_states: int = 20_000_000,
    stop_at_first: bool = False,
    keep: bool = False,
    keep_labels: bool = False,
    stalls: bool = False,
    counterexample_of: str | None = None,
    engine: str = DEFAULT_ENGINE,
    deadline: float | None = None,
) -> ModeResult:
    """Explore ``model`` exhaustively and check every property of :data:`PROPERTIES`; with ``stalls``, also
    classify the states in which a rank waits in a DP collective (:func:`stranded_counts`).

    ``stop_at_first`` stops the exploration at the first safety violation; the progress properties are
    then checked only when it completed without one (one exploration serves both, as the mutation
    analysis needs for a mutant that survives). ``counterexample_of``: report the shortest counterexample
    of this property where it is violated, instead of the most specific one (``PRIORITY``). ``engine``: see
    :func:`explore_model`. ``deadline``: stop exploring once ``time.time()`` passes it (epoch seconds); the
    result is then incomplete and ``levels_expanded`` says how deep it was complete."""
    t0 = time.perf_counter()
    keep_labels = keep_labels or stalls
    # progress (AG EF) is checked on the unreduced or the symmetry-reduced graph only (issue 19 item 2)
    do_progress = progress and not model.silent_waves
    ex = explore_model(
        model,
        symmetry=symmetry,
        keep_edges=do_progress or keep_labels,
        keep_labels=keep_labels,
        max_states=max_states,
        stop_at_first=stop_at_first,
        engine=engine,
        deadline=deadline,
    )
    props: dict[str, str] = {}
    complete = ex.complete
    for name in SAFETY:
        if name in ex.violations:
            props[name] = VIOLATED
        else:
            props[name] = HOLDS if complete else NOT_CHECKED
    if (
        do_progress
        and complete
        and not (stop_at_first and ex.violations)
        and ex.src is not None
        and ex.dst is not None
    ):
        _progress(model, ex, props)
    else:
        for name in PROGRESS:
            props[name] = NOT_CHECKED
    wit: dict[str, bool | None] = {
        "sometimes_all_verified": model.seen_all_verified,
        "sometimes_update_with_wave_in_flight": model.seen_update_with_wave_in_flight,
    }
    if model.silent_waves:  # the reduction removes START_DP_WAVE messages this witness looks for
        wit["sometimes_update_with_wave_in_flight"] = wit["sometimes_update_with_wave_in_flight"] or None
    for name, seen in wit.items():
        props[name] = HOLDS if seen else (VIOLATED if complete and seen is not None else NOT_CHECKED)
    cx = None
    if ex.violations:
        # The most specific diagnosis first (PRIORITY: mismatched collectives, one-sided collective,
        # deadlock, quiescence, ...; safety before progress), the shortest path for that property.
        v = min(
            ex.violations.values(),
            key=lambda v: (v.property != counterexample_of, PRIORITY[v.property], _vdepth(ex, v)),
        )
        cx = counterexample_record(model, ex, v, symmetry=symmetry)
    elif VIOLATED in props.values():
        name = next(n for n in SOMETIMES if props[n] == VIOLATED)
        cx = {
            "property": name,
            "mode": model.mode.value,
            "steps": [],
            "records": [],
            "note": "no reachable state or transition witnesses this; the check would be vacuous",
        }
    stranded = stranded_counts(ex) if stalls and complete else None
    seconds = time.perf_counter() - t0
    return ModeResult(
        model.mode,
        len(ex.states),
        ex.transitions,
        ex.depth,
        seconds,
        props,
        cx,
        complete,
        model if keep else None,
        ex if keep else None,
        {name: _vdepth(ex, v) for name, v in ex.violations.items()},
        stranded,
        _peak_rss_mb(),
        ex.levels_expanded,
    )


def _vdepth(ex: Exploration[G], v: Violation) -> int:
    return int(ex.level[v.state]) + (1 if v.label is not None else 0)


def _progress(model: Model, ex: Exploration[G], props: dict[str, str]) -> None:
    """Reverse reachability from each progress goal over the int-indexed edges."""
    assert ex.src is not None and ex.dst is not None
    n = len(ex.states)
    start, rev = build_reverse_csr(n, ex.src, ex.dst)
    bad_states = {v.state for v in ex.violations.values() if v.label is None}
    goals = {
        "progress_pause": model.goal_pause,
        "progress_resume": model.goal_resume,
        "progress_requests": model.goal_requests,
        "progress_run": model.goal_run,
    }
    states = ex.states
    # the goals read the controller, trainer, front-end and requests, and each rank's status
    founds: list[list[int]] = (
        states.where_by_statuses(list(goals.values()))
        if isinstance(states, DecodedStates)
        else [[i for i, s in enumerate(states) if goal(s)] for goal in goals.values()]
    )
    for name, found in zip(goals, founds, strict=True):
        ok = reverse_reachable_csr(n, start, rev, found)
        stuck = next((i for i in range(n) if not ok[i] and i not in bad_states), None)
        if stuck is None:
            props[name] = HOLDS
        else:
            props[name] = VIOLATED
            ex.violations[name] = Violation(name, stuck)


def _peak_rss_mb() -> float:
    """Peak resident set of this process or of its largest child process that has been waited for (MB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0


def worker_context() -> multiprocessing.context.BaseContext:
    """Worker processes start from a fresh forkserver (with the model preloaded), never by forking the
    caller: a caller that has started threads (torch, gloo, vLLM in a test session) can crash a forked
    child (a segfault seen in the default suite)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["weightsync.model.check", "weightsync.model.mutation"])
    return ctx


def default_symmetry(ranks: int) -> bool:
    """Symmetry reduction is on by default from N=3 (at N=2 there is nothing to permute)."""
    return ranks >= 3


#: The engines of ``weightsync check``: the explorer's (:data:`ENGINES`) and SPIN on the Promela model
#: generated from the same tables (:mod:`weightsync.model.spin`; safety and deadlock only).
CHECK_ENGINES = (*ENGINES, "spin")


def _check_one(
    args: tuple[
        str,
        int,
        ModeSetting,
        str,
        Bounds,
        bool,
        int,
        bool,
        bool,
        str | None,
        str,
        float | None,
        dict[str, Any],
        bool,
    ],
) -> ModeResult:
    (
        variant,
        ranks,
        mode,
        channels,
        bounds,
        symmetry,
        max_states,
        progress,
        stalls,
        of,
        engine,
        deadline,
        spin,
        silent_waves,
    ) = args
    if engine == "spin":
        from weightsync.model.spin.mode import spin_mode

        return spin_mode(build_model(variant, ranks, mode, channels, bounds, silent_waves=silent_waves), spin)
    return check_mode(
        build_model(variant, ranks, mode, channels, bounds, silent_waves=silent_waves),
        symmetry=symmetry,
        max_states=max_states,
        progress=progress,
        stalls=stalls,
        counterexample_of=of,
        engine=engine,
        deadline=deadline,
    )


def check(
    variant: str,
    ranks: int,
    *,
    mode: str = "all",
    channels: str = "per-socket",
    bounds: Bounds | None = None,
    symmetry: bool | None = None,
    max_states: int = 20_000_000,
    progress: bool = True,
    workers: int | None = None,
    stalls: bool = False,
    counterexample_of: str | None = None,
    engine: str = DEFAULT_ENGINE,
    deadline: float | None = None,
    spin: dict[str, Any] | None = None,
    silent_waves: bool = False,
) -> dict[str, Any]:
    """Run ``weightsync check`` and return its JSON object (the keys below).

    ``symmetry`` None: :func:`default_symmetry`. ``workers``: processes exploring the pause modes in
    parallel (each mode is an independent exploration); None: one per mode, at most the CPU count (with a
    ``deadline``: one per mode).
    ``counterexample_of``: the property whose counterexample to report where it is violated (default: the
    most specific violation, ``PRIORITY``). ``engine``: the exploration engine (:func:`explore_model`; both
    give the same figures and verdicts), or ``"spin"`` (:func:`weightsync.model.spin.mode.spin_mode`: safety and deadlock, no symmetry;
    ``spin``: keyword arguments of :func:`weightsync.model.spin.run.spin_check`). ``deadline``: every mode stops exploring once ``time.time()``
    passes it (epoch seconds). ``silent_waves``: the silent-wave reduction
    (:mod:`weightsync.model.system.reduction`: safety and deadlock; progress is then not checked), with
    either engine (SPIN's: :mod:`weightsync.model.spin.quiet`).

    Raises:
        ValueError: ``workers`` < 1, ``counterexample_of`` names no property, or ``engine`` no engine.
        UnsupportedModel: ``silent_waves`` with the SPIN engine under ``ordered`` channels.

    Keys: variant, ranks, verdict ("verified" | "counterexample" | "incomplete"), states, transitions
    (summed over modes), depth (max), seconds, symmetry, reductions (names), properties, bounds, channels, mode, per_mode,
    peak_rss_mb (the largest process's peak: this one's or a worker's), and for a violation
    ``counterexample {property, mode, steps, records, labels}``. An incomplete run (``max_states`` or
    ``deadline``) also has ``levels_expanded``: the fewest BFS levels any mode explored completely, so that
    every state within that many steps of the initial state, in every mode, was expanded and checked (a
    bounded verdict); each mode's is in ``per_mode``. SPIN with hash-compact storage (``spin={"hash_compact":
    True}``) adds ``storage: "hash-compact"``, ``omission_bound`` and ``hash_seed``: its verdict is not
    exhaustive, ``omission_bound`` bounds the probability that a reachable state was left out, and
    ``hash_seed`` (pan's ``-h``) names the signature function, so two seeds' counts can be compared.
    """
    b = bounds or Bounds()
    modes: list[ModeSetting] = list(PauseMode) if mode == "all" else [mode_setting(mode)]
    sym = default_symmetry(ranks) if symmetry is None else symmetry
    if counterexample_of is not None and counterexample_of not in PROPERTIES:
        raise ValueError(
            f"counterexample_of={counterexample_of!r}: no such property; known: {', '.join(PROPERTIES)}"
        )
    if engine not in CHECK_ENGINES:
        raise ValueError(f"engine={engine!r}: known engines are {', '.join(CHECK_ENGINES)}")
    if engine == "spin":
        sym = False  # SPIN explores the full product (its partial-order reduction, no symmetry)
    jobs = [
        (
            variant,
            ranks,
            m,
            channels,
            b,
            sym,
            max_states,
            progress,
            stalls,
            counterexample_of,
            engine,
            deadline,
            spin or {},
            silent_waves,
        )
        for m in modes
    ]
    # Under a deadline every mode explores at once (sharing the CPUs), so that none starts when the others
    # have used the time up and the bounded verdict (the fewest levels any mode expanded) is not one mode's.
    cpus = len(jobs) if deadline is not None else os.cpu_count() or 1
    n_workers = min(len(jobs), cpus) if workers is None else workers
    if n_workers < 1:
        raise ValueError(f"workers={n_workers}: need at least one process")
    t0 = time.perf_counter()
    if n_workers == 1 or len(jobs) == 1:
        results = [_check_one(j) for j in jobs]
    else:
        # The largest exploration first, so the others share the remaining processes.
        order = sorted(range(len(jobs)), key=lambda k: _MODE_WEIGHT[jobs[k][2]])
        ctx = worker_context()
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx) as pool:
            futures = {k: pool.submit(_check_one, jobs[k]) for k in order}
            results = [futures[k].result() for k in range(len(jobs))]
    props: dict[str, str] = {}
    for name in PROPERTIES:
        vals = [r.properties[name] for r in results]
        props[name] = (
            VIOLATED if VIOLATED in vals else (HOLDS if all(x == HOLDS for x in vals) else NOT_CHECKED)
        )
    cxs = [r.counterexample for r in results if r.counterexample is not None]
    complete = all(r.complete for r in results)
    if cxs:
        verdict = "counterexample"
    elif not complete:
        verdict = "incomplete"
    else:
        verdict = "verified"
    out: dict[str, Any] = {
        "variant": variant,
        "ranks": ranks,
        "verdict": verdict,
        "states": sum(r.states for r in results),
        "transitions": sum(r.transitions for r in results),
        "depth": max(r.depth for r in results),
        "seconds": round(time.perf_counter() - t0, 3),
        "symmetry": sym,
        "reductions": [*(["symmetry"] if sym else []), *(["silent-waves"] if silent_waves else [])],
        "engine": engine,
        "workers": n_workers,
        "properties": props,
        "bounds": b._asdict(),
        "channels": channels,
        "mode": mode,
        "complete": complete,
        "peak_rss_mb": round(max(_peak_rss_mb(), *(r.peak_rss_mb for r in results)), 1),
        "per_mode": {
            r.mode.value: {
                "states": r.states,
                "transitions": r.transitions,
                "depth": r.depth,
                "seconds": round(r.seconds, 3),
                "peak_rss_mb": round(r.peak_rss_mb, 1),
                "levels_expanded": r.levels_expanded,
                "verdict": "counterexample"
                if r.counterexample
                else ("verified" if r.complete else "incomplete"),
            }
            | ({"stranded": r.stranded} if r.stranded is not None else {})
            for r in results
        },
    }
    if any(r.omission_bound for r in results):  # SPIN's hash-compact storage: not exhaustive
        out["storage"] = "hash-compact"
        out["omission_bound"] = sum(r.omission_bound for r in results)
        out["hash_seed"] = (spin or {}).get("hash_seed", 0)  # pan's -h: the signature function
    if not complete:
        out["levels_expanded"] = min(r.levels_expanded for r in results)
    if stalls:
        out["stranded"] = {
            k: sum((r.stranded or {}).get(k, 0) for r in results) for k in ("transient", "stall", "hang")
        }
    if cxs:
        out["counterexample"] = min(
            cxs, key=lambda c: (c["property"] != counterexample_of, PRIORITY[c["property"]], len(c["steps"]))
        )
        out["violations"] = {r.mode.value: r.violation_depths for r in results if r.violation_depths}
    return out
