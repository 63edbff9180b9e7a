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
    OWE_PAUSE,
    OWE_RESUME,
    PAUSE,
    REPLIED,
    RETRY,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
    G,
    Label,
    Rank,
    _Work,
)
from weightsync.spec.collectives import OUTCOME_KINDS, contribution, outcome_args, reduce_values
from weightsync.spec.front_end import RANK_EFFECT_EVENT
from weightsync.spec.rank import EFFECT_RANKS, RankVars, effect_acts_on
from weightsync.spec.states import (
    RankEvent,
    RankState,
    admits_waiting,
    advances_running,
    schedulable,
)
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

    def _has_work(self, rk: Rank) -> bool:
        return schedulable(rk.vars.pause_state, len(rk.waiting), len(rk.running))

    def _timeouts(self, s: G, out: list[tuple[Label, G]]) -> None:
        """A member of a weight-transfer collective that can never complete times out (weightsync: every
        collective has a timeout that becomes an error): some rank is ``failed`` outside it (it refuses the
        call), or the trainer timed out of it. Each member times out on its own."""
        ranks = s.ranks
        for k in TRANSFER_KINDS:
            in_k = [i for i, r in enumerate(ranks) if r.blocked == k]
            trainer_in = s.trainer[0] == k
            if not in_k and not trainer_in:
                continue
            stuck = any(r.vars.state is RankState.FAILED and r.blocked != k for r in ranks) or (
                not trainer_in and s.trainer[1] == FAILED_REPLY
            )
            if not stuck:
                continue
            for i in in_k:
                out.append((("timeout", i, k), self._timeout(s, i, k)))
            if trainer_in:
                out.append((("timeout", -1, k), s._replace(trainer=("", FAILED_REPLY))))

    def _timeout(self, s: G, i: int, kind: str) -> G:
        w = _Work(s)
        rk = w.ranks[i]._replace(blocked="")
        w.ranks[i] = rk
        self._nested(w, i, RankEvent.TRANSFER_FAILED, (("phase", FAIL_PHASE[kind]),))
        return w.freeze()

    def _nested(self, w: _Work, i: int, event: RankEvent, extra: tuple[tuple[str, Any], ...]) -> None:
        """Fire an outcome event on rank ``i`` inside a successor being built, and interpret its effects."""
        rk = w.ranks[i]
        before = rk.vars
        tr, after = self.fire(i, before, event, extra)
        w.ranks[i] = rk._replace(vars=after)
        if tr is not None:
            for eff in tr.effects:
                self._effect(w, i, eff, before, -1)

    def _recv(self, s: G, i: int, f: int, fail: bool = False) -> G:
        rk = s.ranks[i]
        q = rk.inq[f]
        msg = q[0]
        inq = (*rk.inq[:f], q[1:], *rk.inq[f + 1 :])
        rk = Rank(rk[0], rk[1], rk[2], rk[3], inq, rk[5], rk[6], rk[7], rk[8], rk[9])
        kind = msg[0]
        if kind == "ADD":
            return self._rank_event(s, i, rk, RankEvent.ADD, (("wave", msg[2]),), req=msg[1])
        if kind == "ABORT":
            return self._rank_event(s, i, rk, RankEvent.ABORT, (), req=msg[1])
        if kind == "W":
            return self._rank_event(
                s, i, rk, RankEvent.START_DP_WAVE, (("exclude", msg[2]), ("wave", msg[1]))
            )
        call = msg[1]
        ev = CALL_EVENT[call]
        extra = self.call_extra(rk, ev)
        untracked = msg[2] == RETRY
        if self.track_owed:
            rk = self._owe(i, rk, ev, extra, untracked)
        elif ev is RankEvent.PAUSE:
            rk = rk.with_status(rk.status, 1)
        elif ev is RankEvent.RESUME:
            rk = rk.with_status(rk.status, 0)
        return self._rank_event(s, i, rk, ev, extra, fail=fail, untracked=untracked, arg=msg[2])

    def call_extra(self, rk: Rank, ev: RankEvent) -> tuple[tuple[str, Any], ...]:
        """The event arguments of a controller call ``ev`` received by a rank whose slice is ``rk``."""
        if ev is RankEvent.PAUSE:
            return (("clear_cache", self.clear), ("mode", self.mode), ("running", len(rk.running)))
        if self.worker_args and ev is not RankEvent.RESUME:
            return (("worker", rk.worker.state.value), ("worker_initialized", rk.worker.initialized))
        return ()

    def _owe(
        self, i: int, rk: Rank, ev: RankEvent, extra: tuple[tuple[str, Any], ...], untracked: bool
    ) -> Rank:
        """(``untracked_replies``) The pause ghost and the owed replies when rank ``i`` receives a controller
        call: a refused call changes neither; an accepted pause starts the pause ghost (an untracked one
        keeps a pause already in effect), an accepted resume ends it; an untracked pause or resume whose
        reply is deferred (to the pause's completion, or the resume barrier's) is owed."""
        if ev not in (RankEvent.PAUSE, RankEvent.RESUME):
            return rk
        tr, _ = self.fire(i, rk.vars, ev, extra)
        if tr is None or "refuse" in tr.effects:
            return rk
        if ev is RankEvent.PAUSE:
            rk = rk._replace(pz=1 if not untracked or rk.pz == 0 else rk.pz)
        else:
            rk = rk._replace(pz=0)
        if untracked and not _IMMEDIATE_REPLIES & set(tr.effects):
            rk = rk._replace(owed=rk.owed | (OWE_PAUSE if ev is RankEvent.PAUSE else OWE_RESUME))
        return rk

    def _step(self, s: G, i: int) -> G | None:
        rk = s.ranks[i]
        extra = (("has_work", self._has_work(rk)),)
        tr, after = self.fire(i, rk.vars, RankEvent.STEP, extra)
        if tr is not None and not tr.effects and after == rk.vars:
            return None  # an idle loop pass changes nothing
        t = self._rank_event(s, i, rk, RankEvent.STEP, extra)
        return None if t == s else t

    def _rank_event(
        self,
        s: G,
        i: int,
        rk: Rank,
        event: RankEvent,
        extra: tuple[tuple[str, Any], ...],
        req: int = -1,
        fail: bool = False,
        untracked: bool = False,
        arg: int = 0,
    ) -> G:
        """Fire ``event`` on rank ``i`` (whose slice is already ``rk``) and interpret the effects.

        ``fail``: the first failable worker operation among the effects raises (TRANSFER_FAILED fires
        instead of the rest); ``untracked``: the call's replies are not counted (a retried resume);
        ``arg``: the controller message's argument (the version a finish carries)."""
        before = rk.vars
        tr, after = self.fire(i, before, event, extra)
        rk = Rank(after, rk[1], rk[2], rk[3], rk[4], rk[5], rk[6], rk[7], rk[8], rk[9])
        if tr is None or not tr.effects:
            ranks = (*s.ranks[:i], rk, *s.ranks[i + 1 :])
            return G(ranks, s[1], s[2], s[3], s[4], s[5], s[6], s[7])
        w = _Work(s)
        w.ranks[i] = rk
        w.untracked = untracked
        for eff in tr.effects:
            self._effect(w, i, eff, before, req)
            if eff in FAILABLE_EFFECTS:
                if fail:
                    c = w.ctrl
                    w.ctrl = c._replace(failures_used=c.failures_used + 1)
                    self._nested(w, i, RankEvent.TRANSFER_FAILED, (("phase", FAIL_PHASE[eff]),))
                    break
                if eff == "finish_weight_update":
                    self._nested(w, i, RankEvent.FINISH_DONE, (("monotonic", False), ("weight_version", arg)))
        return w.freeze()

    def _effect(self, w: _Work, i: int, eff: str, before: RankVars, req: int) -> None:
        if eff in EFFECT_RANKS and not effect_acts_on(eff, i):
            return
        rk = w.ranks[i]
        if eff == "queue_request":
            w.ranks[i] = rk.with_queues(tuple(sorted((*rk.waiting, (req, self.T)))), rk.running)
        elif eff == "execute_step":
            ps = rk.vars.pause_state
            waiting, running = rk.waiting, rk.running
            if admits_waiting(ps) and waiting:
                kv = int(rk.vars.weight_version)  # the model's versions are round numbers
                running = tuple(sorted(running + tuple((r, left, kv) for r, left in waiting)))
                waiting = ()
            if advances_running(ps) and running:
                keep: list[tuple[int, int, int]] = []
                for r, left, kv in running:
                    if left > 1:
                        keep.append((r, left - 1, kv))
                    else:
                        w.done.append(r)
                running = tuple(keep)
            w.ranks[i] = rk.with_queues(waiting, running)
        elif eff in ENTER_EFFECT or eff in WORKER_EVENT_OF_EFFECT:
            if eff in ENTER_EFFECT:
                rk = rk._replace(blocked=ENTER_EFFECT[eff])
            if eff in WORKER_EVENT_OF_EFFECT:
                rk = rk._replace(worker=self.worker_fire(rk.worker, WORKER_EVENT_OF_EFFECT[eff]))
            w.ranks[i] = rk
        elif eff in ("reply", "reply_pause", "reply_resume"):
            pz = 2 if eff == "reply_pause" and rk.pz == 1 else rk.pz
            if w.untracked:
                status = rk.status
            elif self.track_owed and eff != "reply":
                rk = self._owed_reply(w, rk, eff)
                status = rk.status
            else:
                status = REPLIED if rk.status == SENT else SPURIOUS
            w.ranks[i] = rk.with_status(status, pz)
        elif eff in ("reply_failure", "refuse"):
            if not w.untracked:
                w.ranks[i] = rk._replace(status=FAILED_REPLY if rk.status == SENT else SPURIOUS)
        elif eff == "abort_requests":
            w.aborted.extend([r for r, _ in rk.waiting] + [r[0] for r in rk.running])
            w.ranks[i] = rk._replace(waiting=(), running=())
        elif eff == "abort_request":
            waiting = tuple(q for q in rk.waiting if q[0] != req)
            running = tuple(q for q in rk.running if q[0] != req)
            if len(waiting) + len(running) < len(rk.waiting) + len(rk.running):
                w.aborted.append(req)
                w.ranks[i] = rk._replace(waiting=waiting, running=running)
        elif eff == "clear_cache":
            if rk.vars.clear_cache and rk.running:
                pre = tuple((r, left) for r, left, _ in rk.running)
                w.ranks[i] = rk._replace(waiting=tuple(sorted(rk.waiting + pre)), running=())
        elif eff == "emit_wave_complete":  # the wave that ended: the one before the new current_wave
            self._to_coord(w, i, ("wave_complete", rk.vars.current_wave - 1, i))
        elif eff == "emit_start_wave":
            self._to_coord(w, i, ("start_wave", rk.vars.current_wave, i))
        elif eff in RANK_EFFECT_EVENT:  # the front-end's gate; held requests are sent only after ungate
            w.front = self._front(w.front, RANK_EFFECT_EVENT[eff])[1]
        else:  # pragma: no cover - a table naming an effect the model does not know
            raise ValueError(f"unknown effect {eff!r}")

    def _owed_reply(self, w: _Work, rk: Rank, eff: str) -> Rank:
        """(``untracked_replies``) A deferred pause or resume reply. A resume barrier belongs to the resume
        that started it: an owed untracked one (a rank takes one resume at a time), else the tracked one. A
        pause's completion resolves every pause the rank took: the owed untracked one, and the tracked one
        if the controller's pause reached the rank (not still queued)."""
        if eff == "reply_resume":
            if rk.owed & OWE_RESUME:
                return rk._replace(owed=rk.owed & ~OWE_RESUME)
            return rk._replace(status=REPLIED if rk.status == SENT else SPURIOUS)
        tracked = (
            rk.status == SENT
            and w.ctrl.phase == PAUSE
            and not any(m[0] == "U" and m[1] == "pause" and m[2] != RETRY for m in rk.inq[self.f_ctrl])
        )
        if rk.owed & OWE_PAUSE:
            return rk._replace(owed=rk.owed & ~OWE_PAUSE, status=REPLIED if tracked else rk.status)
        return rk._replace(status=REPLIED if rk.status == SENT else SPURIOUS)

    def _to_coord(self, w: _Work, i: int, msg: tuple[Any, ...]) -> None:
        if self.ordered:
            w.coord_q = ((*w.coord_q[0], msg),)
        else:
            rk = w.ranks[i]
            w.ranks[i] = rk.with_outq((*rk.outq, msg))

    def _complete(self, s: G, kind: str, fail: bool = False) -> G:
        """The joint completion of collective ``kind``: the outcome event fires on every member; with
        ``fail`` (a transfer collective only) it fails on every member (TRANSFER_FAILED) and the trainer."""
        ranks = s.ranks
        ev = RankEvent.TRANSFER_FAILED if fail else DONE_EVENT[kind]
        common = (("phase", FAIL_PHASE[kind]),) if fail else collective_args(ranks, kind)
        w = _Work(s)
        for i in range(self.n):
            rk = w.ranks[i]._replace(blocked="")
            w.ranks[i] = rk
            before = rk.vars
            extra = (("has_work", self._has_work(rk)), *common)
            tr, after = self.fire(i, before, ev, extra)
            w.ranks[i] = rk._replace(vars=after)
            if tr is not None:
                for eff in tr.effects:
                    self._effect(w, i, eff, before, -1)
        if kind in TRANSFER_KINDS:
            w.trainer = ("", (FAILED_REPLY if fail else REPLIED) if w.trainer[1] == SENT else SPURIOUS)
        if fail:
            c = w.ctrl
            w.ctrl = c._replace(failures_used=c.failures_used + 1)
        return w.freeze()
