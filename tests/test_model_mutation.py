"""Mutation test: break one rule of the two-phase-epoch table at a time; the checker must notice.

Each mutant negates one row's guard (``always`` -> ``never``) or drops one of its updates or effects.
N=2, every pause mode, under each configuration of ``MUTATION_BOUNDS`` (default bounds; tokens=3 with
K=2; two cycles with the one-time transfer init; a client ABORT). Survivors are printed (and explained in
the project notes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.model.check import check
from weightsync.model.mutation import MUTATION_BOUNDS, kills, mutants
from weightsync.model.system import Bounds
from weightsync.spec.rank import get_variant
from weightsync.spec.states import PauseMode


def _table(name: str) -> object:
    return next(t for m, t in mutants(get_variant("two-phase-epoch").table) if m.name == name)


def test_mutants_cover_every_row() -> None:
    table = get_variant("two-phase-epoch").table
    ms = [m for m, _ in mutants(table)]
    rows = sum(len(v) for v in table.values())
    assert sum(1 for m in ms if m.kind == "guard") == rows
    assert len(ms) == rows + sum(len(t.updates) + len(t.effects) for v in table.values() for t in v)


@pytest.mark.parametrize(
    ("name", "prop"),
    [
        # without the epoch the resume-time race of two-phase comes back
        ("resuming/resume_barrier_done#0: drop update adopt_wave_after_barrier", None),
        ("verified/resume#0: drop effect enter_resume_barrier", None),
        # the properties added for the mutation check, one mutant each
        ("running/pause#0: drop update set_pause_state", "pause_gating"),
        ("running/step#0: drop effect execute_step", "tokens_exactly_once"),
        ("paused/dp_sync_done#0: drop effect clear_cache", "no_stale_kv"),
        ("updating/finish_done#1: drop update set_weight_version", "version_agreement"),
        ("verified/start_weight_update#0: drop effect start_weight_update", "phase_bracketing"),
    ],
)
def test_targeted_mutants_are_killed(name: str, prop: str | None) -> None:
    why = kills("two-phase-epoch", _table(name), modes=(PauseMode.ABORT, PauseMode.KEEP))  # type: ignore[arg-type]
    assert why is not None
    if prop is not None:
        assert why.endswith(":" + prop), why


def test_abort_mode_mutant_is_killed_by_mode_semantics() -> None:
    why = kills(
        "two-phase-epoch",
        _table("running/pause#0: drop effect abort_requests"),  # type: ignore[arg-type]
        modes=(PauseMode.ABORT,),
    )
    assert why is not None and why.endswith("mode_semantics"), why


def _unmutated_holds(mode: str, b: Bounds) -> None:
    out = check("two-phase-epoch", 2, mode=mode, bounds=b)
    bad = {k: v for k, v in out["properties"].items() if v != "holds"}
    if b.requests == 0:  # no request, no wave: only the non-vacuity witnesses fail, by design
        bad = {k: v for k, v in bad.items() if not k.startswith("sometimes_")}
    assert not bad, (b, bad, out.get("counterexample"))


def test_new_properties_hold_on_the_fix_with_extended_bounds() -> None:
    # the extra configurations of the mutation run hold on the unmutated table (keep mode here; the slow
    # test runs every mode)
    for c in MUTATION_BOUNDS[1:3]:
        _unmutated_holds("keep", c.bounds)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_extended_bounds_verify_every_mode() -> None:
    for c in MUTATION_BOUNDS:
        if c.exhaustive:
            _unmutated_holds("all", c.bounds)


@pytest.mark.slow
@pytest.mark.ci
def test_equivalence_classifier_agrees_with_the_checker() -> None:
    """A mutant that fires identically on every reachable lookup survives the checker (its transition
    system is the original's), and one that differs is reported with the first differing lookup."""
    from weightsync.model.mutation import first_difference, reachable_firings

    firings = reachable_firings("two-phase-epoch", MUTATION_BOUNDS[:1])
    eq = _table("running/START_DP_WAVE#0: drop update adopt_wave")  # the wave always equals the rank's
    assert first_difference(eq, firings) is None  # type: ignore[arg-type]
    assert kills("two-phase-epoch", eq) is None  # type: ignore[arg-type]
    diff = _table("running/pause#0: drop update set_pause_state")
    where = first_difference(diff, firings)  # type: ignore[arg-type]
    assert where is not None and "running/pause" in where, where


def test_mutation_refuses_a_table_that_fails_unmutated() -> None:
    """A mutant is killed only by what the original does not violate: lookups are not collected (and no
    mutant is run) for a table that already fails a configuration, in one process or several."""
    from weightsync.model.mutation import MutationConfig, reachable_firings

    cfg = (
        MutationConfig("stray", Bounds(stray_resume=True), 200_000, True, (PauseMode.KEEP, PauseMode.ABORT)),
    )
    for workers in (1, 2):
        with pytest.raises(
            RuntimeError, match=r"unmutated two-phase table fails stray:keep:collectives_match"
        ):
            reachable_firings("two-phase", cfg, workers=workers)


def test_checked_in_mutation_report_is_fresh_and_explained() -> None:
    from pathlib import Path

    from weightsync.model.mutation_report import mutation_problems

    assert mutation_problems(Path(__file__).resolve().parents[1]) == []


def test_a_stale_mutation_report_is_only_allowed_explicitly(tmp_path: Path) -> None:
    """A report computed against another table fails ``prove --check`` unless explicitly allowed."""
    import json

    from weightsync.model.mutation_report import MUTATION_FILE, mutation_problems

    (tmp_path / "proofs").mkdir()
    (tmp_path / "proofs" / MUTATION_FILE).write_text(
        json.dumps({"table_digest": "0" * 64, "variant": "two-phase-epoch", "survivors": []})
    )
    assert any("another table" in p for p in mutation_problems(tmp_path))
    assert mutation_problems(tmp_path, allow_stale=True) == []
    assert mutation_problems(tmp_path / "nowhere", allow_stale=True) != []  # a missing report still fails


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 25 min with 2 workers on the 2-core machine
def test_mutation_full_matches_the_checked_in_report() -> None:
    import json
    from pathlib import Path

    from weightsync.model.mutation_report import mutation_report

    r = mutation_report("two-phase-epoch", workers=2)
    print(f"{r['killed']}/{r['mutants']} killed in {r['seconds']} s; survivors:", *r["survivors"], sep="\n  ")
    assert not r["unexplained"], r["unexplained"]
    saved = json.loads((Path(__file__).resolve().parents[1] / "proofs" / "mutation.json").read_text())
    assert r["killed_by"] == saved["killed_by"] and r["equivalent"] == saved["equivalent"]
    assert r["score"] >= 0.9, r["score"]


@pytest.mark.slow
@pytest.mark.ci
def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Verdicts are appended to a checkpoint as they arrive; a run of the same table skips the mutants
    it already holds (their verdicts are kept), another table's checkpoint is ignored, and a last line cut
    by the interruption is dropped."""
    from weightsync.model.mutation import checkpoint_writer, mutation_digest, read_checkpoint, run_mutation

    ckpt = tmp_path / "m.jsonl"
    write = checkpoint_writer(ckpt, mutation_digest())
    first = run_mutation(limit=2, configs=MUTATION_BOUNDS[:1], on_result=write)
    assert first["mutants"] == 2
    with ckpt.open("a") as f:
        f.write('{"mutant": "cut sho')  # the process died mid-line
    decided = read_checkpoint(ckpt, mutation_digest())
    assert len(decided) == 2
    assert read_checkpoint(ckpt, "another table") == {}
    seen: list[str] = []
    again = run_mutation(
        limit=3, configs=MUTATION_BOUNDS[:1], decided=decided, on_result=lambda n, _w: seen.append(n)
    )
    names = [m.name for m, _ in mutants(get_variant("two-phase-epoch").table)][:3]
    assert seen == names[2:]  # only the third mutant was checked
    assert again["mutants"] == 3
    for n in names[:2]:
        assert (n in again["killed_by"]) == (n in first["killed_by"])
        assert again["killed_by"].get(n) == first["killed_by"].get(n)
