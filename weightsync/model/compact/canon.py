"""The compact engine's canonical form (symmetry reduction) over encoded states."""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
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
#: Spacing of :class:`OrderLabels`' labels (ints, so a gap halves 32 times before the labels are renumbered).
_LABEL_GAP = 1 << 32


def _memo_label(memo: dict[tuple[int, int], int], order: OrderLabels, key: tuple[int, int], part: Any) -> int:
    """``order``'s label of ``part``, stored in ``memo`` under ``key``; ``memo`` is emptied first when placing
    ``part`` renumbered the labels (its other entries would be stale)."""
    epoch = order.epoch
    v = order.label(part)
    if order.epoch != epoch:
        memo.clear()
    memo[key] = v
    return v


class OrderLabels:
    """Int labels of keys in the keys' order: ``label(a) < label(b)`` iff ``a < b``, equal keys get equal
    labels, so a sort by label is a sort by key that compares ints. A new key takes a label between its
    neighbours' (found by bisection); when no int is left between them, every label is renumbered
    ``_LABEL_GAP`` apart and :attr:`epoch` grows, so a caller that keeps labels must drop them then.

    Args:
        (none) keys must be mutually comparable and hashable.
    """

    __slots__ = ("epoch", "keys", "labels", "of")

    def __init__(self) -> None:
        self.keys: list[Any] = []  # every key seen, ascending
        self.labels: list[int] = []  # their labels, ascending
        self.of: dict[Any, int] = {}
        self.epoch = 0

    def label(self, key: Any) -> int:
        """The label of ``key`` (placed if new)."""
        v = self.of.get(key)
        if v is not None:
            return v
        keys, labels = self.keys, self.labels
        pos = bisect_left(keys, key)
        if not keys:
            v = 0
        elif pos == len(keys):
            v = labels[-1] + _LABEL_GAP
        elif pos == 0:
            v = labels[0] - _LABEL_GAP
        else:
            v = (labels[pos - 1] + labels[pos]) // 2
            if v == labels[pos - 1]:  # no int left between the neighbours: renumber every label
                for j, k in enumerate(keys):
                    labels[j] = self.of[k] = j * _LABEL_GAP
                self.epoch += 1
                v = (labels[pos - 1] + labels[pos]) // 2
        keys.insert(pos, key)
        labels.insert(pos, v)
        self.of[key] = v
        return v


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
        # N > 3: per slice id, its place in the model's order of slices (slice_key, then its FIFOs) as an int
        # label (the plain path), and the key it was labelled by
        self._slice_order = OrderLabels()
        self._labels: list[int] = []
        self._slice_keys: list[tuple[Any, ...]] = []
        # N > 3, a message names a rank: per (slice id, rank j), the label of (slice_key, own FIFOs seen from j)
        self._own_order = OrderLabels()
        self._own_labels: dict[tuple[int, int], int] = {}
        # per slice id that names no rank: that label, the same for every j (None: not labelled yet)
        self._own_plain: list[int | None] = []
        # N > 3, ranks tied on that: per (slice id, rank j) the label of its FIFOs seen from j, per (rest id,
        # rank j) the label of the coordinator's FIFOs seen from j (:meth:`_sym_labels`)
        self._rel_order = OrderLabels()
        self._rel_labels: dict[tuple[int, int], int] = {}
        self._rest_rel_order = OrderLabels()
        self._rest_rel_labels: dict[tuple[int, int], int] = {}
        self.plain_reorders = 0  # states the plain path reordered (figures, tests)
        self.tie_sorts = 0  # runs of tied ranks sorted by the whole key, a message naming one (tests)

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
        plain = not self._rest_names[rest] and self._named.isdisjoint(ids)
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
        """The canonical form at N > 3: ranks 1..N-1 in the model's order, ``(slice_key, _sym_key)``, whose
        :meth:`Symmetry._sym_key` starts with the rank's own FIFOs seen from itself.

        - Where no message names a rank other than 0 (``plain``), renaming changes nothing and that order
          is the order of ``(slice_key, inq, outq)``, a total order of slices (ranks equal on it are equal
          slices, whose order changes nothing): sorted by each slice id's int label (:class:`OrderLabels`).
        - Otherwise ranks sorted by the label of ``(slice_key, own FIFOs seen from the rank)``, and a run
          of ranks tied on it, one of which a message names, by the whole :meth:`_sym_key` as int labels
          (:meth:`_tie_sort`; it costs a sort of every other rank's FIFOs per rank); ranks tied on the whole
          key stay in index order (the sorts are stable), as in the model. Then the permutation with its
          renaming, of the slices whose messages name a rank it moves."""
        tail = ids[1:]
        if plain:
            order = sorted(tail, key=self._labels.__getitem__)
            if order == tail:
                return c
            self.plain_reorders += 1
            return self.pack((ids[0], *order), rest)
        n = self.n
        bits = self._name_bits
        while True:
            epoch = self._own_order.epoch
            pair = self._own_labels
            plain_own = self._own_plain
            named = self._rest_name_bits[rest] | bits[ids[0]]
            lab = [0] * n
            for j in range(1, n):
                k = ids[j]
                b = bits[k]
                if b:
                    named |= b
                    v = pair.get((k, j))
                else:
                    v = plain_own[k]
                lab[j] = self._own_label(k, j) if v is None else v
            if self._own_order.epoch == epoch:
                break  # else a label was renumbered meanwhile: read them again
        pos = sorted(range(1, n), key=lab.__getitem__)
        # Ranks that no message names and that tie on their label have equal whole keys (:meth:`_tie_sort`),
        # so the model keeps them in index order, as this stable sort does: only a tie of a named rank
        # needs the whole key.
        tail = lab[1:]
        j = 1
        left = named >> 1
        while left:
            if left & 1 and tail.count(lab[j]) > 1:
                pos = self._ties_sorted(pos, lab, ids, rest, named)
                break
            left >>= 1
            j += 1
        if pos == list(range(1, n)):
            return c
        perm = [0] * n  # old -> new
        for new_j, old in enumerate(pos, start=1):
            perm[old] = new_j
        return self._permuted(ids, rest, tuple(perm))

    def _ties_sorted(
        self, pos: list[int], lab: list[int], ids: list[int], rest: int, named: int
    ) -> list[int]:
        """``pos``, ranks 1..N-1 sorted by their labels ``lab``, with each run of ranks tied on a label
        sorted by :meth:`_tie_sort` where a message names one of them (``named``: the bit mask of the
        ranks the state's messages name)."""
        out: list[int] = []
        for _, run in itertools.groupby(pos, key=lab.__getitem__):
            group = list(run)
            if len(group) > 1 and any(named >> j & 1 for j in group):
                self.tie_sorts += 1
                self._tie_sort(group, ids, rest, named)
            out.extend(group)
        return out

    def _tie_sort(self, group: list[int], ids: list[int], rest: int, named: int) -> None:
        """Sort ``group``, ranks tied on ``(slice_key, own FIFOs seen from the rank)``, in place by the whole
        :meth:`_sym_key` (as :meth:`_sym_labels`), stably as the model does. Ranks of the group that no
        message of the state names (not in the bit mask ``named``) all have the same whole key: every FIFO
        looks the same from each of them (the ranks it names are 0 or others, -3, from both), and so does
        the other's FIFOs from each (equal own FIFOs, naming neither). So one of them is keyed for all; a
        group that no message names keeps its index order and is not passed here."""
        while True:
            epochs = (self._rel_order.epoch, self._rest_rel_order.epoch)
            keys: dict[int, tuple[Any, ...]] = {}
            shared: tuple[Any, ...] | None = None
            for j in group:
                if named >> j & 1:
                    keys[j] = self._sym_labels(ids, rest, j)
                else:
                    if shared is None:
                        shared = self._sym_labels(ids, rest, j)
                    keys[j] = shared
            if epochs == (self._rel_order.epoch, self._rest_rel_order.epoch):
                break  # else a label was renumbered meanwhile: read them again
        group.sort(key=keys.__getitem__)

    def resorted(self, t: Compact, ids: list[int], i: int) -> Compact:
        """``t``, the successor of a plain state ``ids`` by a move of rank ``i`` >= 1 alone (its slice and
        the rest changed, every other rank's slice as in ``ids``), with rank ``i``'s slice moved to its
        place among ranks 1..N-1 by label (:meth:`_canon_sorted`'s plain order). Where ``ids`` is canonical
        that is :meth:`canon` of ``t``, at the cost of two label comparisons when the slice stays in
        place; else it is a state of ``t``'s orbit, which the explorer canonicalises as any other. ``t``
        itself where its new slice or rest has a message that names a rank (not plain)."""
        k = (t >> self.shifts[i]) & FIELD_MASK
        rest = t >> self.rest_shift
        if k in self._named or self._rest_names[rest]:
            return t
        labels = self._labels
        lk = labels[k]
        n = self.n
        if (i == 1 or labels[ids[i - 1]] <= lk) and (i == n - 1 or lk <= labels[ids[i + 1]]):
            return t
        tail = ids[1:]
        del tail[i - 1]
        tail.insert(bisect_right([labels[x] for x in tail], lk), k)
        return self.pack((ids[0], *tail), rest)

    def _own_label(self, k: int, j: int) -> int:
        """The label of ``(slice_key, own FIFOs seen from rank j)`` of slice ``k`` at rank ``j``, memoised
        (the memo is dropped when the labels are renumbered)."""
        order = self._own_order
        epoch = order.epoch
        v = order.label((self._key_of(k), self._relative(k, j)))
        if order.epoch != epoch:  # renumbered: every label kept is stale
            self._own_labels.clear()
            self._own_plain = [None] * len(self._own_plain)
        if self._name_bits[k]:
            self._own_labels[(k, j)] = v
        else:  # the slice names no rank, so it looks the same from every rank
            self._own_plain[k] = v
        return v

    def _permuted(self, ids: list[int], rest: int, perm: tuple[int, ...]) -> Compact:
        """The encoded state ``ids``, ``rest`` with rank ``i`` renamed ``perm[i]`` (:meth:`Symmetry._permute`)."""
        new = [0] * self.n
        moved = 0  # the ranks perm renames, as a bit mask: a slice naming none of them stays as it is
        for old, to in enumerate(perm):
            if old != to:
                moved |= 1 << old
        bits = self._name_bits
        for old, k in enumerate(ids):
            new[perm[old]] = self._renamed(k, perm) if bits[k] & moved else k
        return self.pack(new, self._renamed_rest(rest, perm) if self._rest_name_bits[rest] & moved else rest)

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

    def _sym_labels(self, ids: list[int], rest: int, j: int) -> tuple[Any, ...]:
        """:meth:`_sym_key` with each FIFO part replaced by its int label (:class:`OrderLabels` of the parts
        seen from a rank): the rank's own, rank 0's, the other ranks' (sorted) and the coordinator's. The
        labels keep the parts' order, so these keys compare as the model's do."""
        rl = self._rel_label
        others = tuple(sorted([rl(ids[k], j) for k in range(1, self.n) if k != j]))
        v = self._rest_rel_labels.get((rest, j))
        if v is None:
            v = _memo_label(
                self._rest_rel_labels, self._rest_rel_order, (rest, j), self._relative_rest(rest, j)
            )
        return (rl(ids[j], j), rl(ids[0], j), others, v)

    def _rel_label(self, k: int, j: int) -> int:
        """The label of :meth:`_relative` of slice ``k`` seen from rank ``j``, memoised (the memo is dropped
        when the labels are renumbered)."""
        v = self._rel_labels.get((k, j))
        if v is None:
            v = _memo_label(self._rel_labels, self._rel_order, (k, j), self._relative(k, j))
        return v

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

    def _interned(self, k: int) -> None:
        """A new slice ``k`` was interned: at N > 3, give it its label in the order of
        ``(slice_key, inq, outq)`` (:meth:`_canon_sorted`'s plain path).

        Raises:
            AssertionError: two distinct slices with equal keys (the key must name the whole slice)."""
        if self.n <= 3:
            return
        self._own_plain.append(None)
        r = self.ranks[k]
        key = (self._key_of(k), r.inq, r.outq)
        order = self._slice_order
        epoch, known = order.epoch, len(order.keys)
        self._slice_keys.append(key)
        self._labels.append(order.label(key))
        if len(order.keys) == known:
            raise AssertionError(f"slice {k} has the order key of another slice")
        if order.epoch != epoch:
            self._labels = [order.of[key] for key in self._slice_keys]

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
