"""The ``weightsync`` argument parser: every subcommand, its options and their checks (a bad value is a
:class:`UsageError`, exit 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from weightsync.bench.reach import ROW_BUDGET_S
from weightsync.model.check import CHECK_ENGINES, DEFAULT_ENGINE, ENGINES
from weightsync.model.properties import PROPERTIES
from weightsync.spec.states import PauseMode

#: vLLM's pause modes (spec ``PauseMode``), the ``--mode`` choices
MODES = [m.value for m in PauseMode]


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


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (one subcommand per command)."""
    import weightsync.cli

    doc = weightsync.cli.__doc__
    p = _Parser(prog="weightsync", description=doc.splitlines()[0] if doc else None)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return sp

    add("variants", "list the protocol variants with a one-line description")

    c = add("check", "explore a variant's N-rank product exhaustively and check every property")
    c.add_argument("--variant", default="two-phase-epoch")
    c.add_argument("--ranks", type=POSITIVE, default=2)
    c.add_argument(
        "--mode",
        default="all",
        choices=[*MODES, "all", "any"],
        help="all: each pause mode in its own exploration; any: the controller picks the mode at each pause "
        "(a second pause may differ from the first)",
    )
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
        "--max-seconds",
        type=_seconds,
        default=None,
        help="stop exploring after this many seconds; an unfinished run reports how many BFS levels it "
        "explored completely (levels_expanded): a bounded verdict",
    )
    c.add_argument(
        "--symmetry",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="explore up to permutations of ranks 1..N-1 (every property, progress included, survives it; "
        "default: on from 3 ranks)",
    )
    c.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also check the progress properties (every reachable state can reach a goal), which keeps "
        "every edge in memory; --no-progress checks safety and deadlock only (default: on)",
    )
    c.add_argument(
        "--silent-waves",
        action="store_true",
        help="the silent-wave reduction: a START_DP_WAVE its rank drops for good (older than its wave, or "
        "excluding it) is taken at once; safety and deadlock only (progress is then not checked), its "
        "premises checked against the table on every state (see README, 'The silent-wave reduction'); with --engine spin "
        "too, except under --channels ordered",
    )
    c.add_argument(
        "--stalls",
        action="store_true",
        help="classify the states where a rank waits in a DP collective: transient (the peers join on "
        "their own), stall (only new client traffic frees it), hang (nothing does)",
    )
    c.add_argument(
        "--counterexample-of",
        choices=list(PROPERTIES),
        default=None,
        metavar="PROPERTY",
        help="report this property's shortest counterexample where it is violated (default: the most "
        "specific violation: mismatched collectives, one-sided collective, deadlock, ...)",
    )
    _engine_argument(c, spin=True)
    c.add_argument(
        "--spin-search",
        choices=["bfs", "dfs"],
        default="bfs",
        help="(--engine spin) bfs: breadth-first, a shortest counterexample; dfs: depth-first with SPIN's "
        "partial-order reduction (a one-process model gives it nothing to reduce) and --spin-cores workers",
    )
    c.add_argument(
        "--spin-cores",
        type=POSITIVE,
        default=1,
        help="(--engine spin --spin-search dfs) pan's -DNCORE workers",
    )
    c.add_argument(
        "--spin-hash-bits",
        type=_int_in(10, 36),
        default=22,
        help="(--engine spin) pan's -w: log2 of its hash table's slots (8 bytes each); about log2 of the "
        "expected states keeps the chains short (default: 22)",
    )
    c.add_argument(
        "--spin-memory-mb",
        type=POSITIVE,
        default=None,
        help="(--engine spin) pan's -DMEMLIM in MB (a run that reaches it stops with an error, never a "
        "verdict); default: pan's own (2048 MB with --spin-cores above 1)",
    )
    c.add_argument(
        "--spin-hash-compact",
        action="store_true",
        help="(--engine spin) hash-compact storage (pan -DHC4): 12 bytes of each state's hash instead of "
        "the state, about 40 bytes a state in all; not exhaustive: the result bounds the probability that "
        "a reachable state was left out (omission_bound)",
    )
    c.add_argument(
        "--spin-hash-seed",
        type=_int_in(0, 499),
        default=0,
        help="(--engine spin) pan's -h: which of its hash seeds to hash with; under --spin-hash-compact "
        "another seed is another signature function, so equal state counts from two seeds are independent "
        "evidence that no state was left out (default: 0)",
    )
    c.add_argument(
        "--fifo-capacity",
        type=POSITIVE,
        default=None,
        help="(--engine spin) slots of each FIFO in the Promela model (the model's are unbounded: a run that "
        "fills one stops with an error naming it, never with a verdict); default: 8, doubled after each run "
        "a full FIFO stopped, up to 64",
    )
    c.add_argument(
        "--workers",
        type=POSITIVE,
        default=None,
        help="processes exploring the pause modes in parallel (default: one per mode, at most the CPUs; "
        "with --max-seconds, one per mode)",
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
        "--repeat-pause",
        action="store_true",
        help="the controller may send pause once more while its pause is outstanding or after it returned "
        "(with --mode any, in another mode)",
    )
    c.add_argument(
        "--init-while-serving",
        action="store_true",
        help="the controller may call init_weight_transfer_engine once more after a resume, while the "
        "engines serve (a restarted trainer reconnecting without a pause)",
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
    e.add_argument("--mode", default="keep", choices=MODES)
    e.add_argument("--channels", default="per-socket", choices=["per-socket", "one-api-server", "ordered"])
    e.add_argument("--requests", type=NON_NEGATIVE, default=1)

    pr = add("prove", "regenerate proofs/ and spec/ (or, with --check, fail if they are stale)")
    pr.add_argument("--check", action="store_true")
    pr.add_argument(
        "--missing",
        action="store_true",
        help="check only the rows whose file is missing or proved against another table; keep the others",
    )
    _engine_argument(pr)
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
    b.add_argument("what", choices=["transfer", "explorer", "por", "pause", "vllm"])
    b.add_argument("--quick", action="store_true", help="smaller sizes (for tests)")
    b.add_argument(
        "--dp",
        type=POSITIVE,
        action="append",
        default=None,
        help="(vllm) a configuration of this many DP engines, one worker each; repeat for several "
        "(default: 1 and 2; --quick: 1)",
    )
    b.add_argument(
        "--budget",
        type=POSITIVE,
        default=ROW_BUDGET_S,
        help="(explorer) seconds each time-to-verdict row (N = 2, 3, 4, 6, 8) may take before it is stopped "
        "(default: 1800, issue 19's limit for N = 8)",
    )
    b.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="(vllm) start the engines with glibc's malloc defaults instead of the steady settings the "
        "bench applies (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_; reported as 'allocator')",
    )

    d = add("demo", "the main job: an asynchronous RL loop syncing a causal LM into DP engines")
    d.add_argument("--ranks", type=POSITIVE, default=2)
    d.add_argument("--steps", type=NON_NEGATIVE, default=20)
    d.add_argument("--transport", default="broadcast", choices=["broadcast", "ipc"])
    d.add_argument("--mode", default="keep", choices=MODES)
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
        choices=MODES,
        default="keep",
        help="pause mode of the model's counterexample and of the controller's pause",
    )
    r.add_argument(
        "--property",
        choices=list(PROPERTIES),
        default=None,
        help="drive the counterexample of this property (reference: any the model violates, e.g. "
        "wait_drains with --mode wait; --engine vllm, as shipped: front_end_belief); default: the most "
        "specific violation",
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
    t = add("token", "manage the deployment secret that admits a trainer and its engines to a transfer group")
    t.add_argument("action", choices=["new"], help="new: write a new secret (mode 0600, never overwriting)")
    t.add_argument("path", help="where to write it")
    return p


def _engine_argument(p: argparse.ArgumentParser, spin: bool = False) -> None:
    """``--engine`` of ``check`` (``spin`` too: :data:`~weightsync.model.check.CHECK_ENGINES`) and ``prove``
    (:data:`~weightsync.model.engines.ENGINES`)."""
    p.add_argument(
        "--engine",
        choices=list(CHECK_ENGINES if spin else ENGINES),
        default=DEFAULT_ENGINE,
        help="exploration engine: compact (states as ints, transitions memoised per part; the default) or "
        "baseline (the model's successor function on state tuples); both give the same states, counts and "
        "verdicts"
        + (
            "; spin: SPIN on Promela generated from the same tables (safety and deadlock only; its trail is "
            "replayed on the model)"
            if spin
            else ""
        ),
    )


__all__ = ["MODES", "UsageError", "build_parser"]
