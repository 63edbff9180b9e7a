"""The ranks: receiving a message, a loop step, collective completions and timeouts, and the
interpretation of the effects the rank table's transitions name."""

from __future__ import annotations

from typing import Any

from weightsync.model.system.base import ModelBase
from weightsync.model.system.state import (
    CALL_EVENT,
    DONE_EVENT,
    ENTER_EFFECT,
    FAIL_PHASE,
    FAILABLE_EFFECTS,
    FAILED_REPLY,
    GHOST_QUEUED,
    GHOST_RECEIVED,
    OWE_PAUSE,
    OWE_RESUME,
    PAUSE,
    REPLIED,
    RETRY,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
    GlobalState,
    Label,
    Rank,
    Trainer,
    _new_tuple,
    _ScratchState,
    ghost_replied,
    ghost_with_mode,
)
from weightsync.spec.calls import CALL_ARGS, WORKER_OUTCOME, call_args, worker_outcome
from weightsync.spec.collectives import (
    ABANDONED_ON_REFUSAL,
    CALL_FAIL_PHASE,
    OUTCOME_KINDS,
    contribution,
    done_args,
    outcome_args,
    reduce_values,
)
from weightsync.spec.front_end import RANK_EFFECT_EVENT
from weightsync.spec.rank import EFFECT_RANKS, RankVars, effect_acts_on
from weightsync.spec.states import (
    DRAINS_BEFORE_RETURN,
    PauseMode,
    RankEvent,
    RankState,
    admits_waiting,
    advances_running,
    schedulable,
)
from weightsync.spec.table import Transition
from weightsync.spec.worker import WORKER_EVENT_OF_EFFECT

#: Effects that answer a call at once (a pause or resume without any is answered later).
_IMMEDIATE_REPLIES = frozenset({"reply", "reply_pause", "reply_resume", "refuse", "reply_failure"})


def collective_args(ranks: tuple[Rank, ...], kind: str) -> tuple[tuple[str, Any], ...]:
    """The outcome arguments of collective ``kind`` completed by ``ranks`` (the spec's contributions and
    reduction, :mod:`weightsync.spec.collectives`), sorted by name; ``()`` for a kind without any."""
    if kind not in OUTCOME_KINDS:
        return ()
    contribs = [
        contribution(
            kind,
            r.vars.pause_state,
            len(r.waiting),
            len(r.running),
            r.vars.pending_pause,
            r.vars.current_wave,
        )
        for r in ranks
    ]
    return outcome_args(kind, reduce_values(kind, contribs))


class RankEffects(ModelBase):
    """The rank transitions of :class:`Model` and the interpretation of the table's effects."""

    def _has_work(self, rank: Rank) -> bool:
        return schedulable(rank.vars.pause_state, len(rank.waiting), len(rank.running))

    def _timeouts(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """A member of a weight-transfer collective that can never complete times out (weightsync: every
        collective has a timeout that becomes an error): some rank is ``failed`` outside it (it refuses the
        call), the trainer timed out of it, or (:data:`~weightsync.spec.collectives.ABANDONED_ON_REFUSAL`) a
        rank answered its call with an error without joining. Each member times out on its own."""
        ranks = s.ranks
        for k in TRANSFER_KINDS:
            in_k = [i for i, r in enumerate(ranks) if r.blocked == k]
            trainer_in = s.trainer.blocked == k
            if not in_k and not trainer_in:
                continue
            stuck = (
                any(r.vars.state is RankState.FAILED and r.blocked != k for r in ranks)
                or (not trainer_in and s.trainer.status == FAILED_REPLY)
                or (
                    k in ABANDONED_ON_REFUSAL
                    and any(r.status == FAILED_REPLY and r.blocked != k for r in ranks)
                )
            )
            if not stuck:
                continue
            for i in in_k:
                out.append((("timeout", i, k), self._timeout(s, i, k)))
            if trainer_in:
                out.append((("timeout", -1, k), s._replace(trainer=Trainer("", FAILED_REPLY))))

    def _timeout(self, s: GlobalState, i: int, kind: str) -> GlobalState:
        scratch = _ScratchState(s)
        rank = scratch.ranks[i]._replace(blocked="")
        scratch.ranks[i] = rank
        self._nested(scratch, i, RankEvent.TRANSFER_FAILED, (("phase", FAIL_PHASE[kind]),))
        return scratch.freeze()

    def _nested(
        self, scratch: _ScratchState, i: int, event: RankEvent, extra: tuple[tuple[str, Any], ...]
    ) -> None:
        """Fire an outcome event on rank ``i`` inside a successor being built, and interpret its effects."""
        rank = scratch.ranks[i]
        before = rank.vars
        tr, after = self.fire(i, before, event, extra)
        scratch.ranks[i] = rank._replace(vars=after)
        if tr is not None:
            for eff in tr.effects:
                self._effect(scratch, i, eff, before, -1)

    def _recv(self, s: GlobalState, i: int, f: int, fail: bool = False) -> GlobalState:
        rank = s.ranks[i]
        q = rank.inq[f]
        msg = q[0]
        inq = (*rank.inq[:f], q[1:], *rank.inq[f + 1 :])
        rank = rank.with_inq(inq)
        kind = msg[0]
        if kind == "ADD":
            return self._rank_event(s, i, rank, RankEvent.ADD, (("wave", msg[2]),), req=msg[1])
        if kind == "ABORT":
            return self._rank_event(s, i, rank, RankEvent.ABORT, (), req=msg[1])
        if kind == "W":
            return self._rank_event(
                s, i, rank, RankEvent.START_DP_WAVE, (("exclude", msg[2]), ("wave", msg[1]))
            )
        call = msg[1]
        ev = CALL_EVENT[call]
        extra = self.call_extra(rank, ev, PauseMode(msg[3]) if len(msg) > 3 else None)
        untracked = msg[2] == RETRY
        if self.track_owed:
            rank = self._owe(i, rank, ev, extra, untracked)
        elif ev is RankEvent.PAUSE:
            tr = self.fire(i, rank.vars, ev, extra)[0] if rank.waiting else None
            rank = rank.with_status(rank.status, self._received_ghost(rank, extra, tr))
        elif ev is RankEvent.RESUME:
            rank = rank.with_status(rank.status, 0)
        return self._rank_event(s, i, rank, ev, extra, fail=fail, untracked=untracked, arg=msg[2])

    def call_extra(
        self, rank: Rank, ev: RankEvent, mode: PauseMode | None = None
    ) -> tuple[tuple[str, Any], ...]:
        """The event arguments of a controller call ``ev`` received by a rank whose slice is ``rank``: the
        spec's :func:`~weightsync.spec.controller.call_args` (the pause's ``mode``, ``clear_cache``,
        ``running``) and, where the variant's worker flags decide, the worker's state for a weight-transfer
        call (:data:`~weightsync.spec.collectives.CALL_FAIL_PHASE`'s calls, ``spec/rank_vars.py``).
        ``mode``: the pause's mode where its message names one (:data:`ANY_MODE`); else the model's."""
        if ev in CALL_ARGS:  # cached: mode and clear_cache are the configuration's; the queues vary
            key = (ev, len(rank.running), len(rank.waiting), mode)
            extra = self._call_args_cache.get(key)
            if extra is None:
                kwargs = {"mode": self.mode if mode is None else mode, "clear_cache": self.clear_cache}
                args = call_args(ev, kwargs, key[1], key[2])
                extra = self._call_args_cache[key] = tuple(sorted(args.items()))
            return extra
        if self.worker_args and ev in CALL_FAIL_PHASE:
            return (("worker", rank.worker.state.value), ("worker_initialized", rank.worker.initialized))
        return ()

    def _owe(
        self, i: int, rank: Rank, ev: RankEvent, extra: tuple[tuple[str, Any], ...], untracked: bool
    ) -> Rank:
        """(``untracked_replies``) The pause ghost and the owed replies when rank ``i`` receives a controller
        call: a refused call changes neither; an accepted pause starts the pause ghost (an untracked one
        keeps a pause already in effect), an accepted resume ends it; an untracked pause or resume whose
        reply is deferred (to the pause's completion, or the resume barrier's) is owed."""
        if ev not in (RankEvent.PAUSE, RankEvent.RESUME):
            return rank
        tr, after = self.fire(i, rank.vars, ev, extra)
        if tr is None or "refuse" in tr.effects:
            return rank
        if ev is RankEvent.PAUSE:
            # An untracked pause keeps the pause in effect, unless (ANY_MODE) it is in another mode and the
            # rank takes it up (its variables change: vLLM applies the new PauseState): then the rank
            # follows the new pause, and the properties judge by its mode.
            retagged = (
                self.any_mode
                and rank.pause_ghost != 0
                and self.ghost_mode(rank.pause_ghost) is not dict(extra)["mode"]
                and after != rank.vars
            )
            rank = rank._replace(
                pause_ghost=self._received_ghost(rank, extra, tr)
                if not untracked or rank.pause_ghost == 0 or retagged
                else rank.pause_ghost
            )
        else:
            rank = rank._replace(pause_ghost=0)
        if untracked and not _IMMEDIATE_REPLIES & set(tr.effects):
            rank = rank._replace(owed=rank.owed | (OWE_PAUSE if ev is RankEvent.PAUSE else OWE_RESUME))
        return rank

    def _received_ghost(self, rank: Rank, extra: tuple[tuple[str, Any], ...], tr: Transition | None) -> int:
        """The pause ghost of a rank whose slice is ``rank`` when it takes a pause with arguments ``extra``
        by row ``tr``: GHOST_QUEUED when the pause's mode must drain before it returns
        (:data:`~weightsync.spec.states.DRAINS_BEFORE_RETURN`), requests are queued on the rank, and the row
        does not admit them (vLLM 0.32 leaves them queued until the resume); else GHOST_RECEIVED."""
        mode = dict(extra)["mode"]
        tag = mode if self.any_mode else None  # under ANY_MODE the ghost names its pause's mode
        if not rank.waiting or mode not in DRAINS_BEFORE_RETURN:
            return ghost_with_mode(GHOST_RECEIVED, tag)
        if tr is None or "admit_waiting" in tr.effects:
            return ghost_with_mode(GHOST_RECEIVED, tag)
        return ghost_with_mode(GHOST_QUEUED, tag)

    def _step(self, s: GlobalState, i: int) -> GlobalState | None:
        rank = s.ranks[i]
        extra = (("has_work", self._has_work(rank)),)
        tr, after = self.fire(i, rank.vars, RankEvent.STEP, extra)
        if tr is not None and not tr.effects and after == rank.vars:
            return None  # an idle loop pass changes nothing
        t = self._rank_event(s, i, rank, RankEvent.STEP, extra)
        return None if t == s else t

    def _rank_event(
        self,
        s: GlobalState,
        i: int,
        rank: Rank,
        event: RankEvent,
        extra: tuple[tuple[str, Any], ...],
        req: int = -1,
        fail: bool = False,
        untracked: bool = False,
        arg: int = 0,
    ) -> GlobalState:
        """Fire ``event`` on rank ``i`` (whose slice is already ``rank``) and interpret the effects.

        ``fail``: the first failable worker operation among the effects raises (TRANSFER_FAILED fires
        instead of the rest); ``untracked``: the call's replies are not counted (a retried resume);
        ``arg``: the controller message's argument (the version a finish carries)."""
        before = rank.vars
        tr, after = self.fire(i, before, event, extra)
        rank = rank.with_vars(after)
        if tr is None or not tr.effects:
            return s.with_ranks((*s.ranks[:i], rank, *s.ranks[i + 1 :]))
        scratch = _ScratchState(s)
        scratch.ranks[i] = rank
        scratch.untracked = untracked
        for eff in tr.effects:
            self._effect(scratch, i, eff, before, req)
            if eff in FAILABLE_EFFECTS:
                if fail:
                    c = scratch.ctrl
                    scratch.ctrl = c._replace(failures_used=c.failures_used + 1)
                    self._nested(scratch, i, RankEvent.TRANSFER_FAILED, (("phase", FAIL_PHASE[eff]),))
                    break
                if eff in WORKER_OUTCOME:  # the worker's success is an event (the call's version: arg)
                    ev, args = worker_outcome(eff, {"weight_version": arg})
                    self._nested(scratch, i, ev, tuple(sorted(args.items())))
        return scratch.freeze()

    def _effect(self, scratch: _ScratchState, i: int, eff: str, before: RankVars, req: int) -> None:
        if eff in EFFECT_RANKS and not effect_acts_on(eff, i):
            return
        rank = scratch.ranks[i]
        if eff == "queue_request":
            scratch.ranks[i] = rank.with_queues(
                tuple(sorted((*rank.waiting, (req, self.tokens)))), rank.running
            )
        elif eff == "admit_waiting":  # patch 0005: the queued requests drain with the running ones
            if rank.waiting:
                kv = int(rank.vars.weight_version)
                running = tuple(sorted(rank.running + tuple((r, left, kv) for r, left in rank.waiting)))
                scratch.ranks[i] = rank.with_queues((), running)
        elif eff == "execute_step":
            ps = rank.vars.pause_state
            waiting, running = rank.waiting, rank.running
            if admits_waiting(ps) and waiting:
                kv = int(rank.vars.weight_version)  # the model's versions are round numbers
                running = tuple(sorted(running + tuple((r, left, kv) for r, left in waiting)))
                waiting = ()
            if advances_running(ps) and running:
                keep: list[tuple[int, int, int]] = []
                for r, left, kv in running:
                    if left > 1:
                        keep.append((r, left - 1, kv))
                    else:
                        scratch.done.append(r)
                running = tuple(keep)
            scratch.ranks[i] = rank.with_queues(waiting, running)
        elif eff in ENTER_EFFECT or eff in WORKER_EVENT_OF_EFFECT:
            if eff in ENTER_EFFECT:
                rank = rank._replace(blocked=ENTER_EFFECT[eff])
            if eff in WORKER_EVENT_OF_EFFECT:
                rank = rank._replace(worker=self.worker_fire(rank.worker, WORKER_EVENT_OF_EFFECT[eff]))
            scratch.ranks[i] = rank
        elif eff in ("reply", "reply_pause", "reply_resume"):
            pause_ghost = rank.pause_ghost
            if eff == "reply_pause":
                pause_ghost = ghost_replied(pause_ghost)
            if scratch.untracked:
                status = rank.status
            elif self.track_owed and eff != "reply":
                rank = self._owed_reply(scratch, rank, eff)
                status = rank.status
            else:
                status = REPLIED if rank.status == SENT else SPURIOUS
            scratch.ranks[i] = rank.with_status(status, pause_ghost)
        elif eff in ("reply_failure", "refuse"):
            if not scratch.untracked:
                scratch.ranks[i] = rank._replace(status=FAILED_REPLY if rank.status == SENT else SPURIOUS)
        elif eff == "abort_requests":
            scratch.aborted.extend([r for r, _ in rank.waiting] + [r[0] for r in rank.running])
            scratch.ranks[i] = rank._replace(waiting=(), running=())
        elif eff == "abort_request":
            waiting = tuple(q for q in rank.waiting if q[0] != req)
            running = tuple(q for q in rank.running if q[0] != req)
            if len(waiting) + len(running) < len(rank.waiting) + len(rank.running):
                scratch.aborted.append(req)
                scratch.ranks[i] = rank._replace(waiting=waiting, running=running)
        elif eff == "clear_cache":
            if rank.vars.clear_cache and rank.running:
                pre = tuple((r, left) for r, left, _ in rank.running)
                scratch.ranks[i] = rank._replace(waiting=tuple(sorted(rank.waiting + pre)), running=())
        elif eff == "emit_wave_complete":  # the wave that ended: the one before the new current_wave
            self._to_coord(scratch, i, ("wave_complete", rank.vars.current_wave - 1, i))
        elif eff == "emit_start_wave":
            self._to_coord(scratch, i, ("start_wave", rank.vars.current_wave, i))
        elif eff in RANK_EFFECT_EVENT:  # the front-end's gate; held requests are sent only after ungate
            scratch.front = self._front(scratch.front, RANK_EFFECT_EVENT[eff])[1]
        else:  # pragma: no cover - a table naming an effect the model does not know
            raise ValueError(f"unknown effect {eff!r}")

    def _owed_reply(self, scratch: _ScratchState, rank: Rank, eff: str) -> Rank:
        """(``untracked_replies``) A deferred pause or resume reply. A resume barrier belongs to the resume
        that started it: an owed untracked one (a rank takes one resume at a time), else the tracked one. A
        pause's completion resolves every pause the rank took: the owed untracked one, and the tracked one
        if the controller's pause reached the rank (not still queued)."""
        if eff == "reply_resume":
            if rank.owed & OWE_RESUME:
                return rank._replace(owed=rank.owed & ~OWE_RESUME)
            return rank._replace(status=REPLIED if rank.status == SENT else SPURIOUS)
        tracked = (
            rank.status == SENT
            and scratch.ctrl.phase == PAUSE
            and not any(m[0] == "U" and m[1] == "pause" and m[2] != RETRY for m in rank.inq[self.f_ctrl])
        )
        if rank.owed & OWE_PAUSE:
            return rank._replace(owed=rank.owed & ~OWE_PAUSE, status=REPLIED if tracked else rank.status)
        return rank._replace(status=REPLIED if rank.status == SENT else SPURIOUS)

    def _to_coord(self, scratch: _ScratchState, i: int, msg: tuple[Any, ...]) -> None:
        if self.ordered:
            scratch.coord_q = ((*scratch.coord_q[0], msg),)
        else:
            rank = scratch.ranks[i]
            scratch.ranks[i] = rank.with_outq((*rank.outq, msg))

    def complete_member(
        self, scratch: _ScratchState, i: int, kind: str, common: tuple[tuple[str, Any], ...], fail: bool
    ) -> None:
        """Rank ``i`` leaves collective ``kind`` (outcome ``common``, :func:`collective_args`; with ``fail``
        the phase that failed) and fires its completion event. It reads and changes rank ``i``'s slice and
        the state outside the ranks only (the compact engine's memo relies on it)."""
        rank = scratch.ranks[i]._replace(blocked="")
        scratch.ranks[i] = rank
        before = rank.vars
        ev = RankEvent.TRANSFER_FAILED if fail else DONE_EVENT[kind]
        extra = common if fail else done_args(kind, common, self._has_work(rank))
        tr, after = self.fire(i, before, ev, extra)
        scratch.ranks[i] = rank._replace(vars=after)
        if tr is not None:
            for eff in tr.effects:
                self._effect(scratch, i, eff, before, -1)

    def _complete(self, s: GlobalState, kind: str, fail: bool = False) -> GlobalState:
        """The joint completion of collective ``kind``: the outcome event fires on every member; with
        ``fail`` (a transfer collective only) it fails on every member (TRANSFER_FAILED) and the trainer."""
        ranks = s.ranks
        common = (("phase", FAIL_PHASE[kind]),) if fail else collective_args(ranks, kind)
        scratch = _ScratchState(s)
        for i in range(self.n):
            self.complete_member(scratch, i, kind, common, fail)
        if kind in TRANSFER_KINDS:
            status = (FAILED_REPLY if fail else REPLIED) if scratch.trainer.status == SENT else SPURIOUS
            scratch.trainer = _new_tuple(Trainer, ("", status))
        if fail:
            c = scratch.ctrl
            scratch.ctrl = c._replace(failures_used=c.failures_used + 1)
        return scratch.freeze()
