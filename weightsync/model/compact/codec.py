"""The compact engine's encoding: intern tables for rank slices and rests, a state packed into one int."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Literal

from weightsync.model.compact.projections import RANK_PROJECTIONS, rest_projections
from weightsync.model.system import TRANSFER_KINDS, GlobalState, Label, Model, Rank
from weightsync.model.system.state import _new_tuple
from weightsync.model.system.symmetry import named_ranks

#: An encoded state: ``sum(r_i << FIELD_BITS * i) + (rest << FIELD_BITS * N)`` (see the module docstring).
Compact = int
#: Bits of one rank slice id in an encoded state.
FIELD_BITS = 32
FIELD_MASK = (1 << FIELD_BITS) - 1
#: The :mod:`array` typecode of one field (C ``unsigned int``, or ``unsigned long`` where that is 32 bits):
#: :meth:`Codec.pack` and :meth:`Codec.unpack` convert between a state and its fields as bytes in C.
FIELD_CODE: Literal["I", "L"] = "I" if array("I").itemsize * 8 == FIELD_BITS else "L"
if array(FIELD_CODE).itemsize * 8 != FIELD_BITS:  # pragma: no cover - no such CPython platform
    raise ImportError(f"no array typecode of {FIELD_BITS} bits on this platform")
#: A successor with its edge check: ``(label, next state, names of violated transition properties)``.
Checked = tuple[Label, Compact, Sequence[str]]
_Moves = list[tuple[Label, GlobalState]]
#: A coordinator memo entry: label, rank ``src``'s id after the take (-1: from its own FIFO), the new rest
#: id, the START_DP_WAVE broadcasts to deliver to every rank, the edge check's violations, and the delta
#: to add to the state when there are no broadcasts.
_CoordEntry = tuple[Label, int, int, tuple[tuple[int, int], ...], Sequence[str], int]
#: Bits of :attr:`CompactEngine._flags`: the slice is blocked, in a weight-transfer collective, has a
#: message for the coordinator.
_BLOCKED, _TRANSFER, _OUTQ = 1, 2, 4
#: :meth:`CompactEngine._plan`'s collective moves: the DP completion, or the slow path.
_COLL_DONE, _COLL_SLOW = 1, 2
#: A plan (:meth:`CompactEngine._plan`): busy, collective moves, coordinator entries of its own FIFOs, ranks
#: with a message for the coordinator, may send, may abort, refresh entries, controller memo key or None.
_Plan = tuple[
    bool,
    int,
    "list[_CoordEntry]",
    tuple[int, ...],
    bool,
    bool,
    "list[tuple[Label, int, Sequence[str]]]",
    "tuple[int, ...] | None",
]

#: Controller moves that map each rank's slice on its own, and the rest on its own (the controller
#: memo of :meth:`CompactEngine._controller`): a fan-out, an untracked call, the end of a round. Not ``fe``
#: (the front-end applies the call to every rank in turn, their effects threading through the rest).
_PER_RANK_CONTROLLER = frozenset({"fan", "retry", "extra", "end"})


class Codec:
    """The intern tables of one model's exploration and the encoding of its states (see the package
    docstring), with the per-id attributes the engine's memo keys are built from.

    Args:
        model: the model whose states are encoded.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        n = self.n = model.n
        #: bit offset of each rank's id in an encoded state, then of the rest's id
        self.shifts = tuple(FIELD_BITS * i for i in range(n))
        self.rest_shift = FIELD_BITS * n
        self.nbytes = (n + 1) * FIELD_BITS // 8  # of an encoded state
        self.ranks: list[Rank] = []
        self.rank_ids: dict[Rank, int] = {}
        self.rests: list[tuple[Any, ...]] = []
        self.rest_ids: dict[tuple[Any, ...], int] = {}
        # per rank id: blocked, flag bits (_BLOCKED, _TRANSFER, _OUTQ), status, the ids of its
        # (blocked, state) for collective moves, of its env class (:meth:`CompactEngine._plan`), of its
        # projection for each invariant group, and of their tuple
        self._blocked: list[str] = []
        self._flags: list[int] = []
        self._status: list[int] = []
        # (symmetry) ids of slices with a message that names a rank other than 0, and per id the bit mask
        # of the ranks its messages name (:func:`named_ranks`)
        self._named: set[int] = set()
        self._name_bits: list[int] = []
        self._coll_proj: list[int] = []
        self._env_class: list[int] = []
        self._projs: list[tuple[int, ...]] = []
        self._proj: list[int] = []
        self._proj_ids: dict[Any, int] = {}
        # per rest id: trainer blocked, the client may send, the client may abort; its invariant projections
        self._rest_flags: list[tuple[bool, bool, bool]] = []
        self._rest_names: list[bool] = []
        self._rest_name_bits: list[int] = []  # the ranks the coordinator's FIFOs name, as a bit mask
        self._rest_proj: list[tuple[int, ...]] = []
        self._rest_proj_id: list[int] = []

    # ------------------------------------------------------------------ encoding

    def rank_id(self, r: Rank) -> int:
        """The id of slice ``r`` (a new one if unseen).

        Raises:
            OverflowError: more distinct slices than :data:`FIELD_BITS` can number."""
        k = self.rank_ids.get(r)
        if k is None:
            k = len(self.ranks)
            if k > FIELD_MASK:
                raise OverflowError(f"more than {FIELD_MASK + 1} distinct rank slices")
            self.rank_ids[r] = k
            self.ranks.append(r)
            self._blocked.append(r.blocked)
            self._flags.append(
                (_BLOCKED if r.blocked else 0)
                | (_TRANSFER if r.blocked in TRANSFER_KINDS else 0)
                | (_OUTQ if r.outq else 0)
            )
            self._status.append(r.status)
            bits = named_ranks(r.inq) | named_ranks((r.outq,))
            self._name_bits.append(bits)
            if bits:
                self._named.add(k)
            pid = self._proj_ids
            coll = pid.setdefault(("c", r.blocked, r.vars.state, r.status), len(pid))
            self._coll_proj.append(coll)
            self._env_class.append(pid.setdefault(("e", self._flags[k], r.status, coll), len(pid)))
            ps = tuple(pid.setdefault((g, *f(r)), len(pid)) for g, f in enumerate(RANK_PROJECTIONS))
            self._projs.append(ps)
            self._proj.append(pid.setdefault(("all", *ps), len(pid)))
            self._interned(k)
        return k

    def _interned(self, k: int) -> None:
        """Called once for every new slice id ``k``, after its per-id attributes (a hook for subclasses)."""

    def rest_id(self, rest: tuple[Any, ...]) -> int:
        """The id of ``rest`` (a GlobalState's fields after ``ranks``; a new id if unseen).

        Raises:
            OverflowError: more distinct rests than :data:`FIELD_BITS` can number."""
        k = self.rest_ids.get(rest)
        if k is None:
            k = len(self.rests)
            if k > FIELD_MASK:
                raise OverflowError(f"more than {FIELD_MASK + 1} distinct rests")
            self.rest_ids[rest] = k
            self.rests.append(rest)
            bits = named_ranks(rest[0])
            self._rest_name_bits.append(bits)
            self._rest_names.append(bool(bits))
            pid = self._proj_ids
            rp = tuple(
                pid.setdefault(("rest", g, *p), len(pid)) for g, p in enumerate(rest_projections(rest))
            )
            self._rest_proj.append(rp)
            self._rest_proj_id.append(pid.setdefault(("all rest", *rp), len(pid)))
            m = self.model
            front = rest[2]
            self._rest_flags.append(
                (
                    bool(rest[4].blocked),
                    front.next_request < m.requests,
                    len(front.client_aborted) < m.client_aborts,
                )
            )
        return k

    def pack(self, ids: Sequence[int], rest: int) -> Compact:
        """The encoded state of rank slice ids ``ids`` and rest id ``rest``."""
        return int.from_bytes(array(FIELD_CODE, (*ids, rest)), sys.byteorder)

    def unpack(self, c: Compact) -> tuple[list[int], int]:
        """The rank slice ids and the rest id of encoded state ``c``."""
        fields = memoryview(c.to_bytes(self.nbytes, sys.byteorder)).cast(FIELD_CODE).tolist()
        rest = fields.pop()
        return fields, rest

    def encode(self, s: GlobalState) -> Compact:
        """``s``, encoded."""
        return self.pack([self.rank_id(r) for r in s.ranks], self.rest_id(tuple(s[1:])))

    def decode(self, c: Compact) -> GlobalState:
        """The state ``c`` encodes."""
        ids, rest = self.unpack(c)
        return self._state(ids, rest)

    def _state(self, ids: Sequence[int], rest: int) -> GlobalState:
        ranks = self.ranks
        return _new_tuple(GlobalState, (tuple([ranks[k] for k in ids]), *self.rests[rest]))

    def _encode_from(self, ids: Sequence[int], rest: int, s: GlobalState, t: GlobalState) -> Compact:
        """``t``, a successor of ``s`` (``ids``, ``rest``): slices that are the same objects as ``s``'s keep
        their ids unhashed."""
        sr, tr = s.ranks, t.ranks
        new = [ids[j] if tr[j] is sr[j] else self.rank_id(tr[j]) for j in range(self.n)]
        same = all(a is b for a, b in zip(s[1:], t[1:], strict=True))
        return self.pack(new, rest if same else self.rest_id(tuple(t[1:])))
