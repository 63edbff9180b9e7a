"""The explorer reproduces TLC's published figures for Lamport's TwoPhase commit."""

from __future__ import annotations

from weightsync.model import twophase_commit as tp
from weightsync.model.explorer import explore


def test_two_phase_commit_3_rms_matches_tlc() -> None:
    ex = explore([tp.initial(3)], tp.successors, invariant=tp.consistent)
    assert len(ex.states) == 288  # TLC: 288 distinct states
    assert ex.transitions + 1 == 1146  # TLC: 1,146 states generated (initial state included)
    assert ex.depth == 11  # TLC: depth 11
    assert ex.violations == {}
    assert ex.complete


def test_two_phase_commit_5_rms_matches_tlc() -> None:
    ex = explore([tp.initial(5)], tp.successors, invariant=tp.consistent)
    assert len(ex.states) == 8832  # TLC: 8,832 distinct states
    assert ex.violations == {}


def test_shortest_counterexample_to_a_seeded_bug() -> None:
    # 'TMCommit while some RM aborted' is impossible in TwoPhase; seed a bug: an RM may commit at will.
    def buggy(s: tp.TPState):  # type: ignore[no-untyped-def]
        yield from tp.successors(s)
        if s.rm[0] == tp.WORKING:
            yield "RMCommitAtWill(0)", s._replace(rm=(tp.COMMITTED, *s.rm[1:]))

    ex = explore([tp.initial(3)], buggy, invariant=tp.consistent)
    v = ex.violations["consistent"]
    labels = [lab for lab, _ in ex.path(v.state)][1:]
    assert len(labels) == 2  # shortest: one RM aborts, RM 0 commits at will
    assert "RMCommitAtWill(0)" in labels


def test_an_exploration_without_edges_is_the_one_with_edges() -> None:
    # Without edges the explorer keeps a set, not a state -> index map; the exploration must not change:
    # same states in the same order, parents, labels and levels, and the index built on demand agrees.
    # A canon (sorting the RMs: not a symmetry of this model, only a function to canonicalise by) exercises
    # the canonical-form lookups of both paths.
    def canon(s: tp.TPState) -> tp.TPState:
        return s._replace(rm=tuple(sorted(s.rm)))

    for c in (None, canon):
        with_edges = explore(
            [tp.initial(4)], tp.successors, invariant=tp.consistent, canon=c, keep_edges=True
        )
        without = explore([tp.initial(4)], tp.successors, invariant=tp.consistent, canon=c)
        assert isinstance(with_edges.index, dict) and not isinstance(without.index, dict)
        assert list(without.states) == list(with_edges.states)
        assert list(without.parent) == list(with_edges.parent)
        assert without.via == with_edges.via
        assert list(without.level) == list(with_edges.level)
        assert without.transitions == with_edges.transitions
        assert without.terminal == with_edges.terminal
        assert dict(without.index) == with_edges.index
        assert all(without.index[s] == i for i, s in enumerate(without.states))
