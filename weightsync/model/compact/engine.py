"""The compact engine's successor function, invariant and memos (see :mod:`weightsync.model.compact`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import reduce
from operator import or_
from typing import Any

from weightsync.model.compact.canon import CanonicalForm
from weightsync.model.compact.codec import (
    _BLOCKED,
    _COLL_DONE,
    _COLL_SLOW,
    _OUTQ,
    _PER_RANK_CONTROLLER,
    _TRANSFER,
    Checked,
    Compact,
    _CoordEntry,
    _Moves,
    _Plan,
)
from weightsync.model.compact.projections import RANK_PROJECTIONS, group_check
from weightsync.model.system import GlobalState, Label, Model
from weightsync.model.system.effects import collective_args
from weightsync.model.system.state import _ScratchState


class CompactEngine(CanonicalForm):
    """Initial state, successors (with edge checks), invariant, terminal check and canonical form of
    ``model`` over encoded states (see the module docstring), for
    :func:`~weightsync.model.explorer.explore_checked`.

    Args:
        model: the model; its parts compute every memo entry.
        verify: compare every result with a fresh computation of the model (slow; for tests).
        symmetry: the exploration reduces by symmetry (its ``canon`` is :meth:`canon`): at N > 3 a rank's
            own move from a plain canonical state is returned in canonical form already
            (:meth:`~weightsync.model.compact.canon.CanonicalForm.resorted`), so the explorer finds it
            without canonicalising it. The successors are then the model's up to renaming ranks.
    """

    def __init__(self, model: Model, verify: bool = False, symmetry: bool = False) -> None:
        super().__init__(model, verify)
        self.presort = symmetry and self.n > 3
        self.settle = model.stray_resume or model.repeat_resume
        self.silent = model.silent_waves
        # the model's successors are reduced (:meth:`Model.reduced`); the DP completion's fast path and the
        # broadcasts apply the silent-wave one themselves (the settle one sends collectives to the slow path)
        self.reduce = self.settle or self.silent
        self._quiet_ids: dict[tuple[int, int], int] = {}
        self.ordered = model.ordered
        # the memos (see the package docstring); an entry's ``delta`` is added to the encoded state
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._coll: dict[tuple[int, ...], bool] = {}
        self._local: dict[tuple[int, int, int, bool], list[tuple[Label, int, Sequence[str]]]] = {}
        self._coord: dict[Any, list[_CoordEntry]] = {}
        self._waves: dict[tuple[int, int, tuple[tuple[int, int], ...]], int] = {}
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
        self.presorted = 0  # (verify mode) successors that came canonical already and were checked so

    # ------------------------------------------------------------------ the explorer's functions

    def initial(self) -> list[Compact]:
        """The model's initial state, encoded."""
        return [self.encode(self.model.initial())]

    def successors(self, c: Compact) -> list[Checked]:
        """The model's successors of ``c`` with their edge checks, in the model's order (see the module
        docstring for which part is memoised how)."""
        n = self.n
        ids, rest = self.unpack(c)
        plan = self._plans.get((rest, *map(self._env_class.__getitem__, ids)))
        if plan is None:
            plan = self._plan(ids, rest)
        busy, coll, coord_entries, outq, may_send, may_abort, refresh, ctrl_key = plan
        local = self._local
        self.lookups += n
        out: list[Checked] = []
        presort = self.presort and not self._rest_names[rest] and self._named.isdisjoint(ids)
        resorted = self.resorted
        for i in range(n):
            e = local.get((i, ids[i], rest, busy))
            if e is None:
                e = self._local_miss(ids, rest, i, busy)
            if e:
                if presort and i:
                    out += [(label, resorted(c + d, ids, i), ev) for label, d, ev in e]
                else:
                    out += [(label, c + d, ev) for label, d, ev in e]
        s: GlobalState | None = None
        if coll:
            if coll == _COLL_DONE:
                self._done(c, ids, rest, self._blocked[ids[0]], out)
            else:
                s = self._slow(ids, rest, s, self.model.collective_moves, out)
        for ce in coord_entries:
            out.append((ce[0], c + ce[5] if not ce[3] else self._apply_coord(ids, ce), ce[4]))
        if outq:
            coord = self._coord
            for i in outq:
                entries = coord.get((i, ids[i], rest))
                if entries is None:
                    entries = self._coord_miss(ids, rest, i)
                for ce in entries:
                    out.append((ce[0], c + ce[5] if not ce[3] else self._apply_coord(ids, ce), ce[4]))
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
        each rank's blocked, state and status); the coordinator's entries for its own FIFOs (keyed by the
        rest) and the ranks with a message for it; whether the client may send or abort; the refresh's entries (keyed
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
        ids, rest = self.unpack(c)
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
                v = self._group[key] = group_check(self.model, g, s)
            out.append(v)
        return [*out[0][0], *out[1], *out[2], *out[3], *out[4], *out[0][1]]

    def terminal_check(self, c: Compact) -> Sequence[str]:
        """The model's terminal check of ``c``."""
        return self.model.terminal_check(self.decode(c))

    # ------------------------------------------------------------------ misses and slow paths

    def _settled(self, moves: _Moves) -> _Moves:
        if not self.reduce:
            return moves
        reduced = self.model.reduced
        return [(label, reduced(t)) for label, t in moves]

    def _quiet_id(self, i: int, k: int) -> int:
        """The id of rank ``i``'s slice ``k`` after the silent-wave reduction (:meth:`SilentWaves.quiet_rank`)."""
        q = self._quiet_ids.get((i, k))
        if q is None:
            q = self._quiet_ids[(i, k)] = self.rank_id(self.model.quiet_rank(i, self.ranks[k]))
        return q

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
        plan: tuple[tuple[Label, Any], ...] | bool | None,
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
        if isinstance(plan, tuple) and plan:
            ranks, rests, edges = self._ctrl_ranks, self._ctrl_rests, self._ctrl_edges
            built = []
            for label, ctrl in plan:
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
        if self.silent:
            cur = [self._quiet_id(i, k) for i, k in enumerate(cur)]
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
                k = (j, cur[j], bcasts)
                w = waves.get(k)
                if w is None:
                    r = self.ranks[cur[j]]
                    for wave, exclude in bcasts:
                        r = self.model.wave_to(r, wave, exclude)
                    w = waves[k] = self.rank_id(self.model.quiet_rank(j, r) if self.silent else r)
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
        """Compare ``out`` with the model's successors and edge checks of the decoded state; a successor that
        came canonical already (``symmetry``, :meth:`resorted`) with the model's canon of its successor.

        Raises:
            AssertionError: a successor, its label or its edge check differs."""
        m = self.model
        s = self.decode(c)
        want = m.successors(s)
        got = [(label, self.decode(t)) for label, t, _ in out]
        if len(got) != len(want):
            raise AssertionError(f"successors differ at {s}:\n{got}\n!=\n{want}")
        if self.presort:  # a rank's own move may come canonical already: then it must be the model's canon
            expect = []
            for (label, t), (_, g) in zip(want, got, strict=True):
                if g != t:
                    t = m.canon(t)
                    self.presorted += 1
                expect.append((label, t))
        else:
            expect = want
        if got != expect:
            raise AssertionError(f"successors differ at {s}:\n{got}\n!=\n{expect}")
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
