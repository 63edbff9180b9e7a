"""``weightsync bench explorer``: explorer throughput and memory, with a baseline measured in the same run.

Figures: states/second and peak memory for two-phase-epoch N=3 (keep mode, safety exploration) and N=4
with symmetry reduction, plus two same-process ratios at N=2: the dict parent-pointer explorer against a
networkx ``DiGraph`` BFS of the same model (an approach measured 3-5x slower and ~10x heavier), and plain
vs symmetry-reduced exploration at N=3.
"""

from __future__ import annotations

import gc
import resource
import time
import tracemalloc
from typing import Any

from weightsync.model.check import explore_model
from weightsync.model.explorer import explore, networkx_bfs
from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.states import PauseMode


def _model(n: int, requests: int = 1) -> Model:
    return Model(Config("two-phase-epoch", n, PauseMode.KEEP, "per-socket", Bounds(requests=requests)))


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


def run_explorer_bench(quick: bool = False) -> dict[str, Any]:
    """Measure the explorer; returns one JSON-able dict (``ok`` is True when every run found no violation).

    ``quick``: N=2 and N=3-with-symmetry only (for tests).
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
    return {
        "bench": "explorer",
        "quick": quick,
        "runs": runs,
        "baseline_networkx": baseline,
        "symmetry_ratio_n3": sym_ratio,
        "peak_rss_mb": round(_rss_mb(), 1),
        "ok": all(not r["violations"] for r in runs),
    }
