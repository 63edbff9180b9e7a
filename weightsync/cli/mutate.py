"""``weightsync mutate``: the mutation check of the fix's table."""

from __future__ import annotations

import argparse
import json
import sys

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit


def mutate(args: argparse.Namespace) -> int:
    """``weightsync mutate``: the mutation check (:mod:`weightsync.model.mutation_report`)."""
    from pathlib import Path

    from rich.progress import Progress

    from weightsync.model.mutation import (
        CHECKPOINT_FILE,
        checkpoint_writer,
        mutants,
        mutation_digest,
        read_checkpoint,
    )
    from weightsync.model.mutation_report import (
        MUTATION_FILE,
        annotate,
        mutation_report,
        report_markdown,
        write_report,
    )
    from weightsync.spec.rank import get_variant, spec_digest

    if args.workers < 1:
        msg = f"--workers must be >= 1, got {args.workers}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    if args.reuse:
        path = Path.cwd() / "proofs" / MUTATION_FILE
        rep = json.loads(path.read_text()) if path.is_file() else {}
        # a report is reusable for the table it was computed against (its table digest, or for a report
        # written before that field existed, the whole spec's digest)
        if rep.get("table_digest", "") != mutation_digest() and rep.get("spec_digest") != spec_digest():
            msg = f"--reuse: {path} is missing or was computed against another table; run without --reuse"
            emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
            return EXIT_USAGE
        rep["table_digest"] = mutation_digest()
        annotate(rep)
    else:
        total = sum(1 for _ in mutants(get_variant("two-phase-epoch").table))
        # every verdict is appended to a checkpoint as it arrives; a run of the same table resumes from it
        ckpt = Path.cwd() / "proofs" / CHECKPOINT_FILE
        decided = read_checkpoint(ckpt, mutation_digest())
        write = checkpoint_writer(ckpt, mutation_digest())
        with Progress(disable=args.json, transient=True) as bar:
            task = bar.add_task("mutants", total=total, completed=len(decided))

            def on_result(name: str, why: str | None) -> None:
                write(name, why)
                bar.advance(task)

            rep = mutation_report(workers=args.workers, on_result=on_result, decided=decided)
        if args.write:
            ckpt.unlink(missing_ok=True)  # the report now holds every verdict
    if args.write:
        write_report(Path.cwd(), rep)
    emit(rep, args.json, lambda: print(report_markdown(rep)))
    return EXIT_VIOLATION if rep["unexplained"] else EXIT_OK


__all__ = ["mutate"]
