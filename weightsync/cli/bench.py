"""``weightsync bench WHAT``: runs one benchmark of :mod:`weightsync.bench` and prints its figures."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from weightsync.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    EXIT_VIOLATION,
    emit,
    not_built,
    progress,
    vllm_module,
)


def _bench_pause(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.bench.pause import run_pause_bench

    return run_pause_bench(quick=bool(getattr(args, "quick", False)))


def _bench_explorer(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.bench.explorer import run_explorer_bench
    from weightsync.bench.reach import ROW_BUDGET_S

    return run_explorer_bench(
        quick=bool(getattr(args, "quick", False)), budget_s=float(getattr(args, "budget", ROW_BUDGET_S))
    )


def _bench_por(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.bench.por import run_por_bench

    return run_por_bench(quick=bool(getattr(args, "quick", False)))


def _bench_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.bench.transfer import cli_figures

    return cli_figures(quick=bool(getattr(args, "quick", False)))


def _human_transfer(out: dict[str, Any]) -> None:
    from weightsync.bench.transfer import human

    human(out)


#: ``weightsync bench WHAT``: what -> function(args) returning the JSON object (with "ok" when it checks).
BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "pause": _bench_pause,
    "explorer": _bench_explorer,
    "por": _bench_por,
    "transfer": _bench_transfer,
}
#: optional human renderers per bench (default: indented JSON)
BENCH_HUMAN: dict[str, Callable[[dict[str, Any]], None]] = {"transfer": _human_transfer}


def _bench_vllm(args: argparse.Namespace) -> int:
    """``bench vllm``: :func:`weightsync.vllm_tools.bench.run_vllm_bench` (needs the vllm extra)."""
    from weightsync.bench.vllm import human_summary

    mod = vllm_module(args, "weightsync.vllm_tools.bench", "bench vllm")
    if mod is None:
        return EXIT_USAGE
    dp = None if args.dp is None else tuple(args.dp)
    out = mod.run_vllm_bench(
        quick=bool(args.quick),
        log=progress(args),
        dp=dp,
        steady_allocator=not getattr(args, "glibc_malloc_defaults", False),
    )
    emit(out, args.json, lambda: print(human_summary(out)))
    return EXIT_OK if out["ok"] else EXIT_VIOLATION


def bench(args: argparse.Namespace) -> int:
    """``weightsync bench WHAT``: the benchmark's JSON object (or its human rendering); exit 1 when it fails."""
    if args.what == "vllm":
        return _bench_vllm(args)
    fn = BENCHES.get(args.what)
    if fn is None:
        code: int = not_built(f"bench {args.what}")(args)
        return code
    out = fn(args)
    human = BENCH_HUMAN.get(args.what)
    emit(
        out,
        args.json,
        (lambda: human(out)) if human else (lambda: print(json.dumps(out, indent=2, default=str))),
    )
    return EXIT_OK if out.get("ok", True) else EXIT_VIOLATION


__all__ = ["BENCHES", "BENCH_HUMAN", "bench"]
