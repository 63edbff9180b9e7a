"""The compact engine's canonical form (symmetry reduction) over encoded states."""

from __future__ import annotations

import itertools
from typing import Any

from weightsync.model.compact.codec import FIELD_BITS, FIELD_MASK, Codec, Compact
from weightsync.model.system import Model
from weightsync.model.system.symmetry import (
    relative_fifos,
    relative_refs,
    rename_fifos,
    rename_slice,
    slice_key,
)

#: :meth:`CompactEngine.canon` at N = 3: ranks 1 and 2 in order of their slice keys, reversed, or tied with
#: their FIFOs in order, or reversed (:meth:`Symmetry.canon`'s cases); the swap of ranks 1 and 2.
_IN_ORDER, _REVERSED, _TIE_IN_ORDER, _TIE_REVERSED = 0, 1, 2, 3
_SWAP12 = (0, 2, 1)


class CanonicalForm(Codec):
    """:meth:`~weightsync.model.system.Model.canon` over encoded states (see :meth:`canon`).

    Args:
        model: the model.
        verify: compare every canonical form computed without the model with the model's.
    """

    def __init__(self, model: Model, verify: bool = False) -> None:
        super().__init__(model)
        self.verify = verify
        self._order: dict[tuple[int, int], int] = {}
        self._ren: dict[tuple[int, tuple[int, ...]], int] = {}
        self._ren_rest: dict[tuple[int, tuple[int, ...]], int] = {}
        self._keys: dict[int, tuple[Any, ...]] = {}
        self._rel: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._rel_rest: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._fulls: dict[int, tuple[Any, ...]] = {}

    def canon(self, c: Compact) -> Compact:
        """The model's canonical representative of ``c`` (:meth:`Symmetry.canon`), encoded, computed without
        decoding: the order of ranks 1..N-1 by :func:`slice_key` (memoised per slice id; at N = 3 per pair of
        ids), ties broken as the model breaks them (:meth:`_sym_key`), then the permutation applied to the
        ids, renaming the messages that name a rank (:func:`rename_slice`, :func:`rename_fifos`, memoised per
        slice id or rest id and permutation). Whether a message names a rank other than 0 is a flag per slice
        id and rest id; where none does, renaming changes nothing and a tie is broken by the ranks' FIFOs.
        ``verify``: every result is compared with the model's canon of the decoded state.

        Raises:
            AssertionError: (``verify`` only) the result differs from the model's."""
        n = self.n
        if n <= 2:
            return c  # nothing to permute: the model's canon returns the state itself
        if n == 3:  # the common case first: ranks 1 and 2 in order, from their ids alone
            key = ((c >> FIELD_BITS) & FIELD_MASK, (c >> 2 * FIELD_BITS) & FIELD_MASK)
            order = self._order.get(key)
            if order is None:
                order = self._order[key] = self._pair_order(*key)
            if order == _IN_ORDER and not self.verify:
                return c
        ids, rest = self.unpack(c)
        names = self._names
        plain = not (self._rest_names[rest] or any(names[k] for k in ids))
        if n == 3:
            if order == _IN_ORDER:
                out = c
            elif plain:
                out = c if order == _TIE_IN_ORDER else self.pack((ids[0], ids[2], ids[1]), rest)
            elif order == _REVERSED or self._tie_reversed(ids, rest):
                out = self._permuted(ids, rest, _SWAP12)
            else:
                out = c
        else:
            out = self._canon_sorted(c, ids, rest, plain)
        if self.verify and self.decode(out) != self.model.canon(self.decode(c)):
            raise AssertionError(f"canonical form of {self.decode(c)} differs")
        return out

    def _canon_sorted(self, c: Compact, ids: list[int], rest: int, plain: bool) -> Compact:
        """The canonical form at N > 3. Where no message names a rank other than 0 (``plain``), ranks
        1..N-1 sorted by :func:`slice_key` then their FIFOs: the model's order, as its tie-break
        :meth:`Symmetry._sym_key` starts with the rank's own FIFOs, and ranks equal on both are equal slices,
        whose order changes nothing. Otherwise by :func:`slice_key`, and where two ranks tie on it, by
        ``(slice_key, _sym_key)`` as the model does, from memoised parts (:meth:`_relative`,
        :meth:`_relative_rest`); then the permutation with its renaming."""
        tail = ids[1:]
        if plain:
            order = sorted(tail, key=self._full_key)
            return c if order == tail else self.pack((ids[0], *order), rest)
        keyof = self._key_of
        cheap = [keyof(k) for k in ids]
        pos = sorted(range(1, self.n), key=cheap.__getitem__)
        if any(cheap[a] == cheap[b] for a, b in itertools.pairwise(pos)):
            pos = self._break_ties(ids, rest, cheap, pos)
        if pos == list(range(1, self.n)):
            return c
        perm = [0] * self.n  # old -> new
        for new_j, old in enumerate(pos, start=1):
            perm[old] = new_j
        return self._permuted(ids, rest, tuple(perm))

    def _break_ties(self, ids: list[int], rest: int, cheap: list[Any], pos: list[int]) -> list[int]:
        """``pos`` (ranks 1..N-1 in order of their :func:`slice_key`, ``cheap``, ties in index order) in the
        model's order, ``sorted(key=(slice_key, _sym_key))``: each run of ranks tied on ``cheap`` sorted by
        the first part of :meth:`_sym_key` (the rank's own FIFOs seen from itself), and only a run still
        tied on that by the whole key; ranks tied on the whole key stay in index order (both sorts are
        stable), as in the model. The whole key costs a sort of every other rank's FIFOs per rank, so it is
        computed for the tied ranks only."""
        rel = self._relative
        out: list[int] = []
        for _, run in itertools.groupby(pos, key=cheap.__getitem__):
            group = list(run)
            if len(group) > 1:
                own = {j: rel(ids[j], j) for j in group}
                group.sort(key=own.__getitem__)
                if any(own[a] == own[b] for a, b in itertools.pairwise(group)):
                    group.sort(key=lambda j: self._sym_key(ids, rest, j))
            out.extend(group)
        return out

    def _permuted(self, ids: list[int], rest: int, perm: tuple[int, ...]) -> Compact:
        """The encoded state ``ids``, ``rest`` with rank ``i`` renamed ``perm[i]`` (:meth:`Symmetry._permute`)."""
        new = [0] * self.n
        for old, k in enumerate(ids):
            new[perm[old]] = self._renamed(k, perm)
        return self.pack(new, self._renamed_rest(rest, perm))

    def _tie_reversed(self, ids: list[int], rest: int) -> bool:
        """At N = 3, ranks 1 and 2 tie on :func:`slice_key` and a message names a rank other than 0: whether
        :meth:`Symmetry._sym_key` puts rank 2 first."""
        return self._sym_key(ids, rest, 1) > self._sym_key(ids, rest, 2)

    def _sym_key(self, ids: list[int], rest: int, j: int) -> tuple[Any, ...]:
        """:meth:`Symmetry._sym_key` of rank ``j`` in the encoded state ``ids``, ``rest``, from memoised
        parts: the rank's own FIFOs, rank 0's, the other ranks' (sorted) and the coordinator's, each as seen
        from rank ``j`` (:meth:`_relative`, :meth:`_relative_rest`)."""
        rel = self._relative
        others = tuple(sorted(rel(ids[k], j) for k in range(1, self.n) if k != j))
        return (rel(ids[j], j), rel(ids[0], j), others, self._relative_rest(rest, j))

    def _relative(self, k: int, j: int) -> tuple[Any, ...]:
        """:func:`relative_fifos` of slice ``k`` as seen from rank ``j``, memoised."""
        v = self._rel.get((k, j))
        if v is None:
            v = self._rel[(k, j)] = relative_fifos(self.ranks[k], j)
        return v

    def _relative_rest(self, rest: int, j: int) -> tuple[Any, ...]:
        """:func:`relative_refs` of rest ``rest``'s coordinator FIFOs as seen from rank ``j``, memoised."""
        v = self._rel_rest.get((rest, j))
        if v is None:
            v = self._rel_rest[(rest, j)] = relative_refs(self.rests[rest][0], j)
        return v

    def _key_of(self, k: int) -> tuple[Any, ...]:
        """:func:`slice_key` of slice ``k``, memoised."""
        v = self._keys.get(k)
        if v is None:
            v = self._keys[k] = slice_key(self.ranks[k])
        return v

    def _full_key(self, k: int) -> tuple[Any, ...]:
        """:func:`slice_key` of slice ``k`` then its FIFOs, memoised."""
        v = self._fulls.get(k)
        if v is None:
            r = self.ranks[k]
            v = self._fulls[k] = (self._key_of(k), r.inq, r.outq)
        return v

    def _pair_order(self, k1: int, k2: int) -> int:
        r1, r2 = self.ranks[k1], self.ranks[k2]
        a, b = slice_key(r1), slice_key(r2)
        if a != b:
            return _IN_ORDER if a < b else _REVERSED
        return _TIE_IN_ORDER if (r1[4], r1[5]) <= (r2[4], r2[5]) else _TIE_REVERSED

    def _renamed(self, k: int, perm: tuple[int, ...]) -> int:
        """The id of slice ``k`` with its messages renamed by ``perm``."""
        v = self._ren.get((k, perm))
        if v is None:
            v = self._ren[(k, perm)] = self.rank_id(rename_slice(self.ranks[k], perm))
        return v

    def _renamed_rest(self, rest: int, perm: tuple[int, ...]) -> int:
        """The id of rest ``rest`` with its coordinator FIFOs' messages renamed by ``perm``."""
        v = self._ren_rest.get((rest, perm))
        if v is None:
            old = self.rests[rest]
            v = self._ren_rest[(rest, perm)] = self.rest_id((rename_fifos(old[0], perm), *old[1:]))
        return v
