"""The compact engine (weightsync/model/compact) explores exactly what the baseline engine explores: the same
states in the same BFS order, the same edges, counts, depth, violations and counterexamples; and every memo
entry it uses agrees with a fresh computation of the model (``verify=True``, the cache-consistency mode)."""

from __future__ import annotations

from typing import Any

import pytest
from tiers import CI_ONLY

from weightsync.model.check import build_model, check, check_mode, explore_model
from weightsync.model.compact import CompactEngine, explore_compact
from weightsync.model.compact.canon import OrderLabels
from weightsync.model.explorer import Exploration
from weightsync.model.system import Bounds, G

#: (variant, ranks, mode, channels, bounds, max_states): small configurations covering every memo (rank
#: moves, coordinator broadcasts, refresh, controller fan-outs, DP completions), the slow paths (transfer
#: collectives and timeouts, sends, client aborts, front-end calls) and the settle reduction. The default
#: suite runs six of them; ``CI_ONLY_CONFIGS`` (wait and abort per-socket, stray and repeated resumes, the
#: front-end-pause variant, one-api-server channels, two-phase's stray resume) run in CI
#: (``make test-slow-ci``), once.
CONFIGS: list[tuple[str, int, str, str, Bounds, int]] = [
    ("two-phase-epoch", 2, "keep", "per-socket", Bounds(), 30_000),
    ("two-phase-epoch", 2, "wait", "per-socket", Bounds(), 30_000),
    ("two-phase-epoch", 2, "abort", "per-socket", Bounds(), 30_000),
    ("vllm-0.32", 2, "keep", "per-socket", Bounds(), 60_000),  # counterexamples
    ("two-phase-epoch", 2, "any", "per-socket", Bounds(repeat_pause=True), 30_000),
    ("two-phase-epoch", 2, "keep", "per-socket", Bounds(stray_resume=True, repeat_resume=True), 30_000),
    ("two-phase-epoch", 2, "keep", "per-socket", Bounds(failures=1, init_transfer=True), 30_000),
    ("two-phase-epoch", 2, "abort", "ordered", Bounds(client_aborts=1), 30_000),
    ("front-end-pause", 2, "abort", "per-socket", Bounds(), 30_000),
    ("vllm-0.32-epoch", 2, "keep", "one-api-server", Bounds(), 30_000),
    ("two-phase", 2, "keep", "per-socket", Bounds(stray_resume=True), 30_000),
    ("two-phase-epoch", 3, "keep", "per-socket", Bounds(), 30_000),
]
CI_ONLY_CONFIGS = {1, 2, 5, 8, 9, 10}
PARAMS = [
    pytest.param(
        *cfg,
        id=f"{cfg[0]}-n{cfg[1]}-{cfg[2]}-{cfg[3]}-{i}",
        marks=CI_ONLY if i in CI_ONLY_CONFIGS else (),
    )
    for i, cfg in enumerate(CONFIGS)
]


def _same(a: Exploration[G], b: Exploration[G]) -> None:
    """Two explorations are the same, state for state and edge for edge."""
    assert (len(a.states), a.transitions, a.depth, a.complete) == (
        len(b.states),
        b.transitions,
        b.depth,
        b.complete,
    )
    assert list(a.states) == list(b.states)
    assert list(a.parent) == list(b.parent) and a.via == b.via and list(a.level) == list(b.level)
    assert a.src is not None and b.src is not None and a.dst is not None and b.dst is not None
    assert list(a.src) == list(b.src) and list(a.dst) == list(b.dst)
    assert a.terminal == b.terminal
    assert {k: (v.state, v.label, v.target) for k, v in a.violations.items()} == {
        k: (v.state, v.label, v.target) for k, v in b.violations.items()
    }


@pytest.mark.parametrize("variant,ranks,mode,channels,bounds,cap", PARAMS)
def test_compact_explores_what_the_baseline_explores(
    variant: str, ranks: int, mode: str, channels: str, bounds: Bounds, cap: int
) -> None:
    """Same exploration as the baseline, with every memo hit checked against the model (verify mode)."""
    base = explore_model(
        build_model(variant, ranks, mode, channels, bounds),
        engine="baseline",
        keep_edges=True,
        max_states=cap,
    )
    comp, engine = explore_compact(
        build_model(variant, ranks, mode, channels, bounds), keep_edges=True, max_states=cap, verify=True
    )
    _same(base, comp)
    stats = engine.stats()
    assert stats["local_lookups"] > stats["local_entries"] > 0  # the rank-local memo was used, and hit


@pytest.mark.parametrize(
    "variant,ranks,mode,bounds",
    [
        ("two-phase-epoch", 2, "all", Bounds(tokens=1, sync_interval=1)),
        ("vllm-0.32", 2, "keep", Bounds()),
        ("two-phase-epoch", 3, "keep", Bounds(requests=0)),
        ("two-phase-epoch", 2, "any", Bounds(requests=0, repeat_pause=True)),  # vacuous: a counterexample
        ("two-phase", 2, "keep", Bounds(stray_resume=True)),
    ],
)
def test_check_gives_the_same_result_on_both_engines(
    variant: str, ranks: int, mode: str, bounds: Bounds
) -> None:
    """``weightsync check``'s figures, properties (progress included) and counterexample do not depend on
    the engine (symmetry on at N=3: the same representatives)."""

    def run(engine: str) -> dict[str, Any]:
        out = check(variant, ranks, mode=mode, bounds=bounds, workers=1, engine=engine)
        for key in ("seconds", "peak_rss_mb", "engine"):
            out.pop(key)
        for row in out["per_mode"].values():  # the process's peak so far: depends on what ran before
            row.pop("seconds")
            row.pop("peak_rss_mb")
        return out

    assert run("compact") == run("baseline")


def test_counterexample_and_replay_work_on_the_compact_engine() -> None:
    """A counterexample found by the compact engine is the baseline's (steps and labels), and its path
    decodes to concrete states of the model."""
    r1 = check_mode(build_model("vllm-0.32", 2, "keep"), engine="compact", keep=True)
    r2 = check_mode(build_model("vllm-0.32", 2, "keep"), engine="baseline")
    assert r1.counterexample is not None and r1.counterexample == r2.counterexample
    ex = r1.exploration
    assert ex is not None
    v = next(iter(ex.violations.values()))
    s = ex.states[v.state]
    assert ex.index[s] == v.state  # the decoded index finds a decoded state
    assert ex.states[: v.state + 1][-1] == s


@pytest.mark.parametrize(
    "variant,mode,channels,bounds",
    [
        ("two-phase-epoch", "keep", "per-socket", Bounds()),
        ("two-phase", "abort", "ordered", Bounds(tokens=1, sync_interval=1, stray_resume=True)),
    ],
)
def test_symmetry_gives_the_same_representatives(
    variant: str, mode: str, channels: str, bounds: Bounds
) -> None:
    """With symmetry reduction at N=3, the compact engine keeps the baseline's representatives (its own
    canonical form, swap and renaming included, checked against the model's at every call)."""
    a = explore_model(
        build_model(variant, 3, mode, channels, bounds),
        symmetry=True,
        engine="baseline",
        keep_edges=True,
        max_states=20_000,
    )
    b, engine = explore_compact(
        build_model(variant, 3, mode, channels, bounds),
        symmetry=True,
        keep_edges=True,
        max_states=20_000,
        verify=True,
    )
    _same(a, b)
    assert engine._ren  # the renaming swap was used


@pytest.mark.parametrize(
    ("ranks", "mode", "states"),
    [pytest.param(4, "keep", 45_000, marks=pytest.mark.slow), (5, "abort", 15_000)],  # N=4: 23 s
)
def test_symmetry_beyond_three_ranks_gives_the_same_representatives(
    ranks: int, mode: str, states: int
) -> None:
    """At N = 4 and 5 the compact engine's canonical form (ranks sorted without decoding, renamed by the
    permutation where a message names a rank) keeps the baseline's representatives, checked against the
    model's canon at every call; the sorted path, not the model's, decides most states, and a rank's own
    move that comes canonical already (``resorted``) is checked to be the model's canon of its successor.
    Runs of ranks tied on their own view with a message naming one of them are sorted by the whole key
    (both runs); N = 4 keep gets far enough to rename a message naming a rank that moved."""
    bounds = Bounds()
    a = explore_model(
        build_model("two-phase-epoch", ranks, mode, "per-socket", bounds),
        symmetry=True,
        engine="baseline",
        keep_edges=True,
        max_states=states,
    )
    b, engine = explore_compact(
        build_model("two-phase-epoch", ranks, mode, "per-socket", bounds),
        symmetry=True,
        keep_edges=True,
        max_states=states,
        verify=True,
    )
    _same(a, b)
    assert engine.tie_sorts  # a run of tied ranks, one of them named, was sorted by the whole key
    if ranks == 4:
        assert any(len(set(perm)) == ranks for _, perm in engine._ren)  # a renaming permutation was used
    assert engine.plain_reorders  # the plain sorted order (int labels) reordered states
    assert engine.presorted  # a rank's own move came canonical already, and was the model's canon


def test_order_labels_keep_the_order_of_their_keys_through_renumbering() -> None:
    """OrderLabels: labels compare as their keys do, equal keys share a label, and a gap that runs out
    (keys placed again and again between the same two) renumbers every label (``epoch``) and keeps the
    order. Keys are tuples as the canonical form's are."""
    order = OrderLabels()
    keys = [(0, "a"), (1, "z")]
    lo, hi = 0.0, 1.0
    for _ in range(40):  # each new key between the previous one and (1, "z"): halves one gap 40 times
        lo = (lo + hi) / 2
        keys.append((lo, "m"))
    for key in keys:
        order.label(key)
    assert order.epoch >= 1  # 32 halvings of a gap of 2**32 leave no int: renumbered
    assert order.label((0, "a")) == order.of[(0, "a")]  # equal key, same label
    by_label = sorted(keys, key=order.label)
    assert by_label == sorted(keys)
    assert len({order.label(k) for k in keys}) == len(keys)
    assert order.keys == sorted(keys) and order.labels == sorted(order.labels)


def test_a_broken_memo_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify mode fails when a memo entry is wrong: here the rank-local memo forgets the rest (its key
    drops the rest's id), which the model's transitions do read."""
    orig_get = dict.get

    class ForgetfulDict(dict[Any, Any]):
        def get(self, key: Any, default: Any = None) -> Any:
            return orig_get(self, (key[0], key[1], 0, key[3]), default)

        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__((key[0], key[1], 0, key[3]), value)

    engine = CompactEngine(build_model("two-phase-epoch", 2, "keep"), verify=True)
    engine._local = ForgetfulDict()
    with pytest.raises(AssertionError, match="successors differ"):
        frontier = engine.initial()
        seen = set(frontier)
        while frontier:  # a plain BFS until the broken memo is used on a state it does not fit
            nxt = []
            for c in frontier:
                for _, t, _ in engine.successors(c):
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
            frontier = nxt[:2000]


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="known engines"):
        check("two-phase-epoch", 2, mode="keep", engine="fast")


@pytest.mark.parametrize("variant,mode", [("two-phase-epoch", "keep"), ("vllm-0.32", "abort")])
def test_memos_are_sound_on_mixed_states(variant: str, mode: str) -> None:
    """The memo keys keep every field their part reads: on states mixing the rank slices of reachable states
    (reachable or not), the memoised invariant and successors are the model's (verify mode compares each)."""
    import random

    m = build_model(variant, 2, mode)
    ex = explore_model(m, engine="baseline", max_states=20_000)
    engine = CompactEngine(build_model(variant, 2, mode), verify=True)
    rng = random.Random(7)
    states = list(ex.states)
    for s in states:
        engine.invariant(engine.encode(s))
        engine.successors(engine.encode(s))
    for _ in range(10_000):
        s, donor = rng.choice(states), rng.choice(states)
        j = rng.randrange(2)
        mixed = engine.encode(
            s.with_ranks(tuple(donor.ranks[j] if k == j else r for k, r in enumerate(s.ranks)))
        )
        engine.invariant(mixed)
        engine.successors(mixed)
