"""``weightsync replay --self-test``: run the reference DP engine healthy and with deliberately broken
behaviours, record a system trace of each (:mod:`weightsync.impl.engine.tracing`), and walk every trace
through the model's successor function (:func:`weightsync.model.trace_walk.walk_trace`).

Glue between the model and the implementation (it imports both), so it lives beside the CLI.

Each broken engine is an :class:`~weightsync.impl.engine.core.EngineCore` subclass
(:mod:`weightsync.repro.faults`), run through ``EngineConfig.core``; it writes a ``fault`` record
where its fault first changes what the rank does. The walker never reads those records; the self-test
checks that the walker rejected the trace at the model step that fault record belongs to.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.impl.engine.tracing import SCHEMA


@dataclass(frozen=True)
class Case:
    """One self-test run.

    Attributes:
        name: the case's name in the report.
        core: the engine class (``EngineConfig.core``; "" the healthy engine).
        mode: the pause mode of every cycle.
        cycles: pause / update / resume cycles.
        verify: the transfer's checksum round (``init_info['verify']``).
        expect_rejected: whether the walker must reject the trace.
        targets: the ranks requests go to (empty: any rank). Requests to rank 0 only leave rank 1 to
            learn of every wave from START_DP_WAVE.
    """

    name: str
    core: str = ""
    mode: str = "keep"
    cycles: int = 4
    verify: bool = False
    expect_rejected: bool = True
    targets: tuple[int, ...] = ()


_FAULTS = "weightsync.repro.faults"

#: The self-test's cases: five broken engines from issue 12's list, corrupted weight bytes, and the healthy
#: 20-cycle run.
CASES = (
    Case("healthy-20-cycles", cycles=20, expect_rejected=False),
    Case("scheduler-advances-under-paused-all", f"{_FAULTS}:AdvancesWhilePaused", cycles=10),
    Case("drops-start-dp-wave", f"{_FAULTS}:DropsStartDPWave", cycles=10, targets=(0,)),
    Case("clear-cache-does-nothing", f"{_FAULTS}:ClearCacheDoesNothing", cycles=10),
    Case("wave-complete-never-sent", f"{_FAULTS}:NoWaveComplete", cycles=10),
    Case("abort-aborts-nothing", f"{_FAULTS}:AbortAbortsNothing", mode="abort", cycles=10),
    Case("corrupted-weight-bytes", f"{_FAULTS}:CorruptsWeights", cycles=2, verify=True),
)


@dataclass
class Recorded:
    """What one recorded run did: requests sent and finished, and the error that ended it (None if the run
    completed every cycle)."""

    requests: int = 0
    finished: int = 0
    cycles: int = 0
    error: str | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def record(
    path: Path,
    case: Case,
    *,
    seed: int = 0,
    dp_size: int = 2,
    sync_interval: int = 4,
    tokens: int = 12,
    timeout_s: float = 6.0,
) -> Recorded:
    """Run ``case`` on a reference DP cluster (``dp_size`` ranks, variant two-phase-epoch, the tiny Llama,
    broadcast transport over gloo) and write its system trace to ``path``.

    Traffic: before each cycle 0-3 (a broken engine: 1-3) greedy requests of ``tokens`` tokens to random ranks (``case.targets``; each engine step
    sleeps 2 ms, so requests are often in flight at a pause), a random pause of 0-40 ms, then one round (``update_round``: pause(mode, clear_cache=True), start, update with fresh
    random weights, finish with ``weight_version="step-<c>"``, resume). After the cycles it waits for
    every request. A broken engine's run ends one cycle after its first ``fault`` record (at most
    ``case.cycles`` cycles). A failure (a broken engine's timeout, a failed round) ends the run; it is
    reported in :attr:`Recorded.error`, not raised. ``timeout_s``: every collective's deadline, seconds.
    """
    from weightsync.impl.engine.client import DPEngineClient, free_port
    from weightsync.impl.engine.config import EngineConfig, tiny_config
    from weightsync.impl.engine.controller import update_round
    from weightsync.impl.engine.weights import random_weights
    from weightsync.impl.models.causal_lm import CausalLM
    from weightsync.impl.models.sampling import SamplingParams
    from weightsync.impl.transfer.trainer import BroadcastTrainerEngine, TrainerInitInfo

    rng = random.Random(seed)
    model_cfg = tiny_config()
    header = {
        "kind": "header",
        "schema": SCHEMA,
        "case": case.name,
        "variant": "two-phase-epoch",
        "dp_size": dp_size,
        "sync_interval": sync_interval,
        "mode": case.mode,
        "clear_cache": True,
        "tokens": tokens,
        "init_transfer": True,
    }
    path.write_text(json.dumps(header, sort_keys=True) + "\n")
    cfg = EngineConfig(
        dp_size=dp_size,
        model=model_cfg,
        variant="two-phase-epoch",
        sync_interval=sync_interval,
        collective_timeout_s=timeout_s,
        step_sleep_s=0.002,
        system_trace=str(path),
        core=case.core,
    )
    out = Recorded()
    t0 = time.monotonic()
    client = DPEngineClient(cfg).start()
    trainer: BroadcastTrainerEngine | None = None
    streams = []
    try:
        info = TrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=1 + dp_size,
            timeout_s=timeout_s,
            group_backend="gloo",
            rank=0,
            verify=case.verify,
        )
        trainer = BroadcastTrainerEngine.trainer_init(info, client=client)
        lm = CausalLM(model_cfg)
        for c in range(case.cycles):
            # a broken engine's run needs traffic in every cycle for its fault to act
            for _ in range(rng.randint(1 if case.core else 0, 3)):
                prompt = [rng.randrange(model_cfg.vocab_size) for _ in range(rng.randint(1, 4))]
                params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
                target = rng.choice(case.targets) if case.targets else rng.randrange(dp_size)
                streams.append(client.add_request(prompt, params, rank=target))
            time.sleep(rng.uniform(0.0, 0.04))
            weights = random_weights(lm, seed * 1000 + c + 1)
            update_round(
                client,
                trainer,
                weights,
                mode=case.mode,
                clear_cache=True,
                timeout=4 * timeout_s,
                weight_version=f"step-{c + 1}",
            )
            out.cycles = c + 1
            if case.core and c + 1 < case.cycles and _faults_in(path):
                break  # the fault acted: one more cycle shows what follows
        for s in streams:
            s.wait(4 * timeout_s)
    except Exception as exc:  # a broken engine ends its run here; the trace is what it is
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.requests = len(streams)
        out.finished = sum(1 for s in streams if s.done.is_set())
        client.shutdown()
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.shutdown()
        out.seconds = round(time.monotonic() - t0, 2)
    return out


def _faults_in(path: Path) -> bool:
    with path.open() as f:
        return any('"kind": "fault"' in line for line in f)


def run_case(case: Case, workdir: Path, *, seed: int = 0) -> dict[str, Any]:
    """Record ``case`` into ``workdir/<name>.jsonl`` and walk the trace.

    Returns the report entry: ``name``, ``rejected``, ``first_bad_line``, ``reason`` (the walker's),
    ``fault_line`` and ``fault`` (the broken engine's first ``fault`` record: its line and what it did),
    ``at_fault`` (the rejected step is the one that fault record belongs to), ``ok`` (a broken engine was
    rejected at its fault; the healthy one accepted), ``steps`` (model steps walked), ``trace`` (the
    file), ``recorded`` (requests, cycles and the error that ended the run, if any), ``attempts`` (runs
    recorded: a broken engine whose fault never acted is run again with another seed, at most 3 times).
    """
    from weightsync.model.trace_walk import read_trace, walk_trace

    path = workdir / f"{case.name}.jsonl"
    # A broken engine's traffic is random: if its fault never acted (the trace is then a healthy one), the
    # run says nothing about the walker, so it is recorded again with another seed (at most 3 runs).
    for attempt in range(1, 4):
        rec = record(path, case, seed=seed + 1000 * (attempt - 1))
        with path.open() as f:
            lines = f.readlines()
        _, steps, faults = read_trace(lines)
        if faults or not case.expect_rejected:
            break
    result = walk_trace(lines)
    # the first fault in walk order: the fault whose step starts first (a fault record may be written
    # before its step's first record, and one rank's faulty step may start before another's)
    starts = {(st.proc, st.group): st.line for st in steps}
    first = min(faults, key=lambda f: starts.get((f["proc"], f["group"]), f["line"]), default=None)
    at_fault = first is not None and [first["proc"], first["group"]] in result.bad_groups
    ok = at_fault if case.expect_rejected else (result.accepted and rec.error is None)
    return {
        "name": case.name,
        "rejected": not result.accepted,
        "first_bad_line": result.first_bad_line,
        "reason": result.reason,
        "fault_line": first["line"] if first else None,
        "fault": first["what"] if first else None,
        "at_fault": at_fault,
        "ok": ok,
        "steps": result.steps,
        "trace": str(path),
        "attempts": attempt,
        "recorded": {
            "requests": rec.requests,
            "finished": rec.finished,
            "cycles": rec.cycles,
            "error": rec.error,
            "seconds": rec.seconds,
        },
        "model_state": result.model_state if not result.accepted else [],
        "legal": result.legal if not result.accepted else [],
    }


def self_test(workdir: Path, *, seed: int = 0, names: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run every case of :data:`CASES` (or those named) and walk each trace (:func:`run_case`)."""
    return [run_case(c, workdir, seed=seed) for c in CASES if not names or c.name in names]


def is_system_trace(path: str) -> bool:
    """Whether ``path`` starts with a system-trace header (False for other traces and unreadable files)."""
    try:
        with open(path) as f:
            first = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("schema") == SCHEMA


def replay_report(paths: list[str]) -> dict[str, Any]:
    """``weightsync replay`` on system traces: walk each (``ok``: every one accepted).

    Raises:
        OSError: a file cannot be read. ValueError: one is no system trace (``TraceFormatError``).
    """
    from weightsync.model.trace_walk import walk_trace

    results = []
    for p in paths:
        with open(p) as f:
            r = walk_trace(f)
        results.append({"name": p, "rejected": not r.accepted, **r.to_dict()})
    return {"ok": all(not e["rejected"] for e in results), "results": results}


def self_test_report(names: tuple[str, ...], seed: int, workdir: str | None) -> dict[str, Any]:
    """``weightsync replay --self-test``: :func:`self_test` into ``workdir`` (a temporary directory if
    None, removed afterwards); ``ok`` when every case is.

    Raises:
        ValueError: a name that is no case of :data:`CASES`.
    """
    import tempfile

    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        raise ValueError(
            f"--case {unknown[0]!r}: no such case; the cases are {', '.join(c.name for c in CASES)}"
        )
    t0 = time.monotonic()
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="weightsync-selftest-") as d:
            results = self_test(Path(d), seed=seed, names=names)
    else:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        results = self_test(Path(workdir), seed=seed, names=names)
    return {
        "ok": all(e["ok"] for e in results),
        "results": results,
        "seconds": round(time.monotonic() - t0, 1),
    }


__all__ = [
    "CASES",
    "Case",
    "Recorded",
    "is_system_trace",
    "record",
    "replay_report",
    "run_case",
    "self_test",
    "self_test_report",
]
