"""``weightsync record --engine vllm``: a protocol trace from real vLLM engines."""

from __future__ import annotations

import argparse

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, emit, progress, vllm_module


def record(args: argparse.Namespace) -> int:
    """``record --engine vllm``: :func:`weightsync.vllm_tools.trace.record_cycles`."""
    mod = vllm_module(args, "weightsync.vllm_tools.trace", "--engine vllm")
    if mod is None:
        return EXIT_USAGE
    out = mod.record_cycles(args.out, cycles=args.cycles, seed=args.seed, log=progress(args))

    def human() -> None:
        print(
            f"{out['cycles']} cycles, {out['requests']} requests ({out['finished']} finished, {out['aborted']} "
            f"aborted), modes {out['modes']}: {out['lines']} trace lines -> {out['path']} ({out['seconds']:.0f} s)"
        )
        print(f"check it: weightsync replay --variant {out['variant']} {out['path']}")

    emit(out, args.json, human)
    return EXIT_OK


__all__ = ["record"]
