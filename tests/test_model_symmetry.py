"""Symmetry reduction is sound for the model: renaming ranks 1..N-1 is an automorphism of the transition
relation, the canonical form stays in the orbit, and the reduced exploration visits exactly the orbits of the
full one with the same verdict on every property (progress included)."""

from __future__ import annotations

import itertools
import random

import pytest

from weightsync.model.check import build_model, check_mode
from weightsync.model.explorer import explore
from weightsync.model.system import Bounds, Model

#: (variant, mode, channels, bounds): each rank-naming feature at least once.
CONFIGS = [
    ("two-phase-epoch", "keep", "per-socket", Bounds(stray_resume=True, repeat_resume=True)),
    ("two-phase-epoch", "abort", "per-socket", Bounds(failures=1, init_transfer=True)),
    ("two-phase-epoch", "wait", "per-socket", Bounds(client_aborts=1, requests=2, tokens=1)),
    ("two-phase-epoch", "keep", "ordered", Bounds()),
    ("two-phase", "keep", "per-socket", Bounds(stray_resume=True)),
    ("vllm-0.32", "keep", "one-api-server", Bounds(repeat_resume=True)),
    ("vllm-0.32-epoch", "wait", "per-socket", Bounds(resume_during_update=True)),
]


def _ids(c: tuple[str, str, str, Bounds]) -> str:
    flags = [k for k, v in c[3]._asdict().items() if v and v != Bounds()._asdict()[k]]
    return "-".join([c[0], c[1], c[2], *flags])


def _succ(m: Model, s: object) -> set[object]:
    return {t for _, t in m.successors(s)}  # type: ignore[arg-type]


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_renaming_ranks_is_an_automorphism(cfg: tuple[str, str, str, Bounds]) -> None:
    variant, mode, channels, bounds = cfg
    m = build_model(variant, 3, mode, channels, bounds)
    ex = explore([m.initial()], m.successors, max_states=60_000)
    swap = [0, 2, 1]
    sample = random.Random(7).sample(ex.states, min(3_000, len(ex.states)))
    for s in sample:
        p = m.permute(s, swap)
        assert m.permute(p, swap) == s  # an involution
        assert _succ(m, p) == {m.permute(t, swap) for t in _succ(m, s)}
        assert m.invariant(p) == m.invariant(s)
        assert m.terminal_check(p) == m.terminal_check(s)
        assert m.goal_pause(p) == m.goal_pause(s) and m.goal_resume(p) == m.goal_resume(s)
        c = m.canon(s)
        assert m.canon(c) == c and m.canon(p) == c  # one representative per orbit (N=3)


def test_n4_canon_is_in_the_orbit_and_order_free() -> None:
    m = build_model("two-phase-epoch", 4, "keep", bounds=Bounds(requests=2, stray_resume=True))
    ex = explore([m.initial()], m.successors, max_states=20_000)
    perms = [[0, *p] for p in itertools.permutations([1, 2, 3])]
    for s in random.Random(3).sample(ex.states, 400):
        c = m.canon(s)
        assert c in {m.permute(s, p) for p in perms}
        for p in perms:
            q = m.permute(s, p)
            assert _succ(m, q) == {m.permute(t, p) for t in _succ(m, s)}
            assert m.canon(q) == c


@pytest.mark.parametrize(
    "variant,channels,bounds",
    [
        ("two-phase-epoch", "ordered", Bounds(tokens=1, sync_interval=1, client_aborts=1)),
        ("two-phase", "ordered", Bounds(tokens=1, sync_interval=1, stray_resume=True)),
        (
            "two-phase-epoch",
            "per-socket",
            Bounds(requests=0, stray_resume=True, repeat_resume=True, failures=1, init_transfer=True),
        ),
    ],
    ids=["epoch-client-abort", "two-phase-stray", "epoch-failures-no-requests"],
)
def test_reduced_exploration_visits_exactly_the_orbits(variant: str, channels: str, bounds: Bounds) -> None:
    m = build_model(variant, 3, "abort", channels, bounds)
    full = check_mode(m, symmetry=False, keep=True)
    m2 = build_model(variant, 3, "abort", channels, bounds)
    red = check_mode(m2, symmetry=True, keep=True)
    assert full.exploration is not None and red.exploration is not None
    assert {m.canon(s) for s in full.exploration.states} == set(red.exploration.states)
    assert red.states < full.states
    assert red.properties == full.properties  # progress included
    assert (red.counterexample is None) == (full.counterexample is None)
    if full.counterexample is not None and red.counterexample is not None:
        assert red.counterexample["property"] == full.counterexample["property"]
        assert len(red.counterexample["steps"]) == len(full.counterexample["steps"])
