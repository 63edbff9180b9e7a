"""``weightsync check``: the model checker on one variant and bound."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from weightsync.cli.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit


def check(args: argparse.Namespace) -> int:
    """``weightsync check``: :func:`weightsync.model.check.check`; exit 1 on a counterexample, 2 on bad
    input, a table that breaks a reduction's premise, or (--engine spin) a configuration the generator does
    not write."""
    from weightsync.model.spin.build import UnsupportedModel
    from weightsync.model.system import Bounds
    from weightsync.model.system.premise import ReductionPremiseError
    from weightsync.spec.rank import VARIANTS

    err = None
    if args.variant not in VARIANTS:
        err = f"unknown variant {args.variant!r}; known: {', '.join(VARIANTS)}"
    # numeric bounds are checked by the parser's types (exit 2 naming the flag)
    if err:
        msg = err
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    bounds = Bounds(
        requests=args.requests,
        cycles=args.cycles,
        sync_interval=args.sync_interval,
        tokens=args.tokens,
        init_transfer=args.init_transfer,
        stray_resume=args.stray_resume,
        repeat_resume=args.repeat_resume,
        failures=args.failures,
        pause_during_update=args.pause_during_update,
        repeat_pause=args.repeat_pause,
        init_while_serving=args.init_while_serving,
        resume_during_update=args.resume_during_update,
    )
    try:
        out = run_check(args, bounds)
    except ReductionPremiseError as exc:
        msg = f"the reduction does not apply to this table: {exc}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    except UnsupportedModel as exc:  # --engine spin: a configuration the Promela generator does not write
        msg = f"--engine spin: {exc}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    emit(out, args.json, lambda: print_human(out))
    return EXIT_OK if out["verdict"] == "verified" else EXIT_VIOLATION


def run_check(args: argparse.Namespace, bounds: Any) -> dict[str, Any]:
    """:func:`weightsync.model.check.check` with the command line's options."""
    import time

    from weightsync.model.check import check

    return check(
        args.variant,
        args.ranks,
        mode=args.mode,
        channels=args.channels,
        bounds=bounds,
        symmetry=args.symmetry,
        max_states=args.max_states,
        progress=args.progress,
        workers=args.workers,
        stalls=args.stalls,
        counterexample_of=args.counterexample_of,
        engine=args.engine,
        spin={
            "search": args.spin_search,
            "cores": args.spin_cores,
            "fifo_capacity": args.fifo_capacity,
            "hash_compact": args.spin_hash_compact,
            "hash_bits": args.spin_hash_bits,
            "hash_seed": args.spin_hash_seed,
            "memory_limit_mb": args.spin_memory_mb,
        },
        deadline=None if args.max_seconds is None else time.time() + args.max_seconds,
        silent_waves=args.silent_waves,
    )


def print_human(result: dict[str, Any]) -> None:
    """Print a :func:`weightsync.model.check.check` result for people (rich table of properties, numbered counterexample)."""
    from rich.console import Console
    from rich.table import Table as RichTable

    from weightsync.model.properties import PROPERTIES

    con = Console()
    colour = {"verified": "green", "counterexample": "red"}.get(result["verdict"], "yellow")
    con.print(
        f"[bold]{result['variant']}[/bold]  N={result['ranks']}  mode={result['mode']}  "
        f"channels={result['channels']}  bounds={result['bounds']}  symmetry={result['symmetry']}  "
        f"reductions={','.join(result['reductions']) or 'none'}  engine={result.get('engine', 'compact')}"
    )
    if result.get("engine") == "spin":
        con.print(
            "SPIN: safety and deadlock only, stopping at its first violation (the other properties are then "
            "'not checked'); a counterexample is SPIN's trail replayed on the model's successor function"
        )
    con.print(
        f"[{colour}]{result['verdict']}[/{colour}]: {result['states']:,} states, "
        f"{result['transitions']:,} transitions, depth {result['depth']}, {result['seconds']:.2f} s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MB"
    )
    if "omission_bound" in result:
        con.print(
            f"[yellow]hash-compact storage[/yellow] (SPIN): not exhaustive; the probability that a reachable "
            f"state was left out is at most {result['omission_bound']:.1e} (hash seed {result['hash_seed']})"
        )
    if "levels_expanded" in result:
        con.print(
            f"[yellow]stopped before the end[/yellow]: every state within {result['levels_expanded']} steps of "
            "the initial state (in every mode) was expanded and checked; 'not checked' below means "
            "not proved beyond that depth"
        )
    if "stranded" in result:
        st = result["stranded"]
        con.print(
            f"--stalls: of the states in which a rank waits in a DP collective, {st['transient']:,} transient "
            f"(the peers join on their own), {st['stall']:,} stalls (only new client traffic frees it), "
            f"{st['hang']:,} hangs (only the collective's timeout)"
        )
    t = RichTable("property", "result", "statement (source)")
    for name, val in result["properties"].items():
        c = {"holds": "green", "violated": "red"}.get(val, "yellow")
        st, src = PROPERTIES[name]
        t.add_row(name, f"[{c}]{val}[/{c}]", f"{st} ({src})")
    con.print(t)
    cx = result.get("counterexample")
    if cx:
        con.print(f"[bold red]counterexample[/bold red] for {cx['property']} (mode {cx['mode']}):")
        for line in cx["steps"]:
            con.print("  " + line, markup=False, highlight=False)


__all__ = ["check", "print_human"]
