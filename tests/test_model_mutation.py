"""Mutation test: break one rule of the two-phase-epoch table at a time; the checker must notice.

Each mutant negates one row's guard (``always`` -> ``never``) or drops one of its updates or effects.
N=2, one request, every pause mode. Survivors are printed (and explained in the project notes).
"""

from __future__ import annotations

import pytest

from weightsync.model.mutation import kills, mutants, run_mutation
from weightsync.spec.rank import get_variant
from weightsync.spec.states import PauseMode


def test_mutants_cover_every_row() -> None:
    table = get_variant("two-phase-epoch").table
    ms = [m for m, _ in mutants(table)]
    rows = sum(len(v) for v in table.values())
    assert sum(1 for m in ms if m.kind == "guard") == rows
    assert len(ms) == rows + sum(len(t.updates) + len(t.effects) for v in table.values() for t in v)


@pytest.mark.parametrize(
    "name",
    [
        # without the epoch the resume-time race of two-phase comes back
        "resuming/resume_barrier_done#0: drop update adopt_wave_after_barrier",
        "verified/resume#0: drop effect enter_resume_barrier",
    ],
)
def test_targeted_mutants_are_killed(name: str) -> None:
    table = next(t for m, t in mutants(get_variant("two-phase-epoch").table) if m.name == name)
    assert kills("two-phase-epoch", table, modes=(PauseMode.ABORT, PauseMode.KEEP)) is not None


@pytest.mark.slow
def test_mutation_full_large_majority_killed() -> None:
    r = run_mutation("two-phase-epoch")
    print(f"{r['killed']}/{r['mutants']} killed; survivors:", *r["survivors"], sep="\n  ")
    assert r["killed"] >= 0.8 * r["mutants"]
