"""Symmetry reduction: renaming ranks 1..N-1 and the canonical representative of a state."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from weightsync.model.system.base import ModelBase
from weightsync.model.system.state import GlobalState, Rank

#: Messages to the coordinator whose last field is the sending rank.
_SENDER_LAST = frozenset({"start_wave", "wave_complete"})
#: Every message kind naming a rank (see :meth:`Model.permute`).
_RANK_NAMING = _SENDER_LAST | {"W", "FIRST_REQ"}


class Symmetry(ModelBase):
    """Rank permutations and the canonical form of :class:`Model`."""

    def canon(self, s: GlobalState) -> GlobalState:
        """Canonical representative under permutations of ranks 1..N-1 (rank 0 emits wave_complete and
        reports the wave's start, so it stays fixed).

        Ranks 1..N-1 are sorted by their slice's fields that name no rank (:func:`slice_key`), ties broken
        by :meth:`_sym_key`, which sees the rank's FIFOs and every reference to it elsewhere (the
        coordinator's FIFOs) with rank ids renamed relative to the rank itself, so the order does not
        depend on the ranks' indices; the order is then applied by :meth:`permute`. The
        result is always in the orbit of ``s`` (``permute`` is an automorphism of the transition relation,
        checked by ``tests/test_model_symmetry.py``); ranks with equal keys are interchangeable at N <= 3."""
        n = self.n
        if n <= 2:
            return s
        ranks = s.ranks
        # The slice without rank ids decides the order unless two ranks tie on it (the full key starts
        # with the same fields, so the order is the full key's either way).
        if n == 3:  # the common case, without sorting
            r1, r2 = ranks[1], ranks[2]
            a, b = slice_key(r1), slice_key(r2)
            if a != b and a < b:
                return s
            plain = not _names_a_rank(s)  # then renaming changes no message: compare and swap as they are
            if a == b:
                if plain:
                    a, b = (r1[4], r1[5]), (r2[4], r2[5])
                else:
                    a, b = self._sym_key(s, 1), self._sym_key(s, 2)
                if a <= b:
                    return s
            if plain:
                return s.with_ranks((ranks[0], r2, r1))
            return self._permute(s, (0, 2, 1))
        cheap = {j: slice_key(ranks[j]) for j in range(1, n)}
        order = sorted(range(1, n), key=cheap.__getitem__)
        if any(cheap[a] == cheap[b] for a, b in itertools.pairwise(order)):
            order = sorted(range(1, n), key=lambda j: (cheap[j], self._sym_key(s, j)))
        if order == list(range(1, n)):
            return s
        perm = [0] * n  # old -> new
        for new, old in enumerate(order, start=1):
            perm[old] = new
        return self._permute(s, perm)

    @staticmethod
    def _sym_key(s: GlobalState, j: int) -> tuple[Any, ...]:
        """Every FIFO of the state as seen from rank ``j``, with rank ids relative to ``j`` (-2 is ``j``
        itself, 0 and negative values stay, any other rank is -3): ``j``'s own, rank 0's, the other ranks'
        (as a sorted tuple, so their indices do not matter) and the coordinator's. Used after
        :func:`slice_key` to break its ties; at N <= 3 equal keys mean the two ranks are interchangeable."""
        ranks = s.ranks
        others = tuple(sorted(relative_fifos(ranks[k], j) for k in range(1, len(ranks)) if k != j))
        return (relative_fifos(ranks[j], j), relative_fifos(ranks[0], j), others, relative_refs(s.coord_q, j))

    def permute(self, s: GlobalState, perm: Sequence[int]) -> GlobalState:
        """``s`` with rank ``i`` renamed ``perm[i]`` (``perm[0] == 0``): the rank slices move, and every
        message naming a rank is renamed (START_DP_WAVE's ``exclude``, FIRST_REQ's sender, the sender of
        ``start_wave`` / ``wave_complete``).

        Raises:
            ValueError: ``perm`` is not a permutation of ``range(N)`` fixing 0.
        """
        n = self.n
        if sorted(perm) != list(range(n)) or perm[0] != 0:
            raise ValueError(f"perm {list(perm)!r} is not a permutation of range({n}) fixing rank 0")
        return self._permute(s, perm)

    def _permute(self, s: GlobalState, perm: Sequence[int]) -> GlobalState:
        """:meth:`permute` without checking ``perm``."""
        new_ranks: list[Rank | None] = [None] * self.n
        for old, r in enumerate(s.ranks):
            new_ranks[perm[old]] = rename_slice(r, perm)
        coord_q = rename_fifos(s.coord_q, perm)
        return s.with_ranks_and_coord_q(tuple(r for r in new_ranks if r is not None), coord_q)


def rename_fifos(qs: tuple[tuple[tuple[Any, ...], ...], ...], perm: Sequence[int]) -> tuple[Any, ...]:
    """FIFOs ``qs`` with every message naming a rank renamed by ``perm`` (rank ``i`` becomes ``perm[i]``)."""

    def ren(x: int) -> int:
        return perm[x] if x >= 0 else x

    def fix_q(q: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
        return tuple(_rename(m, ren) for m in q) if any(m[0] in _RANK_NAMING for m in q) else q

    return tuple(fix_q(q) for q in qs)


def rename_slice(r: Rank, perm: Sequence[int]) -> Rank:
    """Rank slice ``r`` with the messages in its FIFOs renamed by ``perm`` (:func:`rename_fifos`); the
    slice itself moves to ``perm`` of its index (:meth:`Symmetry._permute`)."""
    return r.with_fifos(rename_fifos(r.inq, perm), rename_fifos((r.outq,), perm)[0])


def _relative_to(j: int) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A message renamed relative to rank ``j`` (see :meth:`Symmetry._sym_key`)."""

    def rel(x: int) -> int:
        return -2 if x == j else (x if x <= 0 else -3)

    def rmsg(m: tuple[Any, ...]) -> tuple[Any, ...]:
        return _rename(m, rel)

    return rmsg


def relative_fifos(r: Rank, j: int) -> tuple[Any, ...]:
    """Rank slice ``r``'s FIFOs (input FIFOs, then the FIFO to the coordinator) as seen from rank ``j``: rank
    ids renamed relative to ``j`` (:meth:`Symmetry._sym_key`)."""
    rmsg = _relative_to(j)
    return (tuple(tuple(rmsg(m) for m in q) for q in r.inq), tuple(rmsg(m) for m in r.outq))


def relative_refs(coord_q: tuple[tuple[tuple[Any, ...], ...], ...], j: int) -> tuple[Any, ...]:
    """The coordinator's FIFOs ``coord_q`` as seen from rank ``j`` (:meth:`Symmetry._sym_key`)."""
    rmsg = _relative_to(j)
    return tuple(tuple(rmsg(m) for m in q) for q in coord_q)


def _rename(m: tuple[Any, ...], f: Callable[[int], int]) -> tuple[Any, ...]:
    """Message ``m`` with the rank it names (see :data:`_RANK_NAMING`) mapped through ``f``."""
    k = m[0]
    if k == "W" or k in _SENDER_LAST:
        return (k, m[1], f(m[2]))
    if k == "FIRST_REQ":
        return (k, f(m[1]), m[2])
    return m


def _names_a_rank(s: GlobalState) -> bool:
    """Some message in flight names a rank other than 0 (START_DP_WAVE's ``exclude``, FIRST_REQ's sender,
    the sender of ``start_wave`` / ``wave_complete``): only then does renaming ranks change a message."""
    return fifos_name_a_rank(s.coord_q) or any(rank_names_a_rank(r) for r in s.ranks)


def rank_names_a_rank(r: Rank) -> bool:
    """Some message in rank slice ``r``'s FIFOs names a rank other than 0 (see :func:`_names_a_rank`)."""
    return fifos_name_a_rank(r.inq) or fifos_name_a_rank((r.outq,))


def fifos_name_a_rank(qs: tuple[tuple[tuple[Any, ...], ...], ...]) -> bool:
    """Some message in the FIFOs ``qs`` names a rank other than 0 (see :func:`_names_a_rank`)."""
    return named_ranks(qs) != 0


def named_ranks(qs: tuple[tuple[tuple[Any, ...], ...], ...]) -> int:
    """The ranks other than 0 that a message in the FIFOs ``qs`` names (see :func:`_names_a_rank`), as a
    bit mask: bit ``j`` set iff some message names rank ``j`` (0: none does)."""
    naming = _RANK_NAMING
    bits = 0
    for q in qs:
        for m in q:
            if m[0] in naming:
                x = m[1] if m[0] == "FIRST_REQ" else m[2]
                if x > 0:
                    bits |= 1 << x
    return bits


def slice_key(r: Rank) -> tuple[Any, ...]:
    """The fields of a rank's slice that name no rank (the first part of the symmetry order)."""
    return (r.vars, r.blocked, r.waiting, r.running, r.status, r.pause_ghost, r.worker, r.owed)
