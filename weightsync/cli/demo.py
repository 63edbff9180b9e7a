"""``weightsync demo``: the main job (:mod:`weightsync.demo`), or with ``--engine vllm`` the same loop on a
real ``AsyncLLM`` (:mod:`weightsync.vllm_tools.demo`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit, progress, vllm_module
from weightsync.spec.errors import WeightSyncError


def demo(args: argparse.Namespace) -> int:
    """``weightsync demo``: the reference engine's demo (:func:`_demo_reference`) or ``--engine vllm``'s."""
    if args.engine == "vllm":
        return _demo_vllm(args)
    if args.moe or args.no_moe_reload_fix:
        msg = "--moe and --no-moe-reload-fix apply to --engine vllm"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    return _demo_reference(args)


def _demo_vllm(args: argparse.Namespace) -> int:
    """``demo --engine vllm``: :func:`weightsync.vllm_tools.demo.run_vllm_demo` (2 DP engines)."""
    if args.ranks != 2 or args.transport != "broadcast" or args.model or args.no_check:
        msg = "--engine vllm runs 2 DP engines with the broadcast backend, the built-in policy and the checks"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    mod = vllm_module(args, "weightsync.vllm_tools.demo", "--engine vllm")
    if mod is None:
        return EXIT_USAGE
    cfg = mod.VllmDemoConfig(
        steps=args.steps,
        moe=args.moe,
        mode=args.mode,
        seed=args.seed,
        timeout_s=max(args.timeout, 120.0),
        moe_reload_fix=False if args.no_moe_reload_fix else None,
        trace=args.trace,
    )
    try:
        out = mod.run_vllm_demo(cfg, log=progress(args))
    except (ValueError, WeightSyncError) as exc:  # bad settings, or the run failed: said, no traceback
        msg = f"weightsync demo --engine vllm: {type(exc).__name__}: {exc}"
        emit({"ok": False, "error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_VIOLATION if isinstance(exc, WeightSyncError) else EXIT_USAGE

    def human() -> None:
        traces = f"{out['trace']} ({out.get('trace_steps')} steps)"
        if out.get("engine_trace"):  # lockstep DP engines (MoE): their own events, replayed too
            engines = f"{out['engine_trace']} ({out.get('engine_trace_steps')} steps)"
            traces = f"traces {traces} and the engines' {engines}"
        else:
            traces = f"trace {traces}"
        print(
            f"vLLM demo ({out['model']}): {out['steps']} steps, reward {out['reward_first']} -> "
            f"{out['reward_last']}; greedy_equal={out['greedy_equal']} max_logprob_diff="
            f"{out['max_logprob_diff']:.2e} lost_requests={out['lost_requests']} versions_ok={out['versions_ok']}; "
            f"{traces} replay: {out['trace_ok']} ({out['seconds']:.0f} s)"
        )

    emit(out, args.json, human)
    return EXIT_OK if out["ok"] else EXIT_VIOLATION


def _demo_reference(args: argparse.Namespace) -> int:
    """``demo`` on the reference engine: :func:`weightsync.demo.loop.run_demo`; returns the exit code.

    0: every check held; 1: a check failed or the run failed (the error names a dead rank); 2: bad input
    (unknown transport, bad ``--model`` directory...). ``--json`` prints one JSON object on stdout and no
    progress; otherwise a progress bar, one table row per sync and a summary. The test-only environment
    variable :data:`weightsync.demo.config.KILL_ENV` (``"R"`` or ``"R:S"``) kills engine rank R in the middle
    of sync S.
    """
    from weightsync.demo.config import KILL_ENV, DemoConfig, DemoUsageError
    from weightsync.demo.loop import run_demo
    from weightsync.demo.render import DemoRenderer, render_summary

    cfg = DemoConfig(
        ranks=int(args.ranks),
        steps=int(args.steps),
        transport=str(args.transport),
        mode=str(args.mode),
        model_dir=args.model,
        seed=int(args.seed),
        variant=str(args.variant),
        timeout_s=float(args.timeout),
        trace=args.trace,
        check=not bool(args.no_check),
    )
    try:
        kill = os.environ.get(KILL_ENV, "").strip()
        if kill:
            rank, _, at = kill.partition(":")
            try:
                cfg.kill_rank_during_update, cfg.kill_at_sync = int(rank), int(at or 1)
            except ValueError:
                raise DemoUsageError(f"{KILL_ENV}={kill!r}: expected RANK or RANK:SYNC") from None
        if args.json:
            out = run_demo(cfg)
        else:
            with DemoRenderer() as renderer:
                out = run_demo(cfg, renderer)
            render_summary(out, renderer.console, table=False)
    except DemoUsageError as exc:
        if args.json:
            sys.stdout.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        else:
            sys.stderr.write(f"weightsync demo: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(out, sort_keys=True, default=str) + "\n")
    return 0 if out["ok"] else 1


__all__ = ["demo"]
