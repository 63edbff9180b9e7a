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
from typing import Any, overload

from weightsync.model.explorer import Exploration, Violation
from weightsync.model.explorer_checked import explore_checked
from weightsync.model.system import TRANSFER_KINDS, GlobalState, Label, Model, Rank
from weightsync.model.system.state import _new_tuple, _ScratchState

#: An encoded state: rank slice ids, then the rest's id.
Compact = tuple[int, ...]
#: A successor with its edge check: ``(label, next state, names of violated transition properties)``.
Checked = tuple[Label, Compact, Sequence[str]]
_Moves = list[tuple[Label, GlobalState]]


def invariant_projection(r: Rank) -> tuple[Any, ...]:
    """The fields of a rank slice that :meth:`~weightsync.model.system.Model.invariant` reads: blocked and
    the table's collective (collectives_match), state, status and worker state (phase_bracketing), the
    request ids it holds (request_conservation), weight version (version_agreement), current wave, whether
    anything is queued or running and the engines-running and pending-pause flags (coordinator_belief,
    front_end_belief), and the pause ghost (mode_semantics)."""
    v = r.vars
    inq = r.inq
    held = [q[0] for q in r.waiting] + [q[0] for q in r.running]
    held += [m[1] for f in inq for m in f if m[0] == "ADD"]
    return (
        r.blocked,
        v.collective,
        v.state,
        r.status,
        r.worker.state,
        tuple(sorted(held)),
        v.weight_version,
        v.current_wave,
        any(inq),
        bool(r.outq),
        bool(r.waiting),
        bool(r.running),
        v.engines_running,
        v.pending_pause,
        any(m[0] in ("W", "ADD") for f in inq for m in f),
        r.pause_ghost,
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
        self.n = model.n
        self.verify = verify
        self.settle = model.stray_resume or model.repeat_resume
        self.ranks: list[Rank] = []
        self.rank_ids: dict[Rank, int] = {}
        self.rests: list[tuple[Any, ...]] = []
        self.rest_ids: dict[tuple[Any, ...], int] = {}
        # per rank id: blocked, in a transfer collective, has a FIFO to the coordinator, status, projection
        self._blocked: list[str] = []
        self._transfer: list[bool] = []
        self._outq: list[bool] = []
        self._status: list[int] = []
        self._proj: list[int] = []
        self._proj_ids: dict[tuple[Any, ...], int] = {}
        # per rest id: trainer blocked, the client may send, the client may abort
        self._rest_flags: list[tuple[bool, bool, bool]] = []
        self._local: dict[tuple[int, int, int, bool], tuple[tuple[Label, int, int, Sequence[str]], ...]] = {}
        self._coord: dict[Any, tuple[tuple[Label, int, int, tuple[tuple[int, int], ...], Sequence[str]], ...]]
        self._coord = {}
        self._waves: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}
        self._refresh: dict[int, tuple[tuple[Label, int, Sequence[str]], ...]] = {}
        self._ctrl: dict[tuple[Any, ...], bool] = {}
        self._inv: dict[tuple[int, ...], Sequence[str]] = {}
        self.lookups = 0
        self.misses = 0

    # ------------------------------------------------------------------ encoding

    def rank_id(self, r: Rank) -> int:
        """The id of slice ``r`` (a new one if unseen)."""
        k = self.rank_ids.get(r)
        if k is None:
            k = self.rank_ids[r] = len(self.ranks)
            self.ranks.append(r)
            self._blocked.append(r.blocked)
            self._transfer.append(r.blocked in TRANSFER_KINDS)
            self._outq.append(bool(r.outq))
            self._status.append(r.status)
            p = invariant_projection(r)
            self._proj.append(self._proj_ids.setdefault(p, len(self._proj_ids)))
        return k

    def rest_id(self, rest: tuple[Any, ...]) -> int:
        """The id of ``rest`` (a GlobalState's fields after ``ranks``; a new id if unseen)."""
        k = self.rest_ids.get(rest)
        if k is None:
            k = self.rest_ids[rest] = len(self.rests)
            self.rests.append(rest)
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

    def encode(self, s: GlobalState) -> Compact:
        """``s`` as ``(r_0, ..., r_{N-1}, rest)``."""
        return (*[self.rank_id(r) for r in s.ranks], self.rest_id(tuple(s[1:])))

    def decode(self, c: Compact) -> GlobalState:
        """The state ``c`` encodes."""
        ranks = self.ranks
        return _new_tuple(GlobalState, (tuple([ranks[k] for k in c[:-1]]), *self.rests[c[-1]]))

    def _encode_from(self, c: Compact, s: GlobalState, t: GlobalState) -> Compact:
        """``t``, a successor of ``s`` (encoded ``c``): slices that are the same objects as ``s``'s keep
        their ids unhashed."""
        sr, tr = s.ranks, t.ranks
        ids = [c[j] if tr[j] is sr[j] else self.rank_id(tr[j]) for j in range(self.n)]
        same = all(a is b for a, b in zip(s[1:], t[1:], strict=True))
        return (*ids, c[-1] if same else self.rest_id(tuple(t[1:])))

    # ------------------------------------------------------------------ the explorer's functions

    def initial(self) -> list[Compact]:
        """The model's initial state, encoded."""
        return [self.encode(self.model.initial())]

    def successors(self, c: Compact) -> list[Checked]:
        """The model's successors of ``c`` with their edge checks, in the model's order (see the module
        docstring for which part is memoised how)."""
        n = self.n
        rest = c[n]
        blocked = self._blocked
        transfer = self._transfer
        busy = any(transfer[k] for k in c[:n])
        out: list[Checked] = []
        local = self._local
        self.lookups += n
        s: GlobalState | None = None
        for i in range(n):
            e = local.get((i, c[i], rest, busy))
            if e is None:
                e = self._local_miss(c, i, busy)
            for label, nr, nrest, ev in e:
                out.append((label, (*c[:i], nr, *c[i + 1 : n], nrest), ev))
        trainer_blocked, may_send, may_abort = self._rest_flags[rest]
        # collective completions need every rank blocked in one collective; timeouts, a transfer one
        b0 = blocked[c[0]]
        if trainer_blocked or busy or (b0 and all(blocked[k] == b0 for k in c[1:n])):
            s = self._slow(c, s, self.model.collective_moves, out)
        self._coord_moves(c, out)
        if may_send:
            s = self._slow(c, s, self.model.send_moves, out)
        r = self._refresh.get(rest)
        if r is None:
            r = self._refresh_miss(c)
        for label, nrest, ev in r:
            out.append((label, (*c[:n], nrest), ev))
        if may_abort:
            s = self._slow(c, s, self.model.abort_moves, out)
        status = self._status
        key = (rest, *[status[k] for k in c[:n]])
        has = self._ctrl.get(key)
        if has is None:
            has = self._ctrl[key] = bool(self.model.controller_moves(self.decode(c)))
            self.misses += 1
        if has:
            self._slow(c, s, self.model._controller, out)
        if self.verify:
            self._verify(c, out)
        return out

    def invariant(self, c: Compact) -> Sequence[str]:
        """The model's invariant of ``c``, memoised by the ranks' projections and the rest."""
        proj = self._proj
        key = (*[proj[k] for k in c[:-1]], c[-1])
        v = self._inv.get(key)
        if v is None:
            v = self._inv[key] = self.model.invariant(self.decode(c))
        elif self.verify and list(v) != self.model.invariant(self.decode(c)):
            raise AssertionError(f"invariant memo differs at {self.decode(c)}")
        return v

    def terminal_check(self, c: Compact) -> Sequence[str]:
        """The model's terminal check of ``c``."""
        return self.model.terminal_check(self.decode(c))

    def canon(self, c: Compact) -> Compact:
        """The model's canonical representative of ``c`` (symmetry), encoded."""
        s = self.decode(c)
        t = self.model.canon(s)
        return c if t is s else self._encode_from(c, s, t)

    # ------------------------------------------------------------------ misses and slow paths

    def _settled(self, moves: _Moves) -> _Moves:
        if not self.settle:
            return moves
        settle = self.model._settle
        return [(label, settle(t)) for label, t in moves]

    def _local_miss(
        self, c: Compact, i: int, busy: bool
    ) -> tuple[tuple[Label, int, int, Sequence[str]], ...]:
        self.misses += 1
        s = self.decode(c)
        moves: _Moves = []
        self.model.rank_moves(s, i, moves)
        entry = []
        for label, t in self._settled(moves):
            for j in range(self.n):
                if j != i and t.ranks[j] != s.ranks[j]:
                    raise AssertionError(f"{label!r} changed rank {j}: rank_moves must be rank-local")
            ev = self.model.edge_check(s, label, t)
            entry.append((label, self.rank_id(t.ranks[i]), self.rest_id(tuple(t[1:])), ev))
        out = self._local[(i, c[i], c[self.n], busy)] = tuple(entry)
        return out

    def _slow(
        self,
        c: Compact,
        s: GlobalState | None,
        part: Callable[[GlobalState, _Moves], None],
        out: list[Checked],
    ) -> GlobalState:
        """Run the model's ``part`` on the decoded state and encode its moves into ``out``."""
        if s is None:
            s = self.decode(c)
        moves: _Moves = []
        part(s, moves)
        edge_check = self.model.edge_check
        for label, t in self._settled(moves):
            out.append((label, self._encode_from(c, s, t), edge_check(s, label, t)))
        return s

    def _coord_moves(self, c: Compact, out: list[Checked]) -> None:
        """The coordinator's moves (:meth:`Model.coord_moves`): its own FIFOs keyed by the rest, each rank's
        FIFO to it keyed by ``(i, r_i, rest)``."""
        n = self.n
        rest = c[n]
        entries = self._coord.get(rest)
        if entries is None:
            entries = self._coord_miss(c, -1)
        for e in entries:
            out.append((e[0], self._apply_coord(c, e), e[4]))
        if self.model.ordered:
            return
        has_outq = self._outq
        for i in range(n):
            if has_outq[c[i]]:
                key = (i, c[i], rest)
                entries = self._coord.get(key)
                if entries is None:
                    entries = self._coord_miss(c, i)
                for e in entries:
                    out.append((e[0], self._apply_coord(c, e), e[4]))

    def _apply_coord(self, c: Compact, e: tuple[Label, int, int, tuple[tuple[int, int], ...], Any]) -> Compact:
        """A coordinator entry ``(label, src, rank src's id after the take, new rest, broadcasts)`` applied
        to ``c``."""
        n = self.n
        label, popped, nrest, bcasts = e[0], e[1], e[2], e[3]
        src = label[1]
        ids = list(c[:n])
        if src >= 0:
            ids[src] = popped
        if bcasts:
            waves = self._waves
            for j in range(n):
                k = (ids[j], bcasts)
                w = waves.get(k)
                if w is None:
                    r = self.ranks[ids[j]]
                    for wave, exclude in bcasts:
                        r = self.model.wave_to(r, wave, exclude)
                    w = waves[k] = self.rank_id(r)
                ids[j] = w
        return (*ids, nrest)

    def _coord_miss(
        self, c: Compact, src: int
    ) -> tuple[tuple[Label, int, int, tuple[tuple[int, int], ...], Sequence[str]], ...]:
        self.misses += 1
        m = self.model
        s = self.decode(c)
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
            e = (label, popped, self.rest_id(tuple(taken[1:])), bcasts, ev)
            if self.decode(self._apply_coord(c, e)) != t:
                raise AssertionError(f"coordinator memo entry {e!r} does not rebuild the model's successor")
            entries.append(e)
        out = self._coord[rest_key(c, src)] = tuple(entries)
        return out

    def _refresh_miss(self, c: Compact) -> tuple[tuple[Label, int, Sequence[str]], ...]:
        self.misses += 1
        s = self.decode(c)
        moves: _Moves = []
        self.model.refresh_moves(s, moves)
        entry = []
        for label, t in self._settled(moves):
            if t.ranks != s.ranks:
                raise AssertionError("the front-end's refresh changed a rank")
            entry.append((label, self.rest_id(tuple(t[1:])), self.model.edge_check(s, label, t)))
        out = self._refresh[c[self.n]] = tuple(entry)
        return out

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
        """Memo figures: rank-local lookups and misses of every memo, hit rate of the rank-local memo,
        distinct slices and rests."""
        local_misses = len(self._local)
        return {
            "rank_slices": len(self.ranks),
            "rests": len(self.rests),
            "local_lookups": self.lookups,
            "local_entries": local_misses,
            "local_hit_rate": round(1 - local_misses / self.lookups, 4) if self.lookups else None,
            "invariant_entries": len(self._inv),
            "coord_entries": len(self._coord),
            "refresh_entries": len(self._refresh),
            "controller_entries": len(self._ctrl),
            "misses": self.misses,
        }


def rest_key(c: Compact, src: int) -> Any:
    """The coordinator memo's key: the rest for its own FIFOs, ``(src, r_src, rest)`` for rank ``src``'s."""
    return c[-1] if src < 0 else (src, c[src], c[-1])


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
        ids = [e.rank_ids.get(r) for r in s.ranks]
        rest = e.rest_ids.get(tuple(s[1:]))
        if rest is None or any(k is None for k in ids):
            raise KeyError(s)
        return self.compact[(*ids, rest)]  # type: ignore[arg-type]

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
