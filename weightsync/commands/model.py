"""The model checker's commands: ``variants``, ``check``, ``export``, ``prove`` and ``mutate``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from weightsync.commands.common import EXIT_OK, EXIT_USAGE, EXIT_VIOLATION, emit


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


def check(args: argparse.Namespace) -> int:
    """``weightsync check``: :func:`weightsync.model.check.check`; exit 1 on a counterexample."""
    from weightsync.model.check import check
    from weightsync.model.system import Bounds
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
        resume_during_update=args.resume_during_update,
    )
    out = check(
        args.variant,
        args.ranks,
        mode=args.mode,
        channels=args.channels,
        bounds=bounds,
        symmetry=args.symmetry,
        max_states=args.max_states,
        workers=args.workers,
        stalls=args.stalls,
    )
    emit(out, args.json, lambda: print_human(out))
    return EXIT_OK if out["verdict"] == "verified" else EXIT_VIOLATION


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


def prove(args: argparse.Namespace) -> int:
    """``weightsync prove [--check]``: regenerate ``proofs/`` and ``spec/``, or check that they are fresh."""
    from pathlib import Path

    from weightsync.model.proofs import check_fresh, prove

    root = Path.cwd()
    if args.check:
        import json as _json

        from weightsync.model.mutation_report import MUTATION_FILE, mutation_stale

        problems = check_fresh(root, allow_stale_mutation=args.allow_stale_mutation)
        warnings = []
        mpath = root / "proofs" / MUTATION_FILE
        if args.allow_stale_mutation and mpath.is_file() and mutation_stale(_json.loads(mpath.read_text())):
            warnings.append(
                f"WARNING: proofs/{MUTATION_FILE} was computed against another table and is not evidence "
                "for this one (allowed by --allow-stale-mutation); run `weightsync mutate --write`"
            )
        emit(
            {"fresh": not problems, "problems": problems, "warnings": warnings},
            args.json,
            lambda: print(
                "\n".join(problems + warnings) if problems or warnings else "proofs/ and spec/ are fresh"
            ),
        )
        return EXIT_VIOLATION if problems else EXIT_OK
    summary = prove(root, log=(lambda _m: None) if args.json else print)
    bad = [p for p in summary["proofs"] if p["verdict"] != p["expected"]]
    emit(summary, args.json, lambda: print(f"wrote proofs/ and spec/ ({summary['seconds']} s)"))
    return EXIT_VIOLATION if bad else EXIT_OK


def mutate(args: argparse.Namespace) -> int:
    """``weightsync mutate``: the mutation check (:mod:`weightsync.model.mutation_report`)."""
    from pathlib import Path

    from rich.progress import Progress

    from weightsync.model.mutation import (
        CHECKPOINT_FILE,
        checkpoint_writer,
        mutants,
        mutation_digest,
        read_checkpoint,
    )
    from weightsync.model.mutation_report import (
        MUTATION_FILE,
        annotate,
        mutation_report,
        report_markdown,
        write_report,
    )
    from weightsync.spec.rank import get_variant, spec_digest

    if args.workers < 1:
        msg = f"--workers must be >= 1, got {args.workers}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    if args.reuse:
        path = Path.cwd() / "proofs" / MUTATION_FILE
        rep = json.loads(path.read_text()) if path.is_file() else {}
        # a report is reusable for the table it was computed against (its table digest, or for a report
        # written before that field existed, the whole spec's digest)
        if rep.get("table_digest", "") != mutation_digest() and rep.get("spec_digest") != spec_digest():
            msg = f"--reuse: {path} is missing or was computed against another table; run without --reuse"
            emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
            return EXIT_USAGE
        rep["table_digest"] = mutation_digest()
        annotate(rep)
    else:
        total = sum(1 for _ in mutants(get_variant("two-phase-epoch").table))
        # every verdict is appended to a checkpoint as it arrives; a run of the same table resumes from it
        ckpt = Path.cwd() / "proofs" / CHECKPOINT_FILE
        decided = read_checkpoint(ckpt, mutation_digest())
        write = checkpoint_writer(ckpt, mutation_digest())
        with Progress(disable=args.json, transient=True) as bar:
            task = bar.add_task("mutants", total=total, completed=len(decided))

            def on_result(name: str, why: str | None) -> None:
                write(name, why)
                bar.advance(task)

            rep = mutation_report(workers=args.workers, on_result=on_result, decided=decided)
        if args.write:
            ckpt.unlink(missing_ok=True)  # the report now holds every verdict
    if args.write:
        write_report(Path.cwd(), rep)
    emit(rep, args.json, lambda: print(report_markdown(rep)))
    return EXIT_VIOLATION if rep["unexplained"] else EXIT_OK


def print_human(result: dict[str, Any]) -> None:
    """Print a :func:`weightsync.model.check.check` result for people (rich table of properties, numbered counterexample)."""
    from rich.console import Console
    from rich.table import Table as RichTable

    from weightsync.model.check import PROPERTIES

    con = Console()
    colour = {"verified": "green", "counterexample": "red"}.get(result["verdict"], "yellow")
    con.print(
        f"[bold]{result['variant']}[/bold]  N={result['ranks']}  mode={result['mode']}  "
        f"channels={result['channels']}  bounds={result['bounds']}  symmetry={result['symmetry']}"
    )
    con.print(
        f"[{colour}]{result['verdict']}[/{colour}]: {result['states']:,} states, "
        f"{result['transitions']:,} transitions, depth {result['depth']}, {result['seconds']:.2f} s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MB"
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


__all__ = ["check", "export", "mutate", "prove", "variants"]
