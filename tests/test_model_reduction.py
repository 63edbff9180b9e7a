"""The silent-wave reduction (``weightsync check --silent-waves``, :mod:`weightsync.model.system.reduction`):
both engines explore the same reduced graph, it is smaller, its verdicts are the unreduced model's, its
counterexamples replay on the unreduced model, and a table that breaks a premise is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tiers import CI_ONLY

from weightsync.model.check import build_model, check, check_mode
from weightsync.model.compact import CompactEngine
from weightsync.model.engines import explore_model
from weightsync.model.explorer import explore_checked
from weightsync.model.properties import SAFETY
from weightsync.model.system import Bounds, Model
from weightsync.model.system.premise import ReductionPremiseError
from weightsync.spec.rank import UPDATES
from weightsync.spec.rank_vars import RankVars, wave_dropped_for_good
from weightsync.spec.states import RankEvent
from weightsync.spec.table import Transition

ROOT = Path(__file__).resolve().parents[1]

# CI_ONLY: the default suite keeps one configuration of each channel kind but one-api-server, and the
# 16-20 s ones run in CI only

CONFIGS = [
    ("two-phase-epoch", 2, "keep", "per-socket", Bounds()),
    pytest.param(
        ("two-phase-epoch", 2, "wait", "ordered", Bounds(stray_resume=True, repeat_resume=True)),
        marks=CI_ONLY,
    ),
    pytest.param(
        ("two-phase-epoch", 2, "abort", "one-api-server", Bounds(repeat_resume=True)), marks=CI_ONLY
    ),
    ("two-phase-epoch", 2, "any", "ordered", Bounds()),
    pytest.param(("vllm-0.32-epoch", 2, "wait", "per-socket", Bounds(failures=1)), marks=CI_ONLY),
    ("vllm-0.32", 2, "keep", "ordered", Bounds()),
    pytest.param(("two-phase-epoch", 3, "wait", "per-socket", Bounds()), marks=pytest.mark.slow),  # 28 s
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-n{c[1]}-{c[2]}-{c[3]}")
def test_the_engines_explore_the_same_reduced_graph(cfg: tuple[str, int, str, str, Bounds]) -> None:
    """The compact engine's reduced successors are the model's, checked one by one (verify mode), and both
    engines count the same states and transitions; the reduced graph is strictly smaller."""
    variant, n, mode, channels, bounds = cfg
    sym = n > 2
    model = build_model(variant, n, mode, channels, bounds, silent_waves=True)
    engine = CompactEngine(model, verify=True, symmetry=sym)
    ex = explore_checked(
        engine.initial(),
        engine.successors,
        invariant=engine.invariant,
        terminal_check=engine.terminal_check,
        canon=engine.canon if sym else None,
        max_states=130_000,
    )
    assert ex.complete
    base = explore_model(
        build_model(variant, n, mode, channels, bounds, silent_waves=True), symmetry=sym, engine="baseline"
    )
    assert (len(base.states), base.transitions) == (len(ex.states), ex.transitions)
    full = explore_model(build_model(variant, n, mode, channels, bounds), symmetry=sym)
    assert len(ex.states) < len(full.states)


@pytest.mark.parametrize("channels", ["per-socket", "ordered"])
def test_the_reduced_graph_simulates_the_full_one(channels: str) -> None:
    """On the full graph of a small configuration: the full and reduced states have the same normal forms (every START_DP_WAVE its rank drops for good set aside: the
    simulation of the module docstring, checked state by state); more than a quarter of the full states
    hold one."""
    full_model = build_model("two-phase-epoch", 2, "keep", channels)
    red_model = build_model("two-phase-epoch", 2, "keep", channels, silent_waves=True)
    full = set(explore_model(full_model).states)
    red = set(explore_model(red_model).states)
    assert len(red) < len(full)
    assert {red_model.normal_form(s) for s in full} == {red_model.normal_form(s) for s in red}
    assert sum(1 for s in full if red_model.normal_form(s) != s) > len(full) // 4


def _replays(model: Model, labels: list[Any], prop: str) -> bool:
    """Whether ``labels`` are a path of the unreduced ``model`` whose end (last state, or last edge for an
    edge property) violates ``prop``."""
    s = model.initial()
    last = None
    for raw in labels:
        label = tuple(raw)
        succ = dict(model.successors(s))
        if label not in succ:
            return False
        last, s = (s, label, succ[label]), succ[label]
    if prop in model.invariant(s):
        return True
    if last is not None and prop in model.edge_check(*last):
        return True
    return not model.successors(s) and prop in model.terminal_check(s)


def _agree(name: str, mode: str) -> float:
    """The reduced verdict (safety and deadlock) of one mode of ``proofs/`` row ``name`` is the proof's; a
    counterexample replays on the unreduced model; returns its length over the unreduced shortest one."""
    row: dict[str, Any] = json.loads((ROOT / "proofs" / name).read_text())
    bounds = Bounds(**row["bounds"])
    out = check(
        row["variant"],
        row["ranks"],
        mode=mode,
        channels=row["channels"],
        bounds=bounds,
        symmetry=row["symmetry"],
        progress=False,
        silent_waves=True,
        workers=1,
    )
    assert "silent-waves" in out["reductions"]
    found = {p: d for p, d in row.get("violations", {}).get(mode, {}).items() if p in SAFETY}
    got = {p for p, x in out["properties"].items() if x == "violated" and p in SAFETY}
    assert got == set(found), (name, mode, got, found)
    if not found:
        assert out["verdict"] == "verified"
        return 1.0
    cx = out["counterexample"]
    full = build_model(row["variant"], row["ranks"], mode, row["channels"], bounds)
    assert _replays(full, cx["labels"], cx["property"]), (name, mode, cx["property"])
    return len(cx["labels"]) / (found[cx["property"]] - 1)


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("two-phase__per-socket__n2.json", "wait"),
        ("vllm-0.32__per-socket__n2.json", "keep"),
        ("two-phase-epoch__per-socket__n2.json", "abort"),
        ("vllm-0.32__per-socket__n2__any-mode.json", "any"),
    ],
)
def test_reduced_verdicts_match_the_proofs(name: str, mode: str) -> None:
    assert _agree(name, mode) <= 1.5


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_reduced_verdicts_match_every_proofs_row() -> None:
    """Every mode of every ``proofs/`` row: the same safety and deadlock verdict with the reduction, every
    counterexample replayed on the unreduced model, at most 1.5x the unreduced shortest one's length."""
    failures = []
    for path in sorted((ROOT / "proofs").glob("*__n*.json")):
        row = json.loads(path.read_text())
        for mode in row["per_mode"]:
            try:
                ratio = _agree(path.name, mode)
                assert ratio <= 1.5, f"counterexample {ratio:.2f}x the unreduced one"
            except AssertionError as exc:
                failures.append(f"{path.name} {mode}: {exc}")
    assert not failures, "\n".join(failures)


def test_a_removed_message_changes_nothing_but_its_fifo() -> None:
    """Receiving a START_DP_WAVE the predicate names is a stutter step of the full model: in every state of
    a full exploration where one is at a wave FIFO's head of a rank that can receive, the receipt only pops
    it."""
    model = build_model("vllm-0.32-epoch", 2, "keep", "per-socket")
    seen = 0
    for s in explore_model(model).states:
        for i, r in enumerate(s.ranks):
            q = r.inq[model.f_wave]
            if q and not r.blocked and wave_dropped_for_good(r.vars, i, q[0][1], q[0][2]):
                popped = r.with_inq((*r.inq[: model.f_wave], q[1:], *r.inq[model.f_wave + 1 :]))
                t = dict(model.successors(s))[("recv", i, model.f_wave)]
                assert t == s.with_ranks((*s.ranks[:i], popped, *s.ranks[i + 1 :]))
                seen += 1
    assert seen > 1000


def acting_on_stale_waves(base: Model) -> dict[Any, Any]:
    """``base``'s table with every START_DP_WAVE row that acts made unconditional: a rank re-arms on a stale
    wave, so the silent-wave reduction's first premise breaks (``tests/test_spin_silent.py`` uses it too)."""
    table = dict(base.table)
    for key, rows in base.table.items():
        if key[1] is RankEvent.START_DP_WAVE:
            act = next((t for t in rows if t.effects or t.updates), None)
            if act is not None:
                table[key] = (Transition("always", act.target, act.updates, act.effects, act.rule),)
    return table


def test_a_table_acting_on_a_stale_wave_is_refused() -> None:
    """A table whose rank re-arms on a stale START_DP_WAVE breaks the first premise: the reduced check stops
    with an error naming the rank, the message and the row, while the unreduced check of the same table runs
    to a verdict: re-arming on a stale wave strands a rank in a one-sided collective."""
    base = build_model("two-phase-epoch", 2, "keep")
    table = acting_on_stale_waves(base)
    model = Model(base.config, table=table, silent_waves=True)
    with pytest.raises(ReductionPremiseError, match=r"acts on START_DP_WAVE\(wave=\d+, exclude=0\)"):
        check_mode(model, progress=False)
    unreduced = check_mode(Model(base.config, table=table), progress=False, stop_at_first=True)
    assert unreduced.properties["no_one_sided_collective"] == "violated"


def test_an_update_lowering_the_wave_is_refused() -> None:
    """An update that moves ``current_wave`` back breaks the second premise."""

    def back(v: RankVars, a: Any) -> RankVars:
        return v._replace(current_wave=max(0, int(a["max_wave"]) - 1))

    model = Model(
        build_model("two-phase-epoch", 2, "keep").config,
        updates={**UPDATES, "adopt_wave_after_barrier": back},
        silent_waves=True,
    )
    with pytest.raises(ReductionPremiseError, match="never to decrease"):
        check_mode(model, progress=False)
