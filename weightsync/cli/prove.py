"""``weightsync prove [--check]``: regenerate ``proofs/`` and ``spec/``, or check them fresh."""

from __future__ import annotations

import argparse

from weightsync.cli.common import EXIT_OK, EXIT_VIOLATION, emit


def prove(args: argparse.Namespace) -> int:
    """``weightsync prove [--check]``: regenerate ``proofs/`` and ``spec/``, or check that they are fresh."""
    from pathlib import Path

    from weightsync.model.proofs import check_fresh, prove

    root = Path.cwd()
    if args.check:
        import json as _json

        from weightsync.model.mutation_report import MUTATION_FILE, mutation_stale

        problems = check_fresh(root, allow_stale_mutation=args.allow_stale_mutation)
        warnings = []
        mpath = root / "proofs" / MUTATION_FILE
        if args.allow_stale_mutation and mpath.is_file() and mutation_stale(_json.loads(mpath.read_text())):
            warnings.append(
                f"WARNING: proofs/{MUTATION_FILE} was computed against another table and is not evidence "
                "for this one (allowed by --allow-stale-mutation); run `weightsync mutate --write`"
            )
        emit(
            {"fresh": not problems, "problems": problems, "warnings": warnings},
            args.json,
            lambda: print(
                "\n".join(problems + warnings) if problems or warnings else "proofs/ and spec/ are fresh"
            ),
        )
        return EXIT_VIOLATION if problems else EXIT_OK
    summary = prove(
        root, log=(lambda _m: None) if args.json else print, missing_only=args.missing, engine=args.engine
    )
    bad = [p for p in summary["proofs"] if p["verdict"] != p["expected"]]
    emit(summary, args.json, lambda: print(f"wrote proofs/ and spec/ ({summary['seconds']} s)"))
    return EXIT_VIOLATION if bad else EXIT_OK


__all__ = ["prove"]
