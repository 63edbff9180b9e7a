"""``weightsync export``: tables, counterexamples and state graphs as diagrams."""

from __future__ import annotations

import argparse
import sys

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, emit


def export(args: argparse.Namespace) -> int:
    """``weightsync export``: :func:`weightsync.model.export.export`; exit 2 when it cannot be produced."""
    from pathlib import Path

    from weightsync.model.export import ExportError, export

    try:
        out = export(
            args.what,
            args.format,
            Path(args.out),
            variant=args.variant,
            ranks=args.ranks,
            mode=args.mode,
            channels=args.channels,
            requests=args.requests,
        )
    except (ExportError, ValueError) as exc:
        msg = f"weightsync export: {exc}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    emit(out, args.json, lambda: print(f"wrote {out['out']} ({out['what']}, {out['format']})"))
    return EXIT_OK


__all__ = ["export"]
