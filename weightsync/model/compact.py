"""The compact engine: the model's states as short tuples of ints, and its transitions memoised per part.

A global state is encoded as ``(r_0, ..., r_{N-1}, rest)``: ``r_i`` is the id of rank ``i``'s
:class:`~weightsync.model.system.Rank` slice and ``rest`` the id of the state outside the ranks (the
:class:`~weightsync.model.system.GlobalState` less ``ranks``: coordinator FIFOs, coordinator, front-end,
controller, trainer, finished and aborted requests). Ids are small ints handed out in order of first
appearance by two intern tables (value -> id, and a list id -> value); a state is hashed and compared as a
tuple of N + 1 ints. The same slice value has one id, so equal states have equal encodings, and
:meth:`CompactEngine.decode` rebuilds the very :class:`GlobalState` (sharing the interned slices).

The successor function calls the model's own parts (:meth:`Model.successors` is their concatenation, in the
same order), so labels, order, states, edge checks, invariants and verdicts are the model's; what changes is
that each part's result is memoised under a key holding only what the part reads, and a hit builds the
successors from ints alone:

- a rank's inputs and step (:meth:`Model.rank_moves`): key ``(i, r_i, rest, busy)``; they read rank ``i``'s
  slice, ``i`` and the rest, and change only those (audited in ``effects.py``; the settle reduction of
  stray/repeated resumes then touches rank ``i`` only, as every explored state is settled). ``busy``: some
  rank is blocked in a weight-transfer collective, the only thing of other ranks an edge check of theirs
  reads (``quiescence``, ``properties.py``). The entry: ``(label, new r_i, new rest, violated)``;
- the coordinator taking from its own FIFOs: key ``rest``; from rank ``i``'s: key ``(i, r_i, rest)``
  (:meth:`Environment.coord_take`); the entry holds the new rest, rank ``i``'s id after the take, and the
  START_DP_WAVE broadcasts, delivered to every rank by a memo ``(r, broadcasts) -> r'``
  (:meth:`Environment.wave_to`);
- the front-end's stats refresh (:meth:`Model.refresh_moves`): key ``rest``;
- whether the controller has a move (:meth:`Environment.controller_moves`): key ``(rest, statuses)``;
- the invariant: key ``(p_0, ..., p_{N-1}, rest)`` where ``p_i`` is the id of rank ``i``'s projection on the
  fields :meth:`Properties.invariant` reads (:func:`invariant_projection`).

Collective completions and timeouts (some rank or the trainer blocked), the client's sends and aborts (while
any are left), and the controller's moves (when it has one) take the slow path: decode, run the model's
part, encode (slices that did not change keep their id without being hashed). Each memo entry is computed
on a miss by the model's part on the decoded state, and checked there against it (the other ranks must be
unchanged, the rebuilt successor equal to the model's); ``verify=True`` also compares every successor list,
edge check and invariant with a fresh computation of the model (the cache-consistency mode of the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import reduce
from operator import or_
from typing import Any, overload

from weightsync.model.explorer import Exploration, Violation
from weightsync.model.explorer_checked import explore_checked
from weightsync.model.system import TRANSFER_KINDS, GlobalState, Label, Model, Rank
from weightsync.model.system.effects import collective_args
from weightsync.model.system.state import _new_tuple, _ScratchState

#: An encoded state: ``sum(r_i << FIELD_BITS * i) + (rest << FIELD_BITS * N)`` (see the module docstring).
Compact = int
#: Bits of one rank slice id in an encoded state.
FIELD_BITS = 32
FIELD_MASK = (1 << FIELD_BITS) - 1
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


def slices_projection(r: Rank) -> tuple[Any, ...]:
    """The fields of a rank slice that :meth:`~weightsync.model.system.Model.invariant_slices` and
    :meth:`~weightsync.model.system.Model.invariant_modes` read: blocked, the table's collective, state,
    status, worker state, pause ghost, whether it runs requests."""
    return (
        r.blocked,
        r.vars.collective,
        r.vars.state,
        r.status,
        r.worker.state,
        r.pause_ghost,
        bool(r.running),
    )


def requests_projection(r: Rank) -> tuple[int, ...]:
    """What request_conservation (:meth:`~weightsync.model.system.Model._conserved`) reads of a rank slice:
    the ids of the requests it holds (waiting, running, ADDs queued), sorted."""
    held = [q[0] for q in r.waiting] + [q[0] for q in r.running]
    held += [m[1] for f in r.inq for m in f if m[0] == "ADD"]
    return tuple(sorted(held))


def version_projection(r: Rank) -> tuple[Any, ...]:
    """What version_agreement (:meth:`~weightsync.model.system.Model.invariant_version`) reads of a rank
    slice: its status and weight version."""
    return (r.status, r.vars.weight_version)


def coordinator_projection(r: Rank) -> tuple[Any, ...]:
    """What coordinator_belief (:meth:`~weightsync.model.system.Model._coordinator_belief_right`) reads of a
    rank slice: its wave and :meth:`~weightsync.model.system.Model.coordinator_unsettled`."""
    return (r.vars.current_wave, Model.coordinator_unsettled(r))


def front_end_projection(r: Rank) -> tuple[Any, ...]:
    """What front_end_belief (:meth:`~weightsync.model.system.Model._front_end_belief_right`) reads of a
    rank slice: :meth:`~weightsync.model.system.Model.front_end_unsettled`."""
    return (Model.front_end_unsettled(r),)


#: The rank slice projections of the invariant's groups (:meth:`CompactEngine._invariant_groups`).
RANK_PROJECTIONS: tuple[Callable[[Rank], tuple[Any, ...]], ...] = (
    slices_projection,
    requests_projection,
    version_projection,
    coordinator_projection,
    front_end_projection,
)


def rest_projections(rest: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...]:
    """What the invariant's groups read of the state outside the ranks (``GlobalState[1:]``), in the order
    of :data:`RANK_PROJECTIONS`: the trainer's status; sent, finished, aborted and client-aborted requests;
    the controller's phase and rounds and the trainer's status; the coordinator, whether its FIFOs hold
    anything and whether the trainer is blocked; the front-end's belief that engines run, the coordinator
    and whether its FIFOs hold anything."""
    coord_q, coord, front, ctrl, trainer, done, aborted = rest
    queued = any(coord_q)
    return (
        (trainer.status,),
        (front.next_request, done, aborted, front.client_aborted),
        (ctrl.phase, ctrl.update_rounds, trainer.status),
        (coord, queued, trainer.blocked),
        (front.believed_running, coord, queued),
    )


class CompactEngine:
    """Initial state, successors (with edge checks), invariant, terminal check and canonical form of
    ``model`` over encoded states (see the module docstring), for
    :func:`~weightsync.model.explorer_checked.explore_checked`.

    Args:
        model: the model; its parts compute every memo entry.
        verify: compare every result with a fresh computation of the model (slow; for tests).
    """

    def __init__(self, model: Model, verify: bool = False) -> None:
        self.model = model
        n = self.n = model.n
        self.verify = verify
        self.settle = model.stray_resume or model.repeat_resume
        self.ordered = model.ordered
        #: bit offset of each rank's id in an encoded state, then of the rest's id
        self.shifts = tuple(FIELD_BITS * i for i in range(n))
        self.rest_shift = FIELD_BITS * n
        self.ranks: list[Rank] = []
        self.rank_ids: dict[Rank, int] = {}
        self.rests: list[tuple[Any, ...]] = []
        self.rest_ids: dict[tuple[Any, ...], int] = {}
        # per rank id: blocked, in a transfer collective, has a FIFO to the coordinator, status, projection
        self._blocked: list[str] = []
        self._flags: list[int] = []
        self._coll_proj: list[int] = []
        self._env_class: list[int] = []
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._coll: dict[tuple[int, ...], bool] = {}
        self._status: list[int] = []
        # per rank id: the ids of its projections for the invariant groups, and of their triple
        self._proj: list[int] = []
        self._projs: list[tuple[int, ...]] = []
        self._proj_ids: dict[Any, int] = {}
        self._rest_proj: list[tuple[int, ...]] = []
        self._rest_proj_id: list[int] = []
        # per rest id: trainer blocked, the client may send, the client may abort
        self._rest_flags: list[tuple[bool, bool, bool]] = []
        # the memos (see the module docstring); an entry's ``delta`` is added to the encoded state
        self._local: dict[tuple[int, int, int, bool], list[tuple[Label, int, Sequence[str]]]] = {}
        self._coord: dict[Any, list[_CoordEntry]] = {}
        self._waves: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}
        self._refresh: dict[int, list[tuple[Label, int, Sequence[str]]]] = {}
        self._ctrl: dict[tuple[int, ...], tuple[tuple[Label, Any], ...] | bool | None] = {}
        self._ctrl_ranks: dict[Any, int] = {}
        self._ctrl_rests: dict[Any, int] = {}
        self._ctrl_edges: dict[Any, Sequence[str]] = {}
        self._common: dict[tuple[Any, ...], tuple[tuple[str, Any], ...]] = {}
        self._member: dict[tuple[Any, ...], tuple[int, int]] = {}
        self._done_edge: dict[tuple[Any, ...], Sequence[str]] = {}
        self._inv: dict[tuple[int, ...], Sequence[str]] = {}
        self._group: dict[tuple[int, ...], Any] = {}
        self.lookups = 0
        self.slow = 0

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
            pid = self._proj_ids
            coll = pid.setdefault(("c", r.blocked, r.vars.state), len(pid))
            self._coll_proj.append(coll)
            self._env_class.append(pid.setdefault(("e", self._flags[k], r.status, coll), len(pid)))
            ps = tuple(pid.setdefault((g, *f(r)), len(pid)) for g, f in enumerate(RANK_PROJECTIONS))
            self._projs.append(ps)
            self._proj.append(pid.setdefault(("all", *ps), len(pid)))
        return k

    def rest_id(self, rest: tuple[Any, ...]) -> int:
        """The id of ``rest`` (a GlobalState's fields after ``ranks``; a new id if unseen)."""
        k = self.rest_ids.get(rest)
        if k is None:
            k = self.rest_ids[rest] = len(self.rests)
            self.rests.append(rest)
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
        c = rest << self.rest_shift
        for sh, k in zip(self.shifts, ids, strict=True):
            c |= k << sh
        return c

    def unpack(self, c: Compact) -> tuple[list[int], int]:
        """The rank slice ids and the rest id of encoded state ``c``."""
        return [(c >> sh) & FIELD_MASK for sh in self.shifts], c >> self.rest_shift

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

    # ------------------------------------------------------------------ the explorer's functions

    def initial(self) -> list[Compact]:
        """The model's initial state, encoded."""
        return [self.encode(self.model.initial())]

    def successors(self, c: Compact) -> list[Checked]:
        """The model's successors of ``c`` with their edge checks, in the model's order (see the module
        docstring for which part is memoised how)."""
        n = self.n
        rest = c >> self.rest_shift
        ids = [(c >> sh) & FIELD_MASK for sh in self.shifts]
        plan = self._plans.get((rest, *map(self._env_class.__getitem__, ids)))
        if plan is None:
            plan = self._plan(ids, rest)
        busy, coll, coord_entries, outq, may_send, may_abort, refresh, ctrl_key = plan
        local = self._local
        self.lookups += n
        out: list[Checked] = []
        for i in range(n):
            e = local.get((i, ids[i], rest, busy))
            if e is None:
                e = self._local_miss(ids, rest, i, busy)
            if e:
                out += [(label, c + d, ev) for label, d, ev in e]
        s: GlobalState | None = None
        if coll:
            if coll == _COLL_DONE:
                self._done(c, ids, rest, self._blocked[ids[0]], out)
            else:
                s = self._slow(ids, rest, s, self.model.collective_moves, out)
        for e in coord_entries:
            out.append((e[0], c + e[5] if not e[3] else self._apply_coord(ids, e), e[4]))
        if outq:
            coord = self._coord
            for i in outq:
                entries = coord.get((i, ids[i], rest))
                if entries is None:
                    entries = self._coord_miss(ids, rest, i)
                for e in entries:
                    out.append((e[0], c + e[5] if not e[3] else self._apply_coord(ids, e), e[4]))
        if may_send:
            s = self._slow(ids, rest, s, self.model.send_moves, out)
        if refresh:
            out += [(label, c + d, ev) for label, d, ev in refresh]
        if may_abort:
            s = self._slow(ids, rest, s, self.model.abort_moves, out)
        if ctrl_key is not None:
            self._controller(c, ids, rest, s, ctrl_key, self._ctrl.get(ctrl_key, ()), out)
        if self.verify:
            self._verify(c, out)
        return out

    def _plan(self, ids: list[int], rest: int) -> _Plan:
        """What :meth:`successors` does in states with this rest and these ranks' :attr:`_env_class`: some
        rank in a transfer collective (``busy``); the collective moves (none, the DP completion
        :meth:`_done`, or the slow path: :meth:`Model.collective_moves` has any, which reads the rest and
        each rank's blocked and state); the coordinator's entries for its own FIFOs (keyed by the rest) and
        the ranks with a message for it; whether the client may send or abort; the refresh's entries (keyed
        by the rest); the controller's memo key if it has a move (:meth:`Environment.controller_moves`
        reads the rest and the statuses)."""
        n = self.n
        fs = [self._flags[k] for k in ids]
        flags = reduce(or_, fs)
        busy = bool(flags & _TRANSFER)
        trainer_blocked, may_send, may_abort = self._rest_flags[rest]
        coll = 0
        if flags & _BLOCKED or trainer_blocked:
            key = (rest, *map(self._coll_proj.__getitem__, ids))
            has = self._coll.get(key)
            if has is None:
                moves: _Moves = []
                self.model.collective_moves(self._state(ids, rest), moves)
                has = self._coll[key] = bool(moves)
            if has:
                # every rank in one DP collective (none in a transfer one, the trainer idle): its completion
                # is the only collective move
                blocked = self._blocked
                b0 = blocked[ids[0]]
                same = all(blocked[k] == b0 for k in ids)
                coll = _COLL_SLOW if trainer_blocked or busy or self.settle or not same else _COLL_DONE
        coord_entries = self._coord.get(rest)
        if coord_entries is None:
            coord_entries = self._coord_miss(ids, rest, -1)
        outq = () if self.ordered else tuple(i for i in range(n) if fs[i] & _OUTQ)
        refresh = self._refresh.get(rest)
        if refresh is None:
            refresh = self._refresh_miss(ids, rest)
        ctrl_key = (rest, *map(self._status.__getitem__, ids))
        if ctrl_key not in self._ctrl and not self.model.controller_moves(self._state(ids, rest)):
            self._ctrl[ctrl_key] = None
        plan: _Plan = (
            busy,
            coll,
            coord_entries,
            outq,
            may_send,
            may_abort,
            refresh,
            None if self._ctrl.get(ctrl_key, ()) is None else ctrl_key,
        )
        self._plans[(rest, *map(self._env_class.__getitem__, ids))] = plan
        return plan

    def invariant(self, c: Compact) -> Sequence[str]:
        """The model's invariant of ``c``, memoised by the projections of its ranks and its rest (every
        field some group reads); on a miss, each group memoised by its own projections."""
        proj = self._proj
        ids = [(c >> sh) & FIELD_MASK for sh in self.shifts]
        rest = c >> self.rest_shift
        key = (*map(proj.__getitem__, ids), self._rest_proj_id[rest])
        v = self._inv.get(key)
        if v is None:
            v = self._inv[key] = self._invariant_groups(ids, rest)
        if self.verify and list(v) != self.model.invariant(self.decode(c)):
            raise AssertionError(f"invariant memo differs at {self.decode(c)}")
        return v

    def _invariant_groups(self, ids: list[int], rest: int) -> list[str]:
        """:meth:`Model.invariant` as its groups, in its order, each memoised by the projections of
        :data:`RANK_PROJECTIONS` and :func:`rest_projections`."""
        ps = [self._projs[k] for k in ids]
        rp = self._rest_proj[rest]
        s: GlobalState | None = None
        out: list[Any] = []
        for g in range(len(RANK_PROJECTIONS)):
            key = (rp[g], *[p[g] for p in ps])
            v = self._group.get(key)
            if v is None:
                if s is None:
                    s = self._state(ids, rest)
                v = self._group[key] = self._group_check(g, s)
            out.append(v)
        return [*out[0][0], *out[1], *out[2], *out[3], *out[4], *out[0][1]]

    def _group_check(self, g: int, s: GlobalState) -> Any:
        m = self.model
        if g == 0:
            return (m.invariant_slices(s), m.invariant_modes(s))
        if g == 1:
            return m.invariant_requests(s)
        if g == 2:
            return m.invariant_version(s)
        if g == 3:
            return [] if m._coordinator_belief_right(s) else ["coordinator_belief"]
        return [] if m._front_end_belief_right(s) else ["front_end_belief"]

    def terminal_check(self, c: Compact) -> Sequence[str]:
        """The model's terminal check of ``c``."""
        return self.model.terminal_check(self.decode(c))

    def canon(self, c: Compact) -> Compact:
        """The model's canonical representative of ``c`` (symmetry), encoded."""
        ids, rest = self.unpack(c)
        s = self._state(ids, rest)
        t = self.model.canon(s)
        return c if t is s else self._encode_from(ids, rest, s, t)

    # ------------------------------------------------------------------ misses and slow paths

    def _settled(self, moves: _Moves) -> _Moves:
        if not self.settle:
            return moves
        settle = self.model._settle
        return [(label, settle(t)) for label, t in moves]

    def _local_miss(
        self, ids: list[int], rest: int, i: int, busy: bool
    ) -> list[tuple[Label, int, Sequence[str]]]:
        s = self._state(ids, rest)
        moves: _Moves = []
        self.model.rank_moves(s, i, moves)
        sh = self.shifts[i]
        entry: list[tuple[Label, int, Sequence[str]]] = []
        for label, t in self._settled(moves):
            for j in range(self.n):
                if j != i and t.ranks[j] != s.ranks[j]:
                    raise AssertionError(f"{label!r} changed rank {j}: rank_moves must be rank-local")
            ev = self.model.edge_check(s, label, t)
            nr, nrest = self.rank_id(t.ranks[i]), self.rest_id(tuple(t[1:]))
            entry.append((label, ((nr - ids[i]) << sh) + ((nrest - rest) << self.rest_shift), ev))
        self._local[(i, ids[i], rest, busy)] = entry
        return entry

    def _slow(
        self,
        ids: list[int],
        rest: int,
        s: GlobalState | None,
        part: Callable[[GlobalState, _Moves], None],
        out: list[Checked],
    ) -> GlobalState:
        """Run the model's ``part`` on the decoded state and encode its moves into ``out``."""
        self.slow += 1
        if s is None:
            s = self._state(ids, rest)
        moves: _Moves = []
        part(s, moves)
        edge_check = self.model.edge_check
        for label, t in self._settled(moves):
            out.append((label, self._encode_from(ids, rest, s, t), edge_check(s, label, t)))
        return s

    def _controller(
        self,
        c: Compact,
        ids: list[int],
        rest: int,
        s: GlobalState | None,
        key: tuple[int, ...],
        plan: tuple[tuple[Label, Any], ...] | bool,
        out: list[Checked],
    ) -> None:
        """The controller's moves (:meth:`Environment._controller`), which read the rest and the ranks'
        statuses (``key``). ``plan``: ``()`` unknown yet, True some move is not a fan-out, else the moves'
        labels and the controller each leaves. A fan-out (``fan``, ``retry``, ``extra``, ``end``) maps each
        rank's slice on its own, given the controller after it (:meth:`Environment._fan_out`,
        :meth:`Environment._retry`): built from the memo ``(label, controller, j, r_j) -> r_j'`` and
        ``(label, key) -> rest'`` when every entry is known, else by the slow path, which records them (and
        fails if one disagrees); its edge check reads the ranks only and is memoised by their ids before
        and after."""
        if plan and plan is not True:
            ranks, rests, edges = self._ctrl_ranks, self._ctrl_rests, self._ctrl_edges
            built = []
            for label, ctrl in plan:  # type: ignore[union-attr]
                new = [ranks.get((label, ctrl, j, ids[j]), -1) for j in range(self.n)]
                if min(new) < 0:
                    break
                nrest = rests[(label, key)]
                ek = (label, *ids, *new)
                ev = edges.get(ek)
                if ev is None:
                    ev = edges[ek] = self.model.edge_check(
                        self._state(ids, rest), label, self._state(new, nrest)
                    )
                built.append((label, self.pack(new, nrest), ev))
            else:
                out += built
                return
        if s is None:
            s = self._state(ids, rest)
        moves: _Moves = []
        self.model._controller(s, moves)
        labels = []
        per_rank = True
        for label, t in self._settled(moves):
            labels.append((label, t.ctrl))
            if label[0] not in _PER_RANK_CONTROLLER:
                per_rank = False
            t_c = self._encode_from(ids, rest, s, t)
            ev = self.model.edge_check(s, label, t)
            out.append((label, t_c, ev))
            if per_rank:
                new, nrest = self.unpack(t_c)
                self._record(self._ctrl_rests, (label, key), nrest)
                for j in range(self.n):
                    self._record(self._ctrl_ranks, (label, t.ctrl, j, ids[j]), new[j])
                self._ctrl_edges[(label, *ids, *new)] = ev
        self._ctrl[key] = (tuple(labels) if per_rank else True) if labels else None

    @staticmethod
    def _record(memo: dict[Any, int], key: Any, value: int) -> None:
        old = memo.setdefault(key, value)
        if old != value:
            raise AssertionError(f"controller memo {key!r}: {old} != {value}; a fan-out is not rank by rank")

    def _done(self, c: Compact, ids: list[int], rest: int, kind: str, out: list[Checked]) -> None:
        """The completion of DP collective ``kind`` (:meth:`RankEffects._complete`): the outcome memoised by
        the members' ids, each member's completion (:meth:`RankEffects.complete_member`) by ``(kind,
        outcome, i, its id, the rest so far)``, members in rank order as the model does; the edge check by
        the members' ids before and after (it reads no more for a DP collective)."""
        m = self.model
        ck = (kind, *ids)
        common = self._common.get(ck)
        if common is None:
            common = self._common[ck] = collective_args(tuple([self.ranks[k] for k in ids]), kind)
        cur = list(ids)
        r = rest
        member = self._member
        for i in range(self.n):
            key = (kind, common, i, cur[i], r)
            e = member.get(key)
            if e is None:
                s = self._state(cur, r)
                scratch = _ScratchState(s)
                m.complete_member(scratch, i, kind, common, False)
                t = scratch.freeze()
                if any(t.ranks[j] != s.ranks[j] for j in range(self.n) if j != i):
                    raise AssertionError(f"completing {kind} on rank {i} changed another rank")
                e = member[key] = (self.rank_id(t.ranks[i]), self.rest_id(tuple(t[1:])))
            cur[i], r = e
        t_c = self.pack(cur, r)
        label = ("done", kind)
        ek = (kind, *ids, *cur)
        ev = self._done_edge.get(ek)
        if ev is None:
            ev = self._done_edge[ek] = m.edge_check(self._state(ids, rest), label, self._state(cur, r))
        out.append((label, t_c, ev))

    def _apply_coord(self, ids: list[int], e: _CoordEntry) -> Compact:
        """A coordinator entry ``(label, rank src's id after the take, new rest, broadcasts, violated)``
        applied to the rank ids ``ids``."""
        label, popped, nrest, bcasts = e[0], e[1], e[2], e[3]
        src = label[1]
        cur = list(ids)
        if src >= 0:
            cur[src] = popped
        if bcasts:
            waves = self._waves
            for j in range(self.n):
                k = (cur[j], bcasts)
                w = waves.get(k)
                if w is None:
                    r = self.ranks[cur[j]]
                    for wave, exclude in bcasts:
                        r = self.model.wave_to(r, wave, exclude)
                    w = waves[k] = self.rank_id(r)
                cur[j] = w
        return self.pack(cur, nrest)

    def _coord_miss(self, ids: list[int], rest: int, src: int) -> list[_CoordEntry]:
        m = self.model
        s = self._state(ids, rest)
        fifos = range(len(s.coord_q)) if src < 0 else (0,)
        entries = []
        for f in fifos:
            if src < 0 and not s.coord_q[f]:
                continue
            label = ("coord", src, f)
            scratch = _ScratchState(s)
            bcasts = m.coord_take(scratch, src, f)
            taken = scratch.freeze()
            popped = self.rank_id(taken.ranks[src]) if src >= 0 else -1
            t = self._settled([(label, m._coord_recv(s, src, f))])[0][1]
            ev = m.edge_check(s, label, t)
            nrest = self.rest_id(tuple(taken[1:]))
            delta = (nrest - rest) << self.rest_shift
            if src >= 0:
                delta += (popped - ids[src]) << self.shifts[src]
            e: _CoordEntry = (label, popped, nrest, bcasts, ev, delta)
            if self.decode(self._apply_coord(ids, e)) != t:
                raise AssertionError(f"coordinator memo entry {e!r} does not rebuild the model's successor")
            entries.append(e)
        self._coord[rest if src < 0 else (src, ids[src], rest)] = entries
        return entries

    def _refresh_miss(self, ids: list[int], rest: int) -> list[tuple[Label, int, Sequence[str]]]:
        s = self._state(ids, rest)
        moves: _Moves = []
        self.model.refresh_moves(s, moves)
        entry: list[tuple[Label, int, Sequence[str]]] = []
        for label, t in self._settled(moves):
            if t.ranks != s.ranks:
                raise AssertionError("the front-end's refresh changed a rank")
            d = (self.rest_id(tuple(t[1:])) - rest) << self.rest_shift
            entry.append((label, d, self.model.edge_check(s, label, t)))
        self._refresh[rest] = entry
        return entry

    def _verify(self, c: Compact, out: list[Checked]) -> None:
        """Compare ``out`` with the model's successors and edge checks of the decoded state."""
        m = self.model
        s = self.decode(c)
        want = m.successors(s)
        got = [(label, self.decode(t)) for label, t, _ in out]
        if got != want:
            raise AssertionError(f"successors differ at {s}:\n{got}\n!=\n{want}")
        for (label, t), (_, _, ev) in zip(want, out, strict=True):
            if list(ev) != m.edge_check(s, label, t):
                raise AssertionError(f"edge check of {label!r} differs at {s}")

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, Any]:
        """Memo figures: the rank-local memo's lookups, entries (its misses) and hit rate; the entries of
        the others; slow-path calls; distinct slices and rests."""
        entries = len(self._local)
        return {
            "rank_slices": len(self.ranks),
            "rests": len(self.rests),
            "local_lookups": self.lookups,
            "local_entries": entries,
            "local_hit_rate": round(1 - entries / self.lookups, 4) if self.lookups else None,
            "invariant_entries": len(self._inv),
            "coord_entries": len(self._coord),
            "refresh_entries": len(self._refresh),
            "controller_entries": len(self._ctrl),
            "member_entries": len(self._member),
            "slow_calls": self.slow,
        }


class DecodedStates(Sequence[GlobalState]):
    """An exploration's encoded states, read as :class:`GlobalState` (decoded on access)."""

    def __init__(self, engine: CompactEngine, states: Sequence[Compact]) -> None:
        self.engine = engine
        self.compact = states

    def __len__(self) -> int:
        return len(self.compact)

    @overload
    def __getitem__(self, i: int) -> GlobalState: ...

    @overload
    def __getitem__(self, i: slice) -> list[GlobalState]: ...

    def __getitem__(self, i: int | slice) -> GlobalState | list[GlobalState]:
        if isinstance(i, slice):
            return [self.engine.decode(c) for c in self.compact[i]]
        return self.engine.decode(self.compact[i])

    def __iter__(self) -> Iterator[GlobalState]:
        decode = self.engine.decode
        return (decode(c) for c in self.compact)


class DecodedIndex(Mapping[GlobalState, int]):
    """An exploration's state -> index map, keyed by :class:`GlobalState` (encoded on lookup)."""

    def __init__(self, engine: CompactEngine, index: Mapping[Compact, int]) -> None:
        self.engine = engine
        self.compact = index

    def __getitem__(self, s: GlobalState) -> int:
        e = self.engine
        ids = [e.rank_ids.get(r, -1) for r in s.ranks]
        rest = e.rest_ids.get(tuple(s[1:]), -1)
        if rest < 0 or min(ids) < 0:
            raise KeyError(s)
        return self.compact[e.pack(ids, rest)]

    def __len__(self) -> int:
        return len(self.compact)

    def __iter__(self) -> Iterator[GlobalState]:
        return iter(DecodedStates(self.engine, list(self.compact)))


def explore_compact(
    model: Model,
    *,
    symmetry: bool = False,
    keep_edges: bool = False,
    keep_labels: bool = False,
    max_states: int = 50_000_000,
    stop_at_first: bool = False,
    verify: bool = False,
) -> tuple[Exploration[GlobalState], CompactEngine]:
    """Explore ``model`` with the compact engine: the same exploration as
    ``explore([model.initial()], model.successors, invariant=..., edge_check=..., terminal_check=...,
    canon=...)`` (same states in the same order, same counts, violations and paths), its states decoded on
    access; and the engine (its memo figures: :meth:`CompactEngine.stats`)."""
    engine = CompactEngine(model, verify=verify)
    ex = explore_checked(
        engine.initial(),
        engine.successors,
        invariant=engine.invariant,
        terminal_check=engine.terminal_check,
        canon=engine.canon if symmetry else None,
        keep_edges=keep_edges,
        keep_labels=keep_labels,
        max_states=max_states,
        stop_at_first=stop_at_first,
    )
    violations = {
        name: Violation(v.property, v.state, v.label, None if v.target is None else engine.decode(v.target))
        for name, v in ex.violations.items()
    }
    out: Exploration[GlobalState] = Exploration(
        states=DecodedStates(engine, ex.states),
        index=DecodedIndex(engine, ex.index),
        parent=ex.parent,
        via=ex.via,
        level=ex.level,
        transitions=ex.transitions,
        src=ex.src,
        dst=ex.dst,
        labels=ex.labels,
        violations=violations,
        complete=ex.complete,
        seconds=ex.seconds,
        terminal=ex.terminal,
    )
    return out, engine
