"""Time to verdict as the number of DP ranks grows (``weightsync bench explorer``, issue 19 item 5).

Each row is one ``weightsync check`` of the default variant (``two-phase-epoch``, per-socket channels,
default :class:`~weightsync.model.system.Bounds`) in every pause mode, run in a fresh process so that its
peak resident memory is its own (``ru_maxrss`` of that process, bytes). A row stops exploring when
:data:`DEADLINE_SHARE` of its time budget has passed and reports ``verdict: "incomplete"`` with
``levels_expanded``, the BFS levels every mode explored completely (a bounded verdict: every state within
that many steps of the initial state was expanded and checked); a row whose process has not answered
:data:`GRACE_S` seconds after its budget is stopped (SIGKILL) and reported as ``verdict: "timeout"``. A row reports what the checker ran: the engine, the reductions (``symmetry``: rank
permutations of ranks 1..N-1, :meth:`~weightsync.model.system.Model.canon`), the properties (safety and
deadlock always; progress, on the unreduced or symmetry-reduced graph, where the row asks for it) and the
bounds.

The child sends its figures back as JSON bytes over a pipe (``Connection.send_bytes``), never a pickle.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import resource
import signal
import time
from typing import Any

from weightsync.model.check import check, worker_context
from weightsync.model.engines import DEFAULT_ENGINE
from weightsync.model.system import Bounds

#: the default variant of ``weightsync check``
DEFAULT_VARIANT = "two-phase-epoch"
#: (ranks, progress, silent_waves) of the full run: progress where the issue asks for it (N <= 4), safety
#: and deadlock beyond; the safety-and-deadlock rows again with the silent-wave reduction
#: (:mod:`weightsync.model.system.reduction`)
FULL_ROWS: tuple[tuple[int, bool, bool], ...] = (
    (2, True, False),
    (3, True, False),
    (4, True, False),
    (6, False, False),
    (8, False, False),
    (4, False, True),
    (6, False, True),
    (8, False, True),
)
QUICK_ROWS: tuple[tuple[int, bool, bool], ...] = ((2, True, False), (3, True, False), (3, False, True))


#: the engine of every row: this package's explicit-state breadth-first explorer with the compact successor
#: function (:mod:`weightsync.model.compact`, ``weightsync check --engine compact``)
ENGINE = DEFAULT_ENGINE
#: the share of a row's budget after which its exploration stops (the rest: its workers' start, the checks
#: after the exploration, the result)
DEADLINE_SHARE = 0.9
#: seconds past its budget a row's process may take before it is stopped
GRACE_S = 60.0
#: the default budget of a row, seconds: issue 19's limit for N = 8 (safety and deadlock verified within
#: 30 minutes); a row that verifies sooner takes only its own time (N = 8: 1385 s measured, 2026-12-06)
ROW_BUDGET_S = 1800.0


def _row_child(
    conn: Any,
    ranks: int,
    progress: bool,
    workers: int | None,
    max_states: int,
    deadline: float,
    silent_waves: bool,
) -> None:
    """In the row's own process (a process group of its own, so that a timeout stops any worker it
    started): run the check, its exploration stopped at ``deadline`` (``time.time()``), and send its
    figures as JSON bytes."""
    os.setpgrp()
    t0 = time.perf_counter()
    out = check(
        DEFAULT_VARIANT,
        ranks,
        mode="all",
        symmetry=ranks >= 3,
        progress=progress,
        workers=workers,
        max_states=max_states,
        engine=ENGINE,
        deadline=deadline,
        silent_waves=silent_waves,
    )
    # the largest process's peak: this one's, or a worker's as it reported it (``check``'s peak_rss_mb)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, out["peak_rss_mb"] * 2**20)
    row = {
        "workers": out["workers"],
        "verdict": out["verdict"],
        "states": out["states"],
        "transitions": out["transitions"],
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_bytes": int(peak),
        "depth": out["depth"],
        "levels_expanded": out.get("levels_expanded", out["depth"]),
    }
    conn.send_bytes(json.dumps(row).encode())
    conn.close()


def time_to_verdict(
    ranks: int,
    *,
    progress: bool,
    budget_s: float,
    workers: int | None = None,
    max_states: int = 100_000_000,
    silent_waves: bool = False,
) -> dict[str, Any]:
    """One row: ``weightsync check`` of the default variant with ``ranks`` ranks, every pause mode (the
    modes explored in ``workers`` processes, None: as ``weightsync check`` does by default, one per mode up
    to the CPU count; 1: one after another in the row's process), in a process of its own, its exploration
    stopped after :data:`DEADLINE_SHARE` of ``budget_s`` seconds, the process after ``budget_s`` +
    :data:`GRACE_S`. ``silent_waves``: with the silent-wave reduction (safety and deadlock only).

    Returns ``ranks``, ``engine``, ``reductions`` (list of names), ``bounds`` (dict), ``properties`` (the
    property classes asked for), ``verdict`` ("verified", "counterexample", "incomplete" when
    ``max_states`` or the deadline stopped it, "timeout" when the process did not answer), ``states`` (None
    on a timeout), ``depth`` and ``levels_expanded`` (BFS levels, and those every mode explored
    completely: ``depth`` when verified; None on a timeout),
    ``seconds`` (wall, seconds), ``peak_rss_bytes`` (the largest process's peak, the row's or a worker's,
    bytes; None on a timeout), ``workers`` (as asked; the number used once the row finished).

    Raises:
        ValueError: ``ranks`` < 2 or ``budget_s`` not > 0.
        RuntimeError: the row's process died without a result before its budget ran out.
    """
    if ranks < 2:
        raise ValueError(f"time_to_verdict: ranks must be >= 2, got {ranks}")
    if not budget_s > 0:
        raise ValueError(f"time_to_verdict: budget_s must be > 0 seconds, got {budget_s!r}")
    ctx: multiprocessing.context.BaseContext = worker_context()
    ours, theirs = multiprocessing.Pipe(duplex=False)
    proc = ctx.Process(  # type: ignore[attr-defined]
        target=_row_child,
        args=(
            theirs,
            ranks,
            progress,
            workers,
            max_states,
            time.time() + DEADLINE_SHARE * budget_s,
            silent_waves,
        ),
        daemon=False,
    )
    t0 = time.perf_counter()
    proc.start()
    theirs.close()
    base: dict[str, Any] = {
        "ranks": ranks,
        "engine": ENGINE,
        "reductions": (["symmetry"] if ranks >= 3 else []) + (["silent-waves"] if silent_waves else []),
        "bounds": Bounds()._asdict(),
        "properties": ["safety", "deadlock"] + (["progress"] if progress else []),
        "workers": workers,
    }
    try:
        if ours.poll(budget_s + GRACE_S):
            try:
                row = json.loads(ours.recv_bytes().decode())
            except EOFError:  # the child closed the pipe by dying before it sent anything
                proc.join(30)
                raise RuntimeError(
                    f"bench explorer: the N={ranks} row's process exited with code {proc.exitcode} and no result"
                ) from None
            proc.join(30)
            return base | {
                "workers": row["workers"],
                "verdict": row["verdict"],
                "states": row["states"],
                "transitions": row["transitions"],
                "seconds": row["seconds"],
                "peak_rss_bytes": row["peak_rss_bytes"],
                "depth": row["depth"],
                "levels_expanded": row["levels_expanded"],
            }
        if not proc.is_alive():
            raise RuntimeError(
                f"bench explorer: the N={ranks} row's process exited with code {proc.exitcode} and no result"
            )
        return base | {
            "verdict": "timeout",
            "states": None,
            "transitions": None,
            "depth": None,
            "levels_expanded": None,
            "seconds": round(time.perf_counter() - t0, 3),
            "peak_rss_bytes": None,
            "budget_s": budget_s,
        }
    finally:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join(30)
        ours.close()


def reach_rows(budget_s: float, quick: bool = False) -> list[dict[str, Any]]:
    """Every row of :data:`FULL_ROWS` (``quick``: :data:`QUICK_ROWS`), each with ``budget_s`` seconds."""
    rows = QUICK_ROWS if quick else FULL_ROWS
    return [time_to_verdict(n, progress=p, budget_s=budget_s, silent_waves=w) for n, p, w in rows]


__all__ = [
    "DEADLINE_SHARE",
    "DEFAULT_VARIANT",
    "ENGINE",
    "FULL_ROWS",
    "GRACE_S",
    "QUICK_ROWS",
    "reach_rows",
    "time_to_verdict",
]
