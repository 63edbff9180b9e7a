"""The compact engine's canonical form (symmetry reduction) over encoded states."""

from __future__ import annotations

from weightsync.model.compact.codec import Codec, Compact
from weightsync.model.system import Model
from weightsync.model.system.symmetry import rename_fifos, rename_slice, slice_key

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
        self._ren: dict[int, int] = {}
        self._ren_rest: dict[int, int] = {}

    def canon(self, c: Compact) -> Compact:
        """The model's canonical representative of ``c`` (:meth:`Symmetry.canon`), encoded. At N = 3 without
        decoding but where ranks 1 and 2 tie on :func:`slice_key` while a message names a rank other than 0
        (then the model's canon on the decoded state): the order of ranks 1 and 2 by :func:`slice_key`, ties
        broken by their FIFOs, memoised per pair of ids; whether a message names a rank other than 0, by
        flags per slice id and rest id; the swap renaming messages (:func:`rename_slice`,
        :func:`rename_fifos`), memoised per slice id and rest id. At other N, the model's canon."""
        n = self.n
        if n <= 2:
            return c  # nothing to permute: the model's canon returns the state itself
        ids, rest = self.unpack(c)
        if n == 3:
            key = (ids[1], ids[2])
            order = self._order.get(key)
            if order is None:
                order = self._order[key] = self._pair_order(ids[1], ids[2])
            out = c
            if order != _IN_ORDER:
                names = self._names
                plain = not (names[ids[0]] or names[ids[1]] or names[ids[2]] or self._rest_names[rest])
                if plain:
                    out = c if order == _TIE_IN_ORDER else self.pack((ids[0], ids[2], ids[1]), rest)
                elif order == _REVERSED:
                    ren = [self._renamed(k) for k in ids]
                    out = self.pack((ren[0], ren[2], ren[1]), self._renamed_rest(rest))
                else:
                    out = -1
            if out >= 0:
                if self.verify and self.decode(out) != self.model.canon(self.decode(c)):
                    raise AssertionError(f"canonical form of {self.decode(c)} differs")
                return out
        s = self._state(ids, rest)
        t = self.model.canon(s)
        return c if t is s else self._encode_from(ids, rest, s, t)

    def _pair_order(self, k1: int, k2: int) -> int:
        r1, r2 = self.ranks[k1], self.ranks[k2]
        a, b = slice_key(r1), slice_key(r2)
        if a != b:
            return _IN_ORDER if a < b else _REVERSED
        return _TIE_IN_ORDER if (r1[4], r1[5]) <= (r2[4], r2[5]) else _TIE_REVERSED

    def _renamed(self, k: int) -> int:
        """The id of slice ``k`` with its messages renamed by the swap of ranks 1 and 2."""
        v = self._ren.get(k)
        if v is None:
            v = self._ren[k] = self.rank_id(rename_slice(self.ranks[k], _SWAP12))
        return v

    def _renamed_rest(self, rest: int) -> int:
        """The id of rest ``rest`` with its coordinator FIFOs' messages renamed by the swap of ranks 1, 2."""
        v = self._ren_rest.get(rest)
        if v is None:
            old = self.rests[rest]
            v = self._ren_rest[rest] = self.rest_id((rename_fifos(old[0], _SWAP12), *old[1:]))
        return v
