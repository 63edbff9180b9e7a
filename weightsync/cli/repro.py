"""``weightsync repro VARIANT``: the model's counterexample driven on real processes (the reference engine,
or with ``--engine vllm`` a real vLLM)."""

from __future__ import annotations

import argparse
import math
import sys
import time

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit, progress, vllm_module


def _repro_vllm(args: argparse.Namespace) -> int:
    """``repro vllm-0.32 --engine vllm [--fix epoch]``: :func:`weightsync.repro.vllm.run.run_vllm_repro`."""
    if args.variant != "vllm-0.32":
        msg = f"--engine vllm drives vLLM 0.32 as shipped: variant must be vllm-0.32, got {args.variant!r}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    mod = vllm_module(args, "weightsync.repro.vllm.run", "--engine vllm")
    if mod is None:
        return EXIT_USAGE
    if args.property is not None and (args.fix or args.property not in mod.DRIVEN_PROPERTIES):
        msg = (
            f"--property {args.property}: --engine vllm drives the counterexample of "
            f"{', '.join(mod.DRIVEN_PROPERTIES)} on vLLM as shipped (no --fix)"
        )
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    timeout = max(10, math.ceil(args.timeout)) if args.timeout is not None else 30
    res = mod.run_vllm_repro(
        args.variant, fix=args.fix, mode=args.mode, timeout_s=timeout, log=progress(args), of=args.property
    )
    out = res.as_dict()

    def human() -> None:
        print(
            f"{res.variant} on vLLM ({'as shipped' if res.fix == 'none' else 'fix ' + str(res.fix)}): {res.result}"
        )
        print(f"  followed {res.followed_steps} model steps; diverged at {res.diverged_at}; {res.reason}")
        for r, w in sorted(res.ranks.items()):
            print(f"  rank {r}: {'blocked in ' + w if w else 'idle'} {res.errors.get(r, '')}")

    emit(out, args.json, human)
    want = "completed" if args.fix else "reproduced"
    return EXIT_OK if res.result == want else EXIT_VIOLATION


def repro(args: argparse.Namespace) -> int:
    """``repro VARIANT``: the model's counterexample compiled by :mod:`weightsync.repro.schedule` (glue: the model
    and the implementation meet only in the commands) and driven on the reference engine by
    :func:`weightsync.repro.engine.run_schedule`."""
    from weightsync.repro.engine import BUGGY, EXPECTED, Plan, run_schedule

    if args.engine == "vllm":
        return _repro_vllm(args)

    def usage(msg: str) -> int:
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE

    if args.fix is not None:
        return usage("--fix applies to --engine vllm (the reference engine runs the fixed variants by name)")
    if args.variant not in EXPECTED:
        return usage(f"unknown variant {args.variant!r}; known: {', '.join(EXPECTED)}")
    from weightsync.model.check import build_model
    from weightsync.repro.fixed import FIX_OF, fix_schedule
    from weightsync.repro.schedule import compile_schedule, final_state, model_counterexample
    from weightsync.spec.errors import WeightSyncError

    fixed = EXPECTED[args.variant] == "completed"
    schedule = args.schedule or (FIX_OF[args.variant] if fixed else args.variant)
    if schedule not in BUGGY or (not fixed and schedule != args.variant):
        known = ", ".join(BUGGY) if fixed else args.variant
        return usage(f"--schedule {schedule!r}: {args.variant} runs the counterexample of {known}")
    buggy = build_model(schedule, 2, args.mode)  # no exploration yet: the bounds the engines take
    model_seconds: list[float] = []

    def plan() -> Plan:  # the model's exploration, while the engines start
        t_model = time.monotonic()
        cx = model_counterexample(schedule, args.mode, args.property)
        labels, texts = [list(x) for x in cx["labels"]], [str(x) for x in cx["steps"]]
        if fixed:
            fix = build_model(args.variant, 2, args.mode)
            actions, div = fix_schedule(buggy, fix, labels, texts, "reference")
            p = Plan(schedule, actions, None, div["fix_rows"], div["impossible_step"], str(cx["property"]))
        else:
            actions = compile_schedule(buggy, labels, texts, "reference")
            p = Plan(schedule, actions, final_state(buggy, labels), prop=str(cx["property"]))
        model_seconds.append(time.monotonic() - t_model)
        return p

    timeout = min(float(args.timeout), 10.0) if args.timeout is not None else 5.0
    try:
        res = run_schedule(
            args.variant,
            plan,
            mode=args.mode,
            clear_cache=buggy.clear_cache,
            tokens=buggy.tokens,
            sync_interval=buggy.sync_interval,
            timeout_s=timeout,
            log=progress(args),
        )
    except (WeightSyncError, RuntimeError, ValueError) as exc:  # no schedule, or no engines to run it
        msg = f"{args.variant}: the run did not start: {type(exc).__name__}: {exc}"
        emit({"result": "error", "error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_VIOLATION
    out = res.as_dict()
    out["expected"] = EXPECTED[args.variant]
    out["model_seconds"] = round(sum(model_seconds), 3)

    def human() -> None:
        print(
            f"{res.variant} on the reference engine, {res.schedule}'s counterexample ({res.mode}): {res.result}"
        )
        print(f"  followed {res.followed_steps} model steps; diverged at {res.diverged_at}; {res.reason}")
        if res.impossible_step is not None:
            print(f"  step {res.impossible_step} is impossible under the fix")
        for row in res.fix_rows:
            print(f"  fix row at step {row['step']}, rank {row['rank']}: {row['fix_row']}")
        for r, w in sorted(res.ranks.items()):
            print(
                f"  rank {r}: {'blocked in ' + w if w else 'outside any collective'} {res.errors.get(r, '')}"
            )
        if res.requests_finished:
            print(f"  requests finished (tokens): {res.requests_finished}")

    emit(out, args.json, human)
    return EXIT_OK if res.result == EXPECTED[args.variant] else EXIT_VIOLATION


__all__ = ["repro"]
