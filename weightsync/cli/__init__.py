"""The ``weightsync`` command line (the commands and exit codes the README documents).

Thin by design: :mod:`weightsync.cli.parser` parses the arguments and :func:`main` dispatches to one module
per subcommand (``weightsync.cli.<command>``), each calling into :mod:`weightsync.model`,
:mod:`weightsync.impl`, :mod:`weightsync.repro` and the applications, and printing; the vLLM tools are
imported only when a command runs them (:func:`weightsync.cli.common.vllm_module`). Like the CLI's
handlers, this is where the model and the implementation may meet. Every command takes ``--json`` (one
JSON object on stdout). Exit codes: 0 success / verified, 1 a property was violated or a check failed, 2
usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from weightsync.cli import bench, check, demo, export, mutate, prove, record, replay, repro, token, variants
from weightsync.cli.common import EXIT_USAGE
from weightsync.cli.parser import UsageError, build_parser

#: command -> handler (``weightsync.cli.<command>``); each returns an exit code.
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "variants": variants.variants,
    "check": check.check,
    "export": export.export,
    "prove": prove.prove,
    "mutate": mutate.mutate,
    "bench": bench.bench,
    "demo": demo.demo,
    "repro": repro.repro,
    "replay": replay.replay,
    "record": record.record,
    "token": token.token,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightsync`` console script; returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version exit 0
        return int(exc.code or 0)
    except UsageError as exc:  # a bad flag or value: exit 2 naming it (README, exit codes)
        if "--json" in argv:
            sys.stdout.write(json.dumps({"error": str(exc)}) + "\n")
        else:
            sys.stderr.write(exc.usage)
        sys.stderr.write(f"{exc}\n")
        return EXIT_USAGE
    return HANDLERS[args.command](args)


__all__ = ["HANDLERS", "main"]
