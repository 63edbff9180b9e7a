"""``weightsync token new PATH``: write a new deployment secret (:mod:`weightsync.impl.transfer.secret`)."""

from __future__ import annotations

import argparse
import sys

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, emit


def token(args: argparse.Namespace) -> int:
    """Write :data:`~weightsync.impl.transfer.secret.NEW_TOKEN_BYTES` random bytes as hexadecimal to
    ``args.path`` with mode 0600, never overwriting a file; prints the path and how to use it, never the
    secret. Exit 2 when the file exists or cannot be created."""
    from weightsync.impl.transfer.secret import NEW_TOKEN_BYTES, TOKEN_FILE_ENV, write_token

    try:
        path = write_token(args.path)
    except OSError as exc:
        err = {"error": f"weightsync token new: cannot create {args.path}: {exc.strerror}"}
        emit(err, args.json, lambda: print(err["error"], file=sys.stderr))
        return EXIT_USAGE
    out = {"path": str(path), "bytes": NEW_TOKEN_BYTES, "mode": "0600", "env": TOKEN_FILE_ENV}
    emit(
        out,
        args.json,
        lambda: print(
            f"wrote a {NEW_TOKEN_BYTES}-byte secret to {path} (mode 0600); give the trainer and every engine "
            f"{TOKEN_FILE_ENV}={path} (copy the file with the same mode to each host)"
        ),
    )
    return EXIT_OK
