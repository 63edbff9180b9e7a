"""``weightsync bench explorer``: explorer throughput and memory, with a baseline measured in the same run.

Figures: the time to verdict of the default variant for N = 2, 3, 4, 6 and 8 ranks, and for N = 4, 6 and 8
again with the silent-wave reduction (every pause mode, each row in a process of its own with a time
budget, naming its reductions, :mod:`weightsync.bench.reach`); states/second and peak
memory for two-phase-epoch N=3 (keep mode, safety exploration) and N=4 with symmetry reduction; plus
same-process ratios: the compact engine (:mod:`weightsync.model.compact`) against the baseline engine (the
model's successor function on state tuples) on two-phase-epoch N=3 without reductions, every pause mode
(``speedup_vs_baseline``: keep's ratio of states per second; the two explore the same states in the same
order); at N=2, the dict parent-pointer explorer against a networkx ``DiGraph`` BFS of the same model (an
approach measured 3-5x slower and ~10x heavier); plain vs symmetry-reduced exploration at N=3; and the
explorer against SPIN on the Promela model generated from the same tables (``spin_vs_compact``: N=2 and
N=3 keep, no reductions, :func:`spin_ratio`).
"""

from __future__ import annotations

import gc
import resource
import time
import tracemalloc
from typing import Any

from weightsync.bench.reach import DEFAULT_VARIANT, ROW_BUDGET_S, reach_rows
from weightsync.model.check import explore_model
from weightsync.model.compact import explore_compact
from weightsync.model.explorer import explore, networkx_bfs
from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.states import PauseMode


def _model(n: int, requests: int = 1, mode: PauseMode = PauseMode.KEEP) -> Model:
    return Model(Config("two-phase-epoch", n, mode, "per-socket", Bounds(requests=requests)))


def engine_ratio(n: int, mode: PauseMode) -> dict[str, Any]:
    """Both engines on two-phase-epoch with ``n`` ranks in ``mode`` (no symmetry, safety exploration) in this
    process, the compact one first (so that the process's peak resident set after each run is that run's,
    the baseline's being the larger): seconds, states per second, peak RSS after each, the ratio of states
    per second, whether the counts and violations agree, and the compact engine's memo figures."""
    figures: dict[str, dict[str, Any]] = {}
    counts = []
    stats: dict[str, Any] = {}
    for engine in ("compact", "baseline"):
        gc.collect()
        m = _model(n, mode=mode)
        t0 = time.perf_counter()
        if engine == "compact":
            ex, eng = explore_compact(m)
            stats = eng.stats()
        else:
            ex = explore_model(m, engine="baseline")
        dt = time.perf_counter() - t0
        counts.append((len(ex.states), ex.transitions, ex.depth, sorted(ex.violations)))
        figures[engine] = {
            "seconds": round(dt, 3),
            "states_per_second": round(len(ex.states) / dt),
            "peak_rss_mb_after": round(_rss_mb(), 1),
        }
        del ex, m
    states, transitions, depth, violations = counts[0]
    return {
        "variant": "two-phase-epoch",
        "ranks": n,
        "mode": mode.value,
        "symmetry": False,
        "states": states,
        "transitions": transitions,
        "depth": depth,
        "violations": violations,
        "same_exploration": counts[0] == counts[1],
        "baseline": figures["baseline"],
        "compact": figures["compact"],
        "speedup": round(
            figures["compact"]["states_per_second"] / figures["baseline"]["states_per_second"], 2
        ),
        "compact_memo": stats,
    }


def spin_ratio(n: int, mode: PauseMode) -> dict[str, Any]:
    """The compact explorer against SPIN on the Promela model generated from the same tables
    (:mod:`weightsync.model.spin`), two-phase-epoch with ``n`` ranks in ``mode``, safety and deadlock, no
    reductions on either side (SPIN's BFS), in this process one after the other: seconds (SPIN's: generating,
    compiling and searching; and its search alone), states, and the ratio of the explorer's seconds to SPIN's.
    ``{"available": False}`` without ``spin`` and ``cc`` on PATH."""
    from weightsync.model.spin.run import spin_available, spin_check

    if not spin_available():
        return {"available": False, "ranks": n, "mode": mode.value}
    gc.collect()
    m = _model(n, mode=mode)
    t0 = time.perf_counter()
    ex = explore_model(m)
    dt = time.perf_counter() - t0
    res = spin_check(_model(n, mode=mode))
    return {
        "available": True,
        "variant": "two-phase-epoch",
        "ranks": n,
        "mode": mode.value,
        "compact_states": len(ex.states),
        "compact_seconds": round(dt, 3),
        "spin_states": res.states,
        "spin_seconds": round(res.seconds, 3),
        "spin_search_seconds": res.search_seconds,
        "spin_verdict": res.verdict,
        "compact_verdict": "counterexample" if ex.violations else "verified",
        "compact_over_spin_seconds": round(dt / res.seconds, 2),
        "compact_over_spin_search_seconds": round(dt / max(res.search_seconds, 1e-3), 2),
    }


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run(n: int, symmetry: bool) -> dict[str, Any]:
    gc.collect()
    m = _model(n)
    t0 = time.perf_counter()
    ex = explore_model(m, symmetry=symmetry)
    dt = time.perf_counter() - t0
    out = {
        "variant": "two-phase-epoch",
        "ranks": n,
        "mode": "keep",
        "symmetry": symmetry,
        "states": len(ex.states),
        "transitions": ex.transitions,
        "seconds": round(dt, 3),
        "states_per_second": round(len(ex.states) / dt),
        "violations": sorted(ex.violations),
        "peak_rss_mb_after": round(_rss_mb(), 1),
    }
    del ex
    gc.collect()
    return out


def _traced(fn: Any) -> tuple[float, int]:
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dt, peak


def run_explorer_bench(quick: bool = False, budget_s: float = ROW_BUDGET_S) -> dict[str, Any]:
    """Measure the explorer; returns one JSON-able dict (``ok`` is True when every run found no violation
    and every time-to-verdict row verified within its budget).

    ``quick``: N=2 and N=3-with-symmetry only (for tests). ``budget_s``: seconds each time-to-verdict row
    (:mod:`weightsync.bench.reach`: N = 2, 3, 4, 6, 8, every mode; quick: 2 and 3) may take: past it the
    row stops exploring and reports ``"incomplete"`` with the BFS levels explored completely
    (``levels_expanded``). ``n3_seconds`` and ``n3_states_per_second`` are the N=3 row's
    (every mode, every property, symmetry). ``speedup_vs_baseline``: :func:`engine_ratio` at N=3 keep (quick:
    N=2), compact over baseline states per second; ``engine_ratios``: every mode's (quick: keep only).
    """
    runs: list[dict[str, Any]] = []
    # baseline ratios at N=2 (same model, same process)
    m2 = _model(2)
    n_states = 0

    def ours() -> None:
        nonlocal n_states
        ex = explore([m2.initial()], m2.successors)
        n_states = len(ex.states)

    def nx_run() -> None:
        g, _ = networkx_bfs([m2.initial()], m2.successors)
        assert g.number_of_nodes() == n_states

    # the engines, same process: N=3 every mode (quick: N=2 keep)
    ratio_rows = [engine_ratio(2, PauseMode.KEEP)] if quick else [engine_ratio(3, m) for m in PauseMode]
    keep_row = next(r for r in ratio_rows if r["mode"] == PauseMode.KEEP.value)
    t_ours, mem_ours = _traced(ours)
    t_nx, mem_nx = _traced(nx_run)
    baseline = {
        "model": "two-phase-epoch N=2 keep per-socket requests=1",
        "states": n_states,
        "dict_bfs_seconds": round(t_ours, 3),
        "networkx_bfs_seconds": round(t_nx, 3),
        "speedup_vs_networkx": round(t_nx / t_ours, 2),
        "dict_bfs_peak_bytes": mem_ours,
        "networkx_peak_bytes": mem_nx,
        "memory_ratio_networkx_over_dict": round(mem_nx / mem_ours, 2),
        "bytes_per_state_dict_bfs": round(mem_ours / max(n_states, 1)),
        "note": "timed under tracemalloc (both sides), so absolute seconds are inflated",
    }
    if quick:
        runs.append(_run(2, False))
        runs.append(_run(3, True))
    else:
        runs.append(_run(3, False))
        runs.append(_run(3, True))
        runs.append(_run(4, True))
    sym_ratio = None
    plain3 = next((r for r in runs if r["ranks"] == 3 and not r["symmetry"]), None)
    sym3 = next((r for r in runs if r["ranks"] == 3 and r["symmetry"]), None)
    if plain3 and sym3:
        sym_ratio = {
            "states_plain_over_symmetric": round(plain3["states"] / sym3["states"], 2),
            "seconds_plain_over_symmetric": round(plain3["seconds"] / sym3["seconds"], 2),
        }
    rows = reach_rows(budget_s, quick=quick)
    spin_rows = (
        [spin_ratio(2, PauseMode.KEEP)]
        if quick
        else [spin_ratio(2, PauseMode.KEEP), spin_ratio(3, PauseMode.KEEP)]
    )
    n3 = next(r for r in rows if r["ranks"] == 3)
    n3_done = n3["verdict"] not in ("timeout", "incomplete")
    return {
        "bench": "explorer",
        "variant": DEFAULT_VARIANT,
        "n3_seconds": n3["seconds"] if n3_done else None,
        "n3_states_per_second": round(n3["states"] / n3["seconds"]) if n3_done else None,
        "speedup_vs_baseline": keep_row["speedup"],
        "speedup_note": f"compact vs baseline engine, states per second, same process: two-phase-epoch "
        f"N={keep_row['ranks']} keep, no symmetry ({keep_row['states']} states); every row in engine_ratios",
        "engine_ratios": ratio_rows,
        "rows": rows,
        "row_budget_s": budget_s,
        "quick": quick,
        "runs": runs,
        "baseline_networkx": baseline,
        "symmetry_ratio_n3": sym_ratio,
        "spin_vs_compact": spin_rows,
        "peak_rss_mb": round(_rss_mb(), 1),
        "ok": all(not r["violations"] for r in runs)
        and all(r["verdict"] == "verified" for r in rows)
        and all(r["same_exploration"] and not r["violations"] for r in ratio_rows)
        and all(not r["available"] or r["spin_verdict"] == r["compact_verdict"] for r in spin_rows),
    }
