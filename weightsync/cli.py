"""The ``weightsync`` command line (design.md section 5).

Thin by design: it parses arguments, calls into :mod:`weightsync.model` and :mod:`weightsync.impl`, and
prints. Every command takes ``--json`` (one JSON object on stdout). Exit codes: 0 success / verified,
1 a property was violated or a check failed, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2


def emit(obj: dict[str, Any], as_json: bool, human: Callable[[], None]) -> None:
    """Print ``obj`` as one JSON object when ``as_json``, else call ``human`` to print for people."""
    if as_json:
        sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    else:
        human()


def _not_built(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        msg = f"weightsync {name}: not built yet"
        if getattr(args, "json", False):
            sys.stdout.write(json.dumps({"error": msg}) + "\n")
        else:
            sys.stderr.write(msg + "\n")
        return EXIT_USAGE

    return handler


def _int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting an int in ``[minimum, maximum]``; argparse names the flag in its error."""
    rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {rule}, got {text!r}") from None
        if v < minimum or (maximum is not None and v > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {v}")
        return v

    parse.__name__ = f"int {rule}"
    return parse


def _seconds(text: str) -> float:
    """An argparse ``type`` accepting a positive finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text}")
    return v


_seconds.__name__ = "seconds"
POSITIVE = _int_in(1)
NON_NEGATIVE = _int_in(0)
SEED = _int_in(0, 2**63 - 1)


class UsageError(Exception):
    """Bad command-line input (exit code 2); the message names the flag and the value.

    Attributes:
        usage: the usage line of the (sub)command that rejected the input.
    """

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` (so ``main`` can print them as JSON)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}", self.format_usage())


# Handlers are registered per command below; each returns an exit code.
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (one subcommand per design.md section 5 command)."""
    p = _Parser(prog="weightsync", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return sp

    add("variants", "list the protocol variants with a one-line description")

    c = add("check", "explore a variant's N-rank product exhaustively and check every property")
    c.add_argument("--variant", default="two-phase-epoch")
    c.add_argument("--ranks", type=POSITIVE, default=2)
    c.add_argument("--mode", default="all", choices=["abort", "wait", "keep", "all"])
    c.add_argument(
        "--channels",
        default="per-socket",
        choices=["per-socket", "one-api-server", "ordered"],
        help="per-socket: requests and utility calls unordered (two or more API servers); one-api-server: "
        "ADD, ABORT and utility calls share one FIFO per engine; ordered: one FIFO per destination",
    )
    c.add_argument("--requests", type=NON_NEGATIVE, default=1, help="bound on client requests")
    c.add_argument("--cycles", type=NON_NEGATIVE, default=1, help="bound on pause/update/resume cycles")
    c.add_argument("--sync-interval", type=POSITIVE, default=2, help="K: DP sync all-reduce every K steps")
    c.add_argument("--max-states", type=POSITIVE, default=20_000_000, help="stop exploring past this many")
    c.add_argument(
        "--symmetry",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="explore up to permutations of ranks 1..N-1 (every property, progress included, survives it; "
        "default: on from 3 ranks)",
    )
    c.add_argument(
        "--stalls",
        action="store_true",
        help="classify the states where a rank waits in a DP collective: transient (the peers join on "
        "their own), stall (only new client traffic frees it), hang (nothing does)",
    )
    c.add_argument(
        "--workers",
        type=POSITIVE,
        default=None,
        help="processes exploring the pause modes in parallel (default: one per mode, at most the CPUs)",
    )
    c.add_argument(
        "--stray-resume", action="store_true", help="the controller may issue one resume no pause preceded"
    )
    c.add_argument(
        "--repeat-resume",
        action="store_true",
        help="the controller may re-send resume once while its first is outstanding (a retry)",
    )
    c.add_argument(
        "--failures",
        type=NON_NEGATIVE,
        default=0,
        help="weight-transfer failures the model may inject (init, start, update, finish)",
    )
    c.add_argument(
        "--pause-during-update",
        action="store_true",
        help="the controller may send a second pause once while a weight round is in flight",
    )
    c.add_argument(
        "--resume-during-update",
        action="store_true",
        help="the controller may send resume once while a weight round is in flight",
    )
    c.add_argument("--tokens", type=POSITIVE, default=2, help="steps each request needs")
    c.add_argument(
        "--init-transfer", action="store_true", help="the controller calls init_weight_transfer_engine once"
    )

    e = add("export", "export the per-rank FSM, the global state graph or a counterexample")
    e.add_argument("what", choices=["rank-fsm", "state-graph", "counterexample"])
    e.add_argument("--format", default="mermaid", choices=["dot", "mermaid", "graphml", "svg"])
    e.add_argument("--out", required=True)
    e.add_argument("--variant", default="two-phase-epoch")
    e.add_argument("--ranks", type=POSITIVE, default=2)
    e.add_argument("--mode", default="keep", choices=["abort", "wait", "keep"])
    e.add_argument("--channels", default="per-socket", choices=["per-socket", "one-api-server", "ordered"])
    e.add_argument("--requests", type=NON_NEGATIVE, default=1)

    pr = add("prove", "regenerate proofs/ and spec/ (or, with --check, fail if they are stale)")
    pr.add_argument("--check", action="store_true")
    pr.add_argument(
        "--allow-stale-mutation",
        action="store_true",
        help="with --check: a mutation report computed against another table is a warning, not a failure",
    )

    mu = add("mutate", "mutation check of the two-phase-epoch table: break one row at a time, re-check")
    mu.add_argument("--workers", type=POSITIVE, default=2, help="processes (default 2)")
    mu.add_argument("--write", action="store_true", help="write proofs/mutation.json and proofs/MUTATION.md")
    mu.add_argument(
        "--reuse",
        action="store_true",
        help="do not re-run: read proofs/mutation.json (same table only), attach the current survivor notes "
        "and print the report (with --write: rewrite proofs/mutation.json and proofs/MUTATION.md)",
    )

    b = add("bench", "benchmarks with ratios against a baseline measured in the same run")
    b.add_argument("what", choices=["transfer", "explorer", "pause", "vllm"])
    b.add_argument("--quick", action="store_true", help="smaller sizes (for tests)")

    d = add("demo", "the main job: an asynchronous RL loop syncing a causal LM into DP engines")
    d.add_argument("--ranks", type=POSITIVE, default=2)
    d.add_argument("--steps", type=NON_NEGATIVE, default=20)
    d.add_argument("--transport", default="broadcast", choices=["broadcast", "ipc"])
    d.add_argument("--mode", default="keep", choices=["abort", "wait", "keep"])
    d.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (safetensors)")
    d.add_argument("--seed", type=SEED, default=0)
    d.add_argument("--variant", default="two-phase-epoch")
    d.add_argument("--timeout", type=_seconds, default=60.0, help="collective timeout, seconds")
    d.add_argument("--trace", default=None, help="trace file (JSONL); default under ./traces/")
    d.add_argument("--no-check", action="store_true", help="turn the runtime checker off")
    d.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="reference: weightsync's DP engines; vllm: a real AsyncLLM(data_parallel_size=2) (the vllm extra)",
    )
    d.add_argument("--moe", action="store_true", help="(--engine vllm) serve a tiny Mixtral (DP waves run)")
    d.add_argument(
        "--no-moe-reload-fix",
        action="store_true",
        help="(--engine vllm --moe) without weightsync's MoE reload fix: the checks must fail",
    )

    r = add("repro", "replay the model's counterexample schedule for VARIANT on real processes")
    r.add_argument("variant")
    r.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="collective timeout, seconds (reference: 5, at most 10; vllm: 30)",
    )
    r.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="reference: weightsync's DP engine; vllm: a real AsyncLLM(data_parallel_size=2) of a tiny MoE "
        "(variant vllm-0.32; needs the vllm extra)",
    )
    r.add_argument("--fix", choices=("epoch",), default=None, help="(--engine vllm) install the fix in vLLM")
    r.add_argument(
        "--mode",
        choices=("keep", "wait", "abort"),
        default="keep",
        help="pause mode of the model's counterexample and of the controller's pause",
    )
    r.add_argument(
        "--schedule",
        default=None,
        help="(reference, a fixed variant) the buggy variant whose counterexample to drive (default: the one "
        "it fixes, two-phase for two-phase-epoch)",
    )

    rp = add("replay", "validate recorded traces against the model")
    rp.add_argument(
        "traces",
        nargs="*",
        help="trace files: a system trace of the reference engine is walked through the model's successor "
        "function; a per-rank trace (e.g. vLLM's, from `weightsync record`) is replayed on the rank tables",
    )
    rp.add_argument(
        "--variant", default=None, help="replay against this variant's table (default: the header's)"
    )
    rp.add_argument(
        "--self-test",
        action="store_true",
        help="run the reference engine healthy (20 cycles) and with 6 deliberately broken behaviours, record "
        "a system trace of each and walk it: every broken one must be rejected at its fault",
    )
    rp.add_argument(
        "--case", action="append", default=[], help="(--self-test) run only this case (repeatable)"
    )
    rp.add_argument("--seed", type=SEED, default=0, help="(--self-test) seed of the traffic")
    rp.add_argument(
        "--workdir", default=None, help="(--self-test) where the traces go (default: a temporary directory)"
    )

    rc = add("record", "record a protocol trace from real engines (pause/update/resume cycles with traffic)")
    rc.add_argument(
        "--engine", choices=("vllm",), default="vllm", help="vllm: AsyncLLM(data_parallel_size=2), MoE"
    )
    rc.add_argument("--cycles", type=POSITIVE, default=20, help="controller cycles")
    rc.add_argument("--seed", type=SEED, default=0, help="seed of the request traffic and pause modes")
    rc.add_argument("--out", default="traces/vllm-0.32-cycles.jsonl", help="trace file (JSONL)")
    return p


for _name in ("variants", "check", "export", "prove", "mutate", "bench", "demo", "repro", "replay", "record"):
    HANDLERS[_name] = _not_built(_name)


# --------------------------------------------------------------------------- variants / check
def _variants(args: argparse.Namespace) -> int:
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


def _check(args: argparse.Namespace) -> int:
    from weightsync.model.check import check, print_human
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


HANDLERS["variants"] = _variants
HANDLERS["check"] = _check


# --------------------------------------------------------------------------- export / prove
def _export(args: argparse.Namespace) -> int:
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


def _prove(args: argparse.Namespace) -> int:
    from pathlib import Path

    from weightsync.model.proofs import check_fresh, prove

    root = Path.cwd()
    if args.check:
        import json as _json

        from weightsync.model.mutation import MUTATION_FILE, mutation_stale

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


HANDLERS["export"] = _export
HANDLERS["prove"] = _prove


def _mutate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.progress import Progress

    from weightsync.model.mutation import (
        CHECKPOINT_FILE,
        MUTATION_FILE,
        annotate,
        checkpoint_writer,
        mutants,
        mutation_digest,
        mutation_report,
        read_checkpoint,
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


HANDLERS["mutate"] = _mutate


# --------------------------------------------------------------------------- bench dispatcher
def _bench_pause(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.impl.engine.bench import run_pause_bench

    return run_pause_bench(quick=bool(getattr(args, "quick", False)))


def _bench_explorer(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.model.bench import run_explorer_bench

    return run_explorer_bench(quick=bool(getattr(args, "quick", False)))


#: ``weightsync bench WHAT``: what -> function(args) returning the JSON object (with "ok" when it checks).
BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"pause": _bench_pause}
BENCHES["explorer"] = _bench_explorer


def _bench_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.impl.transfer.bench import run_transfer_bench

    quick = bool(getattr(args, "quick", False))
    out = run_transfer_bench(quick=quick)
    # the targets are defined for the full ~512 MiB model; --quick reports its figures without judging them
    out["targets_judged"] = not quick
    out["ok"] = bool(out["targets_met"]) or quick
    return out


def _human_transfer(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    judged = out.get("targets_judged", True)
    title = f"bench transfer: {out['ranks']} ranks, gloo, {out['model_bytes'] / 2**20:.0f} MiB"
    t = Table(title=title + ("" if judged else " (--quick: targets not judged)"))
    for col in ("figure", "GB/s", "ratio", "target"):
        t.add_column(col)
    tg = out["targets"]
    t.add_row("raw broadcast (ceiling)", f"{out['raw_gbps']:.3f}", "", "")
    t.add_row(
        "packed broadcast, received in place",
        f"{out['packed_gbps']:.3f}",
        f"{out['packed_vs_raw']:.2f} x raw",
        f">= 0.9: {tg['packed_vs_raw>=0.9']}",
    )
    t.add_row(
        "packed, staged + load_weights copy",
        f"{out['packed_load_gbps']:.3f}",
        f"{out['packed_load_vs_raw']:.2f} x raw",
        "",
    )
    t.add_row(
        "per-tensor broadcast",
        f"{out['per_tensor_gbps']:.3f}",
        f"packed {out['packed_vs_per_tensor']:.2f} x",
        f">= 3: {tg['packed_vs_per_tensor>=3']}",
    )
    t.add_row("memcpy", f"{out['memcpy_gbps']:.3f}", "", "")
    t.add_row(
        "CPU IPC",
        f"{out['ipc_gbps']:.3f}",
        f"{out['ipc_vs_memcpy']:.2f} x memcpy",
        f">= 0.5: {tg['ipc_vs_memcpy>=0.5']}",
    )
    t.add_row(
        f"RSS growth, {out['rss_syncs']} syncs",
        f"{out['rss_growth_bytes']} B",
        f"bucket {out['bucket_bytes']} B",
        f"< bucket: {tg['rss_growth<bucket']}",
    )
    Console().print(t)


BENCHES["transfer"] = _bench_transfer
#: optional human renderers per bench (default: indented JSON)
BENCH_HUMAN: dict[str, Callable[[dict[str, Any]], None]] = {"transfer": _human_transfer}


def _vllm_module(args: argparse.Namespace, module: str, what: str) -> Any:
    """``weightsync.vllm.<module>`` for a command that runs the real vLLM, or None after the usage error
    (naming ``make venv``) when vLLM cannot be imported. vLLM logs to stdout by default
    (``vllm/envs.py`` ``VLLM_LOGGING_STREAM``): stdout is kept for the JSON."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        return importlib.import_module(f"weightsync.vllm.{module}")
    except ImportError as exc:
        msg = f"{what} needs vLLM ({exc}); install it with `make venv` (the vllm extra)"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return None


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines on stderr, unless ``--json``."""
    return None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))


def _bench_vllm(args: argparse.Namespace) -> int:
    """``bench vllm``: :func:`weightsync.vllm.bench.run_vllm_bench` (needs the vllm extra)."""
    mod = _vllm_module(args, "bench", "bench vllm")
    if mod is None:
        return EXIT_USAGE
    out = mod.run_vllm_bench(quick=bool(args.quick), log=_progress(args))
    emit(out, args.json, lambda: print(mod.human_summary(out)))
    return EXIT_OK if out["ok"] else EXIT_VIOLATION


def _bench(args: argparse.Namespace) -> int:
    if args.what == "vllm":
        return _bench_vllm(args)
    fn = BENCHES.get(args.what)
    if fn is None:
        code: int = _not_built(f"bench {args.what}")(args)
        return code
    out = fn(args)
    human = BENCH_HUMAN.get(args.what)
    emit(
        out,
        args.json,
        (lambda: human(out)) if human else (lambda: print(json.dumps(out, indent=2, default=str))),
    )
    return EXIT_OK if out.get("ok", True) else EXIT_VIOLATION


HANDLERS["bench"] = _bench


# --------------------------------------------------------------------------- repro / replay
def _repro_vllm(args: argparse.Namespace) -> int:
    """``repro vllm-0.32 --engine vllm [--fix epoch]``: :func:`weightsync.vllm.repro.run_vllm_repro`."""
    if args.variant != "vllm-0.32":
        msg = f"--engine vllm drives vLLM 0.32 as shipped: variant must be vllm-0.32, got {args.variant!r}"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    mod = _vllm_module(args, "repro", "--engine vllm")
    if mod is None:
        return EXIT_USAGE
    timeout = max(10, math.ceil(args.timeout)) if args.timeout is not None else 30
    res = mod.run_vllm_repro(
        args.variant, fix=args.fix, mode=args.mode, timeout_s=timeout, log=_progress(args)
    )
    out = res.as_dict()

    def human() -> None:
        print(f"{res.variant} on vLLM ({'fix ' + res.fix if res.fix else 'as shipped'}): {res.result}")
        print(f"  followed {res.followed_steps} model steps; diverged at {res.diverged_at}; {res.reason}")
        for r, w in sorted(res.ranks.items()):
            print(f"  rank {r}: {'blocked in ' + w if w else 'idle'} {res.errors.get(r, '')}")

    emit(out, args.json, human)
    want = "completed" if args.fix else "reproduced"
    return EXIT_OK if res.result == want else EXIT_VIOLATION


def _repro(args: argparse.Namespace) -> int:
    """``repro VARIANT``: the model's counterexample compiled by :mod:`weightsync.schedule` (glue, design s2:
    model and impl meet only here) and driven on the reference engine by
    :func:`weightsync.impl.engine.repro.run_schedule`."""
    from weightsync.impl.engine.repro import BUGGY, EXPECTED, Plan, run_schedule

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
    from weightsync.schedule import FIX_OF, compile_schedule, final_state, fix_schedule, model_counterexample
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
        cx = model_counterexample(schedule, args.mode)
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
            clear_cache=buggy.clear,
            tokens=buggy.T,
            sync_interval=buggy.K,
            timeout_s=timeout,
            log=_progress(args),
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


HANDLERS["repro"] = _repro


def _replay(args: argparse.Namespace) -> int:
    from weightsync.impl.checked import replay_trace
    from weightsync.model.replay import TraceChecker
    from weightsync.trace_selftest import is_system_trace, replay_report, self_test_report

    if args.self_test or (args.traces and all(is_system_trace(t) for t in args.traces)):
        try:
            if args.self_test:
                out = self_test_report(tuple(args.case), args.seed, args.workdir)
            else:
                out = replay_report(args.traces)
        except (OSError, ValueError) as exc:
            err = {"error": str(exc)}
            emit(err, args.json, lambda err=err: print(err["error"], file=sys.stderr))  # type: ignore[misc]
            return EXIT_USAGE

        def human_walk() -> None:
            for e in out["results"]:
                verdict = "rejected" if e["rejected"] else "accepted"
                where = f" at line {e['first_bad_line']}: {e['reason']}" if e["rejected"] else ""
                mark = "ok " if e.get("ok", not e["rejected"]) else "BAD"
                print(f"{mark} {e['name']}: {verdict} after {e['steps']} model steps{where}")

        emit(out, args.json, human_walk)
        return EXIT_OK if out["ok"] else EXIT_VIOLATION
    if not args.traces:
        err = {"error": "weightsync replay: give trace files, or --self-test"}
        emit(err, args.json, lambda: print(err["error"], file=sys.stderr))
        return EXIT_USAGE

    results = []
    checkers: list[TraceChecker] = []
    for path in args.traces:
        try:  # table edges (impl) + the model's composition check (collective outcomes, blocked ranks)
            checkers.append(TraceChecker())
            results.append(replay_trace(path, checkers[-1], variant=args.variant))
        except (OSError, ValueError) as exc:
            err = {"error": str(exc)}
            emit(err, args.json, lambda err=err: print(err["error"], file=sys.stderr))  # type: ignore[misc]
            return EXIT_USAGE
    ok = all(r.ok for r in results)
    out = {
        "ok": ok,
        "traces": [
            {
                "path": r.path,
                "ok": r.ok,
                "steps": r.steps,
                "ranks": r.ranks,
                "variant": r.variant,
                "collectives": r.collectives,
                "outcomes_checked": ck.outcomes_checked,
                "has_work_checked": ck.has_work_checked,
                "notes": ck.notes,
                "divergence": None if r.divergence is None else r.divergence.__dict__,
            }
            for r, ck in zip(results, checkers, strict=True)
        ],
    }

    def human() -> None:
        for r in results:
            if r.ok:
                print(f"{r.path}: ok, {r.steps} steps on {r.ranks} ranks ({r.variant})")
            else:
                assert r.divergence is not None
                print(f"{r.path}: DIVERGES at {r.divergence.describe()}")

    emit(out, args.json, human)
    return EXIT_OK if ok else EXIT_VIOLATION


HANDLERS["replay"] = _replay


def _record(args: argparse.Namespace) -> int:
    """``record --engine vllm``: :func:`weightsync.vllm.trace.record_cycles`."""
    mod = _vllm_module(args, "trace", "--engine vllm")
    if mod is None:
        return EXIT_USAGE
    out = mod.record_cycles(args.out, cycles=args.cycles, seed=args.seed, log=_progress(args))

    def human() -> None:
        print(
            f"{out['cycles']} cycles, {out['requests']} requests ({out['finished']} finished, {out['aborted']} "
            f"aborted), modes {out['modes']}: {out['lines']} trace lines -> {out['path']} ({out['seconds']:.0f} s)"
        )
        print(f"check it: weightsync replay --variant vllm-0.32 {out['path']}")

    emit(out, args.json, human)
    return EXIT_OK


HANDLERS["record"] = _record


# --------------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _demo_vllm(args)
    if args.moe or args.no_moe_reload_fix:
        msg = "--moe and --no-moe-reload-fix apply to --engine vllm"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    from weightsync.impl.demo import demo_command

    return demo_command(args)


def _demo_vllm(args: argparse.Namespace) -> int:
    """``demo --engine vllm``: :func:`weightsync.vllm.demo.run_vllm_demo` (2 DP engines)."""
    if args.ranks != 2 or args.transport != "broadcast" or args.model or args.no_check:
        msg = "--engine vllm runs 2 DP engines with the broadcast backend, the built-in policy and the checks"
        emit({"error": msg}, args.json, lambda: print(msg, file=sys.stderr))
        return EXIT_USAGE
    mod = _vllm_module(args, "demo", "--engine vllm")
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
    out = mod.run_vllm_demo(cfg, log=_progress(args))

    def human() -> None:
        print(
            f"vLLM demo ({out['model']}): {out['steps']} steps, reward {out['reward_first']} -> "
            f"{out['reward_last']}; greedy_equal={out['greedy_equal']} max_logprob_diff="
            f"{out['max_logprob_diff']:.2e} lost_requests={out['lost_requests']} versions_ok={out['versions_ok']}; "
            f"trace {out['trace']} replays: {out['trace_ok']} ({out['seconds']:.0f} s)"
        )

    emit(out, args.json, human)
    return EXIT_OK if out["ok"] else EXIT_VIOLATION


HANDLERS["demo"] = _demo


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightsync`` console script; returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version exit 0
        return int(exc.code or 0)
    except UsageError as exc:  # a bad flag or value: exit 2 naming it (design.md s5)
        if "--json" in argv:
            sys.stdout.write(json.dumps({"error": str(exc)}) + "\n")
        else:
            sys.stderr.write(exc.usage)
        sys.stderr.write(f"{exc}\n")
        return EXIT_USAGE
    return HANDLERS[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
