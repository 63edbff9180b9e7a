"""``weightsync replay TRACE.jsonl...`` / ``weightsync replay --self-test``: validates recorded traces against
the model (system traces of the reference engine: walked through the model's successor function,
:mod:`weightsync.model.trace_walk`; per-rank traces: on the rank tables)."""

from __future__ import annotations

import argparse
import sys

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit


def replay(args: argparse.Namespace) -> int:
    """``weightsync replay TRACE...``: each trace's table edges (:func:`weightsync.impl.checked.replay_trace`)
    and the model's composition check (:class:`weightsync.model.replay.TraceChecker`); exit 1 on a divergence."""
    from weightsync.impl.trace_replay import replay_trace
    from weightsync.model.replay import TraceChecker
    from weightsync.repro.selftest import is_system_trace

    if args.self_test or (args.traces and all(is_system_trace(t) for t in args.traces)):
        return _walk(args)
    if not args.traces:
        err = {"error": "weightsync replay: give trace files, or --self-test"}
        emit(err, args.json, lambda: print(err["error"], file=sys.stderr))
        return EXIT_USAGE
    results = []
    checkers: list[TraceChecker] = []
    for path in args.traces:
        try:  # table edges (impl) + the model's composition check (collective outcomes, blocked ranks)
            checkers.append(TraceChecker())
            results.append(replay_trace(path, checkers[-1], variant=args.variant))
        except (OSError, ValueError) as exc:
            err = {"error": str(exc)}
            emit(err, args.json, lambda err=err: print(err["error"], file=sys.stderr))  # type: ignore[misc]
            return EXIT_USAGE
    ok = all(r.ok for r in results)
    out = {
        "ok": ok,
        "traces": [
            {
                "path": r.path,
                "ok": r.ok,
                "steps": r.steps,
                "ranks": r.ranks,
                "variant": r.variant,
                "collectives": r.collectives,
                "outcomes_checked": ck.outcomes_checked,
                "has_work_checked": ck.has_work_checked,
                "notes": ck.notes,
                "divergence": None if r.divergence is None else r.divergence.__dict__,
            }
            for r, ck in zip(results, checkers, strict=True)
        ],
    }

    def human() -> None:
        for r in results:
            if r.ok:
                print(f"{r.path}: ok, {r.steps} steps on {r.ranks} ranks ({r.variant})")
            else:
                assert r.divergence is not None
                print(f"{r.path}: DIVERGES at {r.divergence.describe()}")

    emit(out, args.json, human)
    return EXIT_OK if ok else EXIT_VIOLATION


def _walk(args: argparse.Namespace) -> int:
    """System traces (or ``--self-test``): walk each through the model; exit 1 unless every verdict is
    the expected one (a broken engine rejected at its fault, a healthy trace accepted)."""
    from weightsync.repro.selftest import replay_report, self_test_report

    try:
        if args.self_test:
            out = self_test_report(tuple(args.case), args.seed, args.workdir)
        else:
            out = replay_report(args.traces)
    except (OSError, ValueError) as exc:
        err = {"error": str(exc)}
        emit(err, args.json, lambda: print(err["error"], file=sys.stderr))
        return EXIT_USAGE

    def human() -> None:
        for e in out["results"]:
            verdict = "rejected" if e["rejected"] else "accepted"
            where = f" at line {e['first_bad_line']}: {e['reason']}" if e["rejected"] else ""
            mark = "ok " if e.get("ok", not e["rejected"]) else "BAD"
            print(f"{mark} {e['name']}: {verdict} after {e['steps']} model steps{where}")

    emit(out, args.json, human)
    return EXIT_OK if out["ok"] else EXIT_VIOLATION


__all__ = ["replay"]
