"""Run SPIN on the generated Promela model (:class:`~weightsync.model.spin.compose.PromelaModel`) and check its
verdict with our own model: SPIN's trail is replayed on :meth:`Model.successors`, label by label, and the
violation SPIN names is confirmed on the replayed path by :class:`~weightsync.model.system.properties.
Properties` (a trail that is no path of the model, or a violation the model does not confirm, is an error).

SPIN (Debian package ``spin``) and a C compiler (``cc``) must be on ``PATH``. The verifier is compiled with
``-DSAFETY`` (safety and deadlock: assertions and the terminal check; no never claim) and breadth-first
search (``-DBFS``: a trail is a shortest counterexample, as the Python explorer's), or depth-first search
with SPIN's partial-order reduction and ``-DNCORE`` workers (``search="dfs"``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.model.spin.compose import CAP, PromelaModel
from weightsync.model.system import G, Label, Model, describe
from weightsync.model.system.premise import ReductionPremiseError

#: pan's figures, parsed from its report (:func:`pan_report`). pan prints a count of 10^8 or more in
#: ``%g`` form with 8 significant digits (``1.6624468e+08 states, stored``), and a multi-core run's elapsed
#: time as ``cpu0: elapsed time``.
_FIGURES = {
    "states": re.compile(r"^\s*([\d.]+(?:e\+\d+)?) states, stored", re.M),
    "transitions": re.compile(r"^\s*([\d.]+(?:e\+\d+)?) transitions \(= stored\+matched\)", re.M),
    "depth": re.compile(r"depth reached (\d+)"),
    "errors": re.compile(r"errors: (\d+)"),
    "memory_mb": re.compile(r"^\s*([\d.]+)\s+total actual memory usage", re.M),
    "search_seconds": re.compile(r"(?:pan|cpu0): elapsed time ([\d.e+]+) seconds"),
}


class SpinError(RuntimeError):
    """SPIN or the C compiler is missing or failed, or SPIN's trail does not replay on the model (the
    message names the step and what the model offers there)."""


@dataclass
class SpinResult:
    """One SPIN run of one model.

    Attributes:
        verdict: "verified" or "counterexample" (safety and deadlock only).
        states, transitions, depth: pan's figures (``states`` counts SPIN's pre-init state too: the
            model's count + 1).
        seconds: generation, compilation and search, wall clock.
        memory_mb: pan's total memory.
        search_seconds: pan's search alone (its ``elapsed time``).
        violation: the property SPIN reports violated (None when verified).
        labels: the trail as the model's labels.
        path: the trail replayed on the model, ``(state, label, next_state)``.
        pan_output: pan's report.
        omission_bound: 0 for exhaustive storage; with hash compaction, a bound on the probability that a
            reachable state was left out (:func:`omission_bound`).
    """

    verdict: str
    states: int
    transitions: int
    depth: int
    seconds: float
    memory_mb: float
    violation: str | None = None
    labels: list[Label] = field(default_factory=list)
    path: list[tuple[G, Label, G]] = field(default_factory=list)
    pan_output: str = ""
    fifo_capacity: int = CAP
    search_seconds: float = 0.0
    omission_bound: float = 0.0


def spin_available() -> bool:
    """SPIN and a C compiler are on PATH."""
    return shutil.which("spin") is not None and shutil.which("cc") is not None


def pan_report(out: str) -> SpinResult:
    """pan's report ``out`` as a :class:`SpinResult` (verdict and figures; ``seconds`` 0).

    Raises:
        SpinError: no report (pan failed to start, e.g. over its memory limit), or pan stopped before the
            end of the search (its depth bound or its memory)."""
    figs = {k: rx.search(out) for k, rx in _FIGURES.items()}
    if figs["states"] is None or figs["errors"] is None:
        raise SpinError(f"pan gave no report: {out[-2000:]}")
    if "max search depth too small" in out or "out of memory" in out.lower() or "MEMLIM bound" in out:
        raise SpinError(f"pan stopped before the end (search depth or memory): {out[-1500:]}")
    errors = int(figs["errors"].group(1))
    return SpinResult(
        verdict="counterexample" if errors else "verified",
        states=_count(figs["states"].group(1)),
        transitions=_count(figs["transitions"].group(1)) if figs["transitions"] else 0,
        depth=int(figs["depth"].group(1)) if figs["depth"] else 0,
        seconds=0.0,
        memory_mb=float(figs["memory_mb"].group(1)) if figs["memory_mb"] else 0.0,
        search_seconds=float(figs["search_seconds"].group(1)) if figs["search_seconds"] else 0.0,
        pan_output=out,
    )


def _count(text: str) -> int:
    """A count in pan's report: ``89598``, or ``1.6624468e+08`` (8 significant digits) from 10^8 on where
    :func:`_exact_counts` did not apply."""
    return int(text) if text.isdigit() else round(float(text))


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise SpinError(f"{cmd[0]} is not installed: {exc} (apt-get install spin gcc)") from exc
    except subprocess.TimeoutExpired as exc:
        raise SpinError(f"{' '.join(cmd)} ran past {timeout:.0f} s") from exc
    if p.returncode < 0:  # killed by a signal: pan's report, if any, is cut short
        raise SpinError(
            f"{' '.join(cmd)} was killed by signal {-p.returncode}: {(p.stdout + p.stderr)[-1500:]}"
        )
    if p.returncode != 0 and cmd[0] != "./pan":
        raise SpinError(f"{' '.join(cmd)} failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    return p.stdout + p.stderr


class CapacityError(SpinError):
    """A FIFO of the Promela model outgrew its capacity (the model's FIFOs are unbounded): no verdict."""

    def __init__(self, capacity: int, moves: int) -> None:
        super().__init__(
            f"a FIFO outgrew the Promela model's capacity of {capacity} messages after {moves} moves (the "
            "model's FIFOs are unbounded): no verdict; rerun with a larger fifo_capacity"
        )
        self.capacity = capacity


#: The largest FIFO capacity :func:`spin_check` doubles up to.
MAX_CAPACITY = 64


def spin_check(model: Model, *, fifo_capacity: int | None = None, **kwargs: Any) -> SpinResult:
    """:func:`spin_once` with FIFOs of ``fifo_capacity`` slots, or (None) of 8 slots doubled after each run a
    full FIFO stopped, up to :data:`MAX_CAPACITY`: a verdict only ever comes from a run in which no FIFO
    overflowed, so it is the unbounded model's. ``kwargs``: :func:`spin_once`'s.

    Raises:
        CapacityError: a FIFO outgrew ``fifo_capacity`` (or :data:`MAX_CAPACITY`); others as
            :func:`spin_once`."""
    cap = CAP if fifo_capacity is None else fifo_capacity
    while True:
        try:
            res = spin_once(model, fifo_capacity=cap, **kwargs)
        except CapacityError:
            if fifo_capacity is not None or cap * 2 > MAX_CAPACITY:
                raise
            cap *= 2
            continue
        res.fifo_capacity = cap
        return res


def spin_once(
    model: Model,
    *,
    search: str = "bfs",
    checks: bool = True,
    max_depth: int = 10_000_000,
    hash_bits: int = 22,
    cores: int = 1,
    fifo_capacity: int = CAP,
    optimize: int = 2,
    hash_compact: bool = False,
    hash_seed: int = 0,
    memory_limit_mb: int | None = None,
    timeout: float = 3600.0,
    workdir: Path | None = None,
) -> SpinResult:
    """Verify ``model`` (safety and deadlock) with SPIN, and replay a counterexample on the model.

    Args:
        model: the model (its configuration must be one :class:`PromelaModel` covers).
        search: "bfs" (shortest trail, no reduction) or "dfs" (SPIN's partial-order reduction on, ``cores``
            worker processes with ``-DNCORE``).
        checks: False: the successor function alone (state counting; the verdict is then "verified").
        max_depth: pan's ``-m`` (search depth bound; DFS stack).
        hash_bits: pan's ``-w`` (log2 of the hash table's slots).
        cores: DFS worker processes (``-DNCORE``; 1: none).
        fifo_capacity: slots of each FIFO in the Promela model.
        optimize: the C compiler's ``-O`` level for ``pan`` (0-3). ``pan.c`` is about 1.5 MB for N = 2:
            ``-O2`` compiles it in about 10 s, ``-O1`` in 4.7 s and ``-O0`` in 2.4 s, while ``-O0``'s search
            is about 2.3x slower (``vllm-0.32-epoch`` N = 2 keep, 44,383 states) and ``-O1``'s within 4% of
            ``-O2``'s (N = 3, 4.16 M states; both measured on the 2-core machine, 2026-12-07).
        hash_compact: store each state as 12 bytes of its hash (pan's ``-DHC4``: the 64-bit ``K1`` and 32
            bits of ``K2`` of pan's 64-bit ``d_hash``, pan.c ``compress``; :func:`_wide_hash`) instead of
            the whole state vector. Not exhaustive: two states whose 96-bit signatures are equal count as
            one, so a reachable state may be left out; :attr:`SpinResult.omission_bound` bounds the
            probability. About 40 bytes a state in all, where exact storage takes the vector (hundreds of
            bytes) and more.
        hash_seed: pan's ``-h``: which of its 500 hash seeds (``HASH_CONST``) the hash starts from. Under
            hash compaction another seed is another signature function, so two runs whose state counts
            agree are independent evidence that neither left a state out.
        memory_limit_mb: pan's ``-DMEMLIM`` (MB; None: pan's default); a run that reaches it stops with
            :class:`SpinError`, never a verdict.
        timeout: seconds for each of SPIN, the compiler and pan.
        workdir: keep the files there (default: a temporary directory, removed).

    Raises:
        UnsupportedModel: a table names an effect the generator does not know (named).
        SpinError: SPIN or the compiler is missing or failed, pan stopped early (search depth or memory),
            or the trail does not replay on the model.
        ValueError: an unknown ``search``, ``optimize`` outside 0-3, or ``hash_seed`` outside 0-499.
    """
    if search not in ("bfs", "dfs"):
        raise ValueError(f"search={search!r}: use 'bfs' or 'dfs'")
    if optimize not in (0, 1, 2, 3):
        raise ValueError(f"optimize={optimize!r}: the compiler's -O level is 0, 1, 2 or 3")
    if not 0 <= hash_seed < HASH_SEEDS:
        raise ValueError(f"hash_seed={hash_seed!r}: pan's -h takes a seed from 0 to {HASH_SEEDS - 1}")
    t0 = time.perf_counter()
    text = PromelaModel(model, checks=checks, fifo_capacity=fifo_capacity).text()
    tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="weightsync-spin-")
    d = workdir if workdir is not None else Path(tmp.name)  # type: ignore[union-attr]
    try:
        (d / "model.pml").write_text(text)
        # -o2 keeps write-only variables in the state (SPIN hides them by default, which is sound but merges
        # states the model tells apart, e.g. a request's KV version when no check reads it): with the checks
        # off, the count is then the model's
        _run(["spin", "-a", "model.pml"] if checks else ["spin", "-o2", "-a", "model.pml"], d, timeout)
        flags = [f"-O{optimize}", "-DSAFETY", "-DVECTORSZ=4096"]
        _exact_counts(d / "pan.c")
        if hash_compact:
            _wide_hash(d / "pan.c")
            flags.append("-DHC4")
        flags += [f"-DMEMLIM={memory_limit_mb}"] if memory_limit_mb is not None else []
        if search == "dfs" and cores > 1:
            _keep_pools_at_exit(d / "pan.c")
        flags += ["-DBFS", "-DNOREDUCE"] if search == "bfs" else ([f"-DNCORE={cores}"] if cores > 1 else [])
        _run(["cc", *flags, "-o", "pan", "pan.c"], d, timeout)
        pan_args = ["./pan", f"-m{max_depth}", f"-w{hash_bits}", *([f"-h{hash_seed}"] if hash_seed else [])]
        if not checks:
            pan_args.append("-E")  # terminal states are not checked there (no else branch)
        out = _run(pan_args, d, timeout)
        res = pan_report(out)
        if hash_compact:
            res.omission_bound = omission_bound(res.states)
        if res.verdict == "counterexample":
            trail = _run(["spin", "-t", "model.pml"], d, timeout)
            why = next((ln for ln in out.splitlines() if ln.startswith("pan:") and "wrote" not in ln), "")
            try:
                res.labels, res.violation = parse_trail(trail)
            except CapacityError:
                raise
            except SpinError as exc:
                raise SpinError(f"{exc} [{why}]") from None
            res.path = replay(model, res.labels, res.violation)
        res.seconds = time.perf_counter() - t0
        return res
    finally:
        if tmp is not None:
            tmp.cleanup()


#: Bits of a state's hash that pan's hash-compact storage (``-DHC4``) keeps: the 64-bit ``K1`` and 32 bits of
#: ``K2`` (pan.c ``compress``, SPIN 6.5.2), once :func:`_wide_hash` makes pan hash with ``d_hash``.
HC_SIGNATURE_BITS = 96

#: pan.c's choice of hash function (SPIN 6.5.2): the 32-bit ``d_sfh`` for hash tables of up to 2^32 slots.
_HASHER_CHOICE = "\tif (ssize <= 32)\t/* 6.2.0 */"


def _wide_hash(pan_c: Path) -> None:
    """Make ``pan.c`` hash with its 64-bit Jenkins hash ``d_hash`` (which sets ``K1`` and ``K2``) at every
    hash-table size. SPIN 6.5.2 picks the 32-bit ``d_sfh`` (which sets ``K1`` alone, to 32 bits) whenever
    ``-w`` is at most 32, so hash-compact storage would keep a 32-bit signature: among 1.6 x 10^8 states,
    millions of collisions, each a state left out (measured: 257,130 states stored against 257,143 exact on
    ``two-phase-epoch`` any mode, N = 2).

    Raises:
        SpinError: ``pan.c`` does not choose its hash as SPIN 6.5.2 does (another SPIN version): hash
            compaction is refused rather than run with a hash whose width is unknown."""
    text = pan_c.read_text()
    if text.count(_HASHER_CHOICE) != 1:
        raise SpinError(
            "hash compaction: pan.c does not choose its hash function as SPIN 6.5.2 does "
            f"({_HASHER_CHOICE.strip()!r} not found once); refusing to run with a hash of unknown width"
        )
    pan_c.write_text(text.replace(_HASHER_CHOICE, "\tif (0)\t/* weightsync: d_hash (64-bit) at every -w */"))


#: SPIN 6.5.2's multi-core ``cleanup_shm`` (pan.c, run from ``pan_exit`` after the report) detaching each
#: pool of shared state memory in turn.
_POOL_DETACH = (
    "\t\tfor (last_pool = first_pool; last_pool != NULL; last_pool = nxt_pool)\n"
    "\t\t{\tnxt_pool = last_pool->nxt;\n"
    "\t\t\tif (shmdt((void *) last_pool->dc_start) != 0)\n"
)


def _keep_pools_at_exit(pan_c: Path) -> None:
    """Make a multi-core ``pan`` (``-DNCORE``) leave its pools of shared state memory attached when it exits.
    SPIN 6.5.2's ``cleanup_shm`` detaches them one by one, walking the list of pools (each pool's link
    lives in shared memory). On issue 19 item 3.2 on two cores (7.9 GB) it failed twice, at the end of a
    9-minute search: ``shmdt detaching from shared state memory: Invalid argument``, then a general
    protection fault, after the report was written into stdout's buffer and before that buffer reached the
    pipe, so the report was lost; small runs exit cleanly. The pools need no detaching: pan marks every
    segment for removal (``IPC_RMID``, ``rm_shared_segments``) once its workers have started, and the
    kernel detaches them when the processes exit (no segment is left behind: ``tests/test_spin_silent.py``).
    A ``pan.c`` without that loop (another SPIN) is left as it is; a pan that still dies is an error naming
    the signal (:func:`_run`)."""
    text = pan_c.read_text()
    if text.count(_POOL_DETACH) == 1:
        pan_c.write_text(
            text.replace(_POOL_DETACH, _POOL_DETACH.replace("last_pool != NULL;", "last_pool != NULL && 0;"))
        )


#: pan's hash seeds (``-hN``, N from 0 to 499: SPIN 6.5.2's ``HASH_CONST`` table and its usage text).
HASH_SEEDS = 500

#: pan's report prints its counts with ``%9.8g`` (8 significant digits from 10^8 on); these lines get
#: ``%9.0f`` (exact up to 2^53): states stored, states matched, transitions.
_COUNT_FORMATS = ('"%9.8g states, stored', '"%9.8g states, matched', '"%9.8g transitions (=')


def _exact_counts(pan_c: Path) -> None:
    """Make ``pan.c`` print its state and transition counts in full (``%9.0f``) instead of to 8 significant
    digits, so that two runs of 10^8 states and more can be compared state for state. A SPIN whose ``pan.c``
    prints them otherwise is left as it is (:func:`_count` reads both forms)."""
    text = pan_c.read_text()
    for fmt in _COUNT_FORMATS:
        text = text.replace(fmt, fmt.replace("%9.8g", "%9.0f"))
    pan_c.write_text(text)


def omission_bound(states: int) -> float:
    """A bound on the probability that hash-compact storage left a reachable state out: some two of
    ``states`` distinct states share a signature, at most ``states * (states - 1) / 2 / 2**96`` when the
    hash spreads states uniformly (the birthday bound; a collision makes pan take a new state for one it
    has seen, and only then can it miss the states behind it)."""
    return states * (states - 1) / 2 / 2.0**HC_SIGNATURE_BITS


def parse_trail(out: str) -> tuple[list[Label], str]:
    """The model labels of a trail's ``MOVE`` lines and the property of its ``VIOLATION`` line.

    Raises:
        SpinError: no VIOLATION line (pan failed an assertion the model does not name); CapacityError (a
            FIFO over the generator's capacity).
        ReductionPremiseError: a premise of the silent-wave reduction failed (:mod:`weightsync.model.spin.
            quiet`)."""
    labels: list[Label] = []
    violation = None
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "MOVE":
            labels.append(_label(words[1:]))
        elif len(words) == 2 and words[0] == "VIOLATION":
            violation = words[1]
        elif len(words) == 2 and words[0] == "CAPACITY":
            raise CapacityError(int(words[1]), len(labels))
        elif len(words) in (4, 5) and words[0] == "PREMISE":
            raise ReductionPremiseError(_premise_text(words[1:], len(labels)))
    if violation is None:
        raise SpinError(f"SPIN stopped after {len(labels)} moves on an error that names no property")
    return labels, violation


def _premise_text(words: list[str], moves: int) -> str:
    """The text of a ``PREMISE`` line of the silent-wave reduction (:mod:`weightsync.model.spin.quiet`)."""
    rank, a, b = words[:3]
    if a == "lowered":
        return (
            f"rank {rank}: move {moves + 1} (SPIN) lowers current_wave from {b} to {words[3]}: the silent-wave "
            "reduction needs current_wave never to decrease"
        )
    return (
        f"rank {rank} acts on START_DP_WAVE(wave={a}, exclude={b}) at move {moves + 1} (SPIN): the silent-wave "
        "reduction needs it dropped (vLLM 0.32 v1/engine/core.py:2284-2297); check without it"
    )


def _label(words: list[str]) -> Label:
    def val(w: str) -> Any:
        return int(w) if re.fullmatch(r"-?\d+", w) else w

    return tuple(val(w) for w in words)


def replay(model: Model, labels: list[Label], violation: str) -> list[tuple[G, Label, G]]:
    """SPIN's trail as a path of ``model`` (each label must be one of :meth:`Model.successors`), ending
    where the model itself finds ``violation`` (in the last state, on the last edge, or, for a terminal
    property, in a state without successors).

    Raises:
        SpinError: a label the model does not offer (the step and what it offers), or a violation the
            model does not confirm."""
    s = model.initial()
    path: list[tuple[G, Label, G]] = []
    for k, lab in enumerate(labels, start=1):
        succ = model.successors(s)
        nxt = [t for label, t in succ if tuple(label) == lab]
        if not nxt:
            offered = ", ".join(" ".join(map(str, label)) for label, _ in succ)
            raise SpinError(
                f"SPIN's trail is no path of the model: step {k} {lab!r}; the model offers {offered}"
            )
        path.append((s, lab, nxt[0]))
        s = nxt[0]
    found = list(model.invariant(s))
    if path:
        a, lab, b = path[-1]
        found += model.edge_check(a, lab, b)
    if not model.successors(s):
        found += model.terminal_check(s)
    if violation not in found:
        raise SpinError(
            f"SPIN reports {violation} after {len(labels)} steps; the model finds {found or 'nothing'} there"
        )
    return path


def steps_text(model: Model, path: list[tuple[G, Label, G]]) -> list[str]:
    """The replayed path as numbered step texts (:func:`weightsync.model.system.describe`)."""
    return [f"{k}. {describe(model, a, lab, b).text}" for k, (a, lab, b) in enumerate(path, start=1)]


__all__ = [
    "HC_SIGNATURE_BITS",
    "MAX_CAPACITY",
    "CapacityError",
    "SpinError",
    "SpinResult",
    "omission_bound",
    "pan_report",
    "parse_trail",
    "replay",
    "spin_available",
    "spin_check",
    "spin_once",
    "steps_text",
]
