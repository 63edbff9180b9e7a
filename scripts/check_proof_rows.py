"""Re-explore proof rows and compare states, transitions and verdict with ``proofs/``.

Usage: ``python scripts/check_proof_rows.py [--quick | --all] [--workers W] [--only ROW ...]``.

Without arguments: the five N=2 per-socket default rows (two-phase, vllm-0.32, front-end-pause,
two-phase-epoch, vllm-0.32-epoch) and the ``failures``, ``stray-repeat-resume`` (N=2),
``pause-during-update`` and ``resume-during-update`` rows, each with ``workers=1``. Exit status 1 when any
differs (counterexamples: property, mode and steps too). ``--quick``: the five default rows only. ``--all``:
every row ``weightsync prove`` writes (about 30 minutes on 2 cores with ``--workers 2``). Each line prints
the row's process CPU seconds with ``--workers 1`` (to compare model speed across revisions, alternate runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from weightsync.model.check import check
from weightsync.model.proofs import EXTRA_PROOFS, expected_proofs, extra_name, proof_name
from weightsync.model.system import Bounds

ROOT = Path.cwd()  # the repository root (run from there)
DEFAULT_ROWS = ("two-phase", "vllm-0.32", "front-end-pause", "two-phase-epoch", "vllm-0.32-epoch")
EXTRA_TAGS = ("failures", "stray-repeat-resume", "pause-during-update", "resume-during-update")


def rows(quick: bool, every: bool = False) -> list[tuple[str, str, str, int, Bounds]]:
    """(file, variant, channels, N, bounds) of every row to re-explore (``every``: all of ``proofs/``)."""
    if every:
        out = [(proof_name(v, c, n), v, c, n, Bounds()) for v, c, n in expected_proofs()]
        return out + [(extra_name(tag, v, c, n), v, c, n, b) for tag, v, c, n, b, _ in EXTRA_PROOFS]
    out = [(proof_name(v, "per-socket", 2), v, "per-socket", 2, Bounds()) for v in DEFAULT_ROWS]
    if not quick:
        out += [
            (extra_name(tag, v, c, n), v, c, n, b)
            for tag, v, c, n, b, _ in EXTRA_PROOFS
            if tag in EXTRA_TAGS and n == 2
        ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--all", action="store_true", help="every row of proofs/")
    ap.add_argument("--workers", type=int, default=1, help="processes per row (one pause mode each)")
    ap.add_argument("--only", nargs="*", default=None, help="file names to run (default: all rows)")
    args = ap.parse_args()
    bad = 0
    for fname, variant, channels, n, bounds in rows(args.quick, args.all):
        if args.only and fname not in args.only:
            continue
        want = json.loads((ROOT / "proofs" / fname).read_text())
        c0 = time.process_time()
        got = check(variant, n, mode="all", channels=channels, bounds=bounds, workers=args.workers)
        cpu = time.process_time() - c0
        same = all(got[k] == want[k] for k in ("states", "transitions", "verdict", "depth"))
        same = same and {m: (r["states"], r["transitions"]) for m, r in got["per_mode"].items()} == {
            m: (r["states"], r["transitions"]) for m, r in want["per_mode"].items()
        }
        cx, cx0 = got.get("counterexample"), want.get("counterexample")
        same = same and (cx is None) == (cx0 is None)
        if cx is not None and cx0 is not None:
            same = same and (cx["property"], cx["mode"], cx["steps"]) == (
                cx0["property"],
                cx0["mode"],
                cx0["steps"],
            )
        bad += not same
        print(
            f"{'same' if same else 'DIFFERENT':9s} {fname:58s} {got['verdict']:14s} states {got['states']:>9,} "
            f"(proofs {want['states']:>9,}) transitions {got['transitions']:>10,} "
            f"(proofs {want['transitions']:>10,}) cpu {cpu:7.1f} s",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
