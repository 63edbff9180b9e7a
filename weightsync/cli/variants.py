"""``weightsync variants``: the protocol variants."""

from __future__ import annotations

import argparse

from weightsync.cli.common import EXIT_OK, emit


def variants(args: argparse.Namespace) -> int:
    """``weightsync variants``: the protocol variants with a one-line description."""
    from weightsync.spec.rank import VARIANTS

    rows = [
        {"name": v.name, "description": v.description, "source": v.source, "expected": v.expected}
        for v in VARIANTS.values()
    ]

    def human() -> None:
        for r in rows:
            print(f"{r['name']:<16} {r['description']}  [{r['source']}; expected: {r['expected']}]")

    emit({"variants": rows}, args.json, human)
    return EXIT_OK


__all__ = ["variants"]
