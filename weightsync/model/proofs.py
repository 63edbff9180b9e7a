"""``weightsync prove``: regenerate ``proofs/`` and ``spec/`` from the table, or check they are fresh.

``proofs/`` holds one JSON file per (variant, channel semantics, N in {2, 3}) with the verdict, counts,
seconds, properties, bounds, symmetry flag and the spec digest, plus a summary ``proofs/README.md``.
``--check`` recomputes the digest and the generated ``spec/`` files and fails when either is stale, or when
``proofs/mutation.json`` (``weightsync mutate --write``, about 30 minutes) was computed against another
table or lists an unexplained survivor; it does not re-explore (that is what ``prove`` without ``--check``
does).
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.model.check import DEFAULT_ENGINE, check
from weightsync.model.fsm_export import stale_spec_files, write_spec_dir
from weightsync.model.mutation_report import mutation_problems
from weightsync.model.system import Bounds
from weightsync.spec.rank import VARIANTS, spec_digest

CHANNELS = ("per-socket", "ordered")
RANKS = (2, 3)

#: Rows under other bounds: (tag, variant, channels, N, bounds, expected verdict). They carry the claims the
#: README makes about orchestrator inputs beyond the default bounds (issue: "a resume that is always safe").
_STRAY_REPEAT = Bounds(stray_resume=True, repeat_resume=True)
EXTRA_PROOFS: tuple[tuple[str, str, str, int, Bounds, str], ...] = (
    *(("stray-repeat-resume", "two-phase-epoch", "per-socket", n, _STRAY_REPEAT, "verified") for n in RANKS),
    ("failures", "two-phase-epoch", "per-socket", 2, Bounds(failures=1, init_transfer=True), "verified"),
    ("stray-resume", "two-phase", "per-socket", 2, Bounds(stray_resume=True), "counterexample"),
    ("client-abort", "two-phase-epoch", "per-socket", 2, Bounds(client_aborts=1), "verified"),
    # vLLM 0.32 (issue 10): one API server (requests and utility calls on one FIFO per engine), orchestrator
    # inputs beyond the default bounds, and the fix under them.
    ("one-api-server", "vllm-0.32", "one-api-server", 2, Bounds(), "counterexample"),
    ("one-api-server", "vllm-0.32-epoch", "one-api-server", 2, Bounds(), "verified"),
    ("pause-during-update", "vllm-0.32", "per-socket", 2, Bounds(pause_during_update=True), "counterexample"),
    (
        "resume-during-update",
        "vllm-0.32",
        "per-socket",
        2,
        Bounds(resume_during_update=True),
        "counterexample",
    ),
    ("pause-during-update", "vllm-0.32-epoch", "per-socket", 2, Bounds(pause_during_update=True), "verified"),
    (
        "resume-during-update",
        "vllm-0.32-epoch",
        "per-socket",
        2,
        Bounds(resume_during_update=True),
        "verified",
    ),
    # the fix on vLLM 0.32 under the orchestrator inputs two-phase-epoch is proved under (issue 19, item 1)
    ("stray-repeat-resume", "vllm-0.32-epoch", "per-socket", 2, _STRAY_REPEAT, "verified"),
    ("failures", "vllm-0.32-epoch", "per-socket", 2, Bounds(failures=1, init_transfer=True), "verified"),
    ("cycles-2", "vllm-0.32-epoch", "per-socket", 2, Bounds(cycles=2), "verified"),
    ("requests-2", "vllm-0.32-epoch", "per-socket", 2, Bounds(requests=2), "verified"),
    # an init while the engines serve (a restarted trainer reconnecting without a pause): a rank inside the
    # transfer group's rendezvous cannot take its part in the wave's DP step; the CI met it on real vLLM
    # (tests/test_vllm_moe_dp.py::test_init_while_a_wave_runs_deadlocks_as_shipped_...). The init gate
    # (guard alone_or_never_served, patch 0008) refuses it on a DP rank that served, and the controller
    # pauses, then inits; vLLM 0.32 as shipped has no gate.
    *(
        ("init-while-serving", v, "per-socket", 2, Bounds(init_while_serving=True), "verified")
        for v in ("two-phase-epoch", "vllm-0.32-epoch")
    ),
    ("init-while-serving", "vllm-0.32", "per-socket", 2, Bounds(init_while_serving=True), "counterexample"),
)
#: Rows explored with ``--mode any`` (the controller picks the pause mode at each pause), same fields. The
#: ``counterexample`` row of two-phase-epoch is an open finding (issue 19): it has no row for a pause at a
#: pausing rank (``repeat-pause``, ``phase_bracketing``). vllm-0.32-epoch verifies with patches 0005 (a wait
#: after a keep in flight drains the queue) and 0007 (a pause retried across the consensus joins it).
_REPEAT_PAUSE = Bounds(repeat_pause=True)
ANY_MODE_PROOFS: tuple[tuple[str, str, str, int, Bounds, str], ...] = (
    ("any-mode", "two-phase-epoch", "per-socket", 2, Bounds(), "verified"),
    ("any-mode", "vllm-0.32-epoch", "per-socket", 2, Bounds(), "verified"),
    ("any-mode", "vllm-0.32", "per-socket", 2, Bounds(), "counterexample"),
    (
        "any-mode-pause-during-update",
        "vllm-0.32-epoch",
        "per-socket",
        2,
        Bounds(pause_during_update=True),
        "verified",
    ),
    ("any-mode-repeat-pause", "two-phase-epoch", "per-socket", 2, _REPEAT_PAUSE, "verified"),
    ("any-mode-repeat-pause", "vllm-0.32-epoch", "per-socket", 2, _REPEAT_PAUSE, "verified"),
    (
        "any-mode-repeat-pause-during-update",
        "vllm-0.32-epoch",
        "per-socket",
        2,
        Bounds(repeat_pause=True, pause_during_update=True),
        "verified",
    ),
)


def proof_name(variant: str, channels: str, ranks: int) -> str:
    """File name of one proof under ``proofs/``."""
    return f"{variant}__{channels}__n{ranks}.json"


def extra_name(tag: str, variant: str, channels: str, ranks: int) -> str:
    """File name of one :data:`EXTRA_PROOFS` row under ``proofs/``."""
    return f"{variant}__{channels}__n{ranks}__{tag}.json"


def expected_proofs() -> list[tuple[str, str, int]]:
    """Every (variant, channels, N) that ``proofs/`` must hold."""
    return [(v, c, n) for v in VARIANTS for c in CHANNELS for n in RANKS]


def _fresh_row(path: Path, digest: str) -> dict[str, Any] | None:
    """The row in ``path`` if it was proved against the table with digest ``digest``; else None."""
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data if data.get("spec_digest") == digest else None


def prove(
    root: Path, log: Callable[[str], None] = print, missing_only: bool = False, engine: str = DEFAULT_ENGINE
) -> dict[str, Any]:
    """Regenerate ``root/spec`` and ``root/proofs``; returns the summary (also written as JSON).

    ``missing_only``: check only the rows whose file is missing or was proved against another table, and
    take the others from their files (a row added to :data:`EXTRA_PROOFS` costs its own check, not all).
    ``engine``: the exploration engine (:func:`weightsync.model.check.explore_model`)."""
    write_spec_dir(root / "spec")
    pdir = root / "proofs"
    pdir.mkdir(parents=True, exist_ok=True)
    digest = spec_digest()
    bounds = Bounds()
    rows = []
    t0 = time.perf_counter()
    jobs: list[tuple[str, str, int, Bounds, str, str, str, str]] = [
        (v, c, n, bounds, proof_name(v, c, n), VARIANTS[v].expected_verdict(c), "default", "all")
        for v, c, n in expected_proofs()
    ]
    jobs += [(v, c, n, b, extra_name(tag, v, c, n), exp, tag, "all") for tag, v, c, n, b, exp in EXTRA_PROOFS]
    jobs += [
        (v, c, n, b, extra_name(tag, v, c, n), exp, tag, "any") for tag, v, c, n, b, exp in ANY_MODE_PROOFS
    ]
    for variant, channels, ranks, row_bounds, fname, expected, tag, mode in jobs:
        kept = _fresh_row(pdir / fname, digest) if missing_only else None
        if kept is not None:
            rows.append(kept)
            continue
        result = check(variant, ranks, mode=mode, channels=channels, bounds=row_bounds, engine=engine)
        result.pop("peak_rss_mb", None)
        cx = result.get("counterexample")
        if cx is not None:
            cx.pop("records", None)
            cx.pop("labels", None)
        result["spec_digest"] = digest
        result["expected"] = expected
        result["bounds_tag"] = tag
        (pdir / fname).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        rows.append(result)
        log(
            f"{variant:16s} {channels:10s} N={ranks} {tag:20s}: {result['verdict']:14s} "
            f"{result['states']:>9,} states {result['seconds']:7.1f} s"
        )
    summary = {
        "spec_digest": digest,
        "python": platform.python_version(),
        # wall time of the run; with ``missing_only``, the rows' own check times (most were not re-run)
        "seconds": round(
            sum(float(r["seconds"]) for r in rows) if missing_only else time.perf_counter() - t0, 1
        ),
        "proofs": [
            {
                k: r[k]
                for k in (
                    "variant",
                    "channels",
                    "ranks",
                    "bounds_tag",
                    "verdict",
                    "expected",
                    "states",
                    "transitions",
                    "depth",
                    "seconds",
                )
            }
            | {"property": r.get("counterexample", {}).get("property", "")}
            for r in rows
        ],
    }
    (pdir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    (pdir / "README.md").write_text(_summary_markdown(summary, bounds))
    return summary


def _summary_markdown(summary: dict[str, Any], bounds: Bounds) -> str:
    lines = [
        "# Proofs",
        "",
        "GENERATED by `weightsync prove`; `weightsync prove --check` fails when the table changed since.",
        "",
        f"Spec digest: `{summary['spec_digest']}`. Default bounds: {bounds._asdict()}. Every pause mode (abort, "
        "wait, keep) is explored for each row, progress included; N=2 rows explore the full product, N=3 rows "
        "explore it up to permutations of ranks 1 and 2 (symmetry reduction, which every property survives: "
        "`weightsync/model/check.py`). Rows tagged `any-mode...` explore one model in which the controller "
        "picks the mode at each pause (`--mode any`). "
        f"Python {summary['python']}; total {summary['seconds']} s.",
        "",
        "Rows with other bounds (column `bounds`): "
        + "; ".join(
            dict.fromkeys(
                f"`{tag}` = {_changed(b, bounds)}" for tag, _, _, _, b, _ in (*EXTRA_PROOFS, *ANY_MODE_PROOFS)
            )
        )
        + ".",
        "",
        "| variant | channels | N | bounds | verdict | expected | violated property | states | transitions | depth "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["proofs"]:
        lines.append(
            f"| {p['variant']} | {p['channels']} | {p['ranks']} | {p['bounds_tag']} | {p['verdict']} | "
            f"{p['expected']} | "
            f"{p['property'] or '-'} | {p['states']:,} | {p['transitions']:,} | {p['depth']} | {p['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def _changed(b: Bounds, base: Bounds) -> str:
    return ", ".join(f"{k}={v}" for k, v in b._asdict().items() if v != getattr(base, k))


def check_fresh(root: Path, allow_stale_mutation: bool = False) -> list[str]:
    """Problems that make ``proofs/`` or ``spec/`` stale against the table (empty list: fresh).
    ``allow_stale_mutation``: see :func:`weightsync.model.mutation_report.mutation_problems`."""
    problems = [f"spec/{rel} is stale (run `weightsync prove`)" for rel in stale_spec_files(root / "spec")]
    digest = spec_digest()
    pdir = root / "proofs"
    names = [proof_name(v, c, n) for v, c, n in expected_proofs()]
    names += [extra_name(tag, v, c, n) for tag, v, c, n, _, _ in (*EXTRA_PROOFS, *ANY_MODE_PROOFS)]
    for name in names:
        p = pdir / name
        if not p.is_file():
            problems.append(f"proofs/{p.name} is missing (run `weightsync prove`)")
            continue
        data = json.loads(p.read_text())
        if data.get("spec_digest") != digest:
            problems.append(
                f"proofs/{p.name} was proved against another table (digest {str(data.get('spec_digest'))[:12]}, now {digest[:12]})"
            )
        if data.get("verdict") != data.get("expected"):
            problems.append(
                f"proofs/{p.name}: verdict {data.get('verdict')} but {data.get('expected')} expected"
            )
    summary = pdir / "summary.json"
    if not summary.is_file() or json.loads(summary.read_text()).get("spec_digest") != digest:
        problems.append("proofs/summary.json is missing or stale")
    return problems + mutation_problems(root, allow_stale=allow_stale_mutation)
