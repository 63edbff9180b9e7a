"""The environment of the ranks: the DP coordinator, the API front-end, the RL controller and the trainer,
and the channel moves between them."""

from __future__ import annotations

from typing import Any

from weightsync.model.system.effects import RankEffects
from weightsync.model.system.state import (
    CALL_EVENT,
    FAILED_REPLY,
    INIT,
    NOT_SENT,
    PHASE_CALL,
    REPLIED,
    RETRY,
    SENT,
    Ctrl,
    G,
    Label,
    _Work,
)
from weightsync.spec.controller import (
    TRAINER_COLLECTIVE,
    CtrlEvent,
    CtrlVars,
    Phase,
    call_version,
    controller_choices,
    controller_event,
    init_holds_requests,
)
from weightsync.spec.coordinator import MESSAGE_FIELDS, CoordEvent, CoordState, CoordVars, coordinator_fire
from weightsync.spec.front_end import FrontEvent
from weightsync.spec.states import RankEvent
from weightsync.spec.table import ALWAYS

#: The untracked calls of the controller table's effects (``Bounds.pause_during_update`` /
#: ``resume_during_update``).
_UNTRACKED = {"extra_pause": "pause", "extra_resume": "resume"}
#: The effects a RESUME row may have for :meth:`Environment._deliver_now` to receive the resume at once.
_REPLIES = frozenset({"reply", "reply_resume"})


class Environment(RankEffects):
    """The coordinator, front-end, controller and trainer transitions of :class:`Model`."""

    # -- coordinator (vLLM DPCoordinator, reference section 5)

    def _coord_recv(self, s: G, src: int, f: int) -> G:
        w = _Work(s)
        if src < 0:
            q = w.coord_q[f]
            msg = q[0]
            w.coord_q = (*w.coord_q[:f], q[1:], *w.coord_q[f + 1 :])
        else:
            rk = w.ranks[src]
            msg = rk.outq[0]
            w.ranks[src] = rk.with_outq(rk.outq[1:])
        key = (w.coord, msg)
        r = self._coord_cache.get(key)
        if r is None:
            wave, running = w.coord
            ev = CoordEvent(msg[0])
            args = dict(zip(MESSAGE_FIELDS[ev], msg[1:], strict=True))
            before = CoordVars(CoordState.RUNNING if running else CoordState.IDLE, wave)
            fired = coordinator_fire(self.coord_table, before, ev, args)
            r = ((fired.after.current_wave, fired.after.engines_running), fired.broadcasts)
            self._coord_cache[key] = r
        w.coord = r[0]
        for wave, exclude in r[1]:
            self._broadcast(w, wave, exclude)
        return w.freeze()

    def _broadcast(self, w: _Work, wave: int, exclude: int) -> None:
        f = self.f_wave
        for i in range(self.n):
            rk = w.ranks[i]
            q = rk.inq[f]
            w.ranks[i] = rk.with_inq((*rk.inq[:f], (*q, ("W", wave, exclude)), *rk.inq[f + 1 :]))

    # -- front-end

    def _send_request(self, s: G, i: int) -> G:
        """The client sends request ``next_request`` to rank ``i`` through the front-end's table (the
        caller offers this only when the row does not hold it)."""
        effects, front = self._front(s.front, FrontEvent.SEND_REQUEST, target=i)
        bw, nxt = s.front[0], s.front[2]
        w = _Work(s)
        if "send_add" in effects:
            f = self.f_add
            rk = w.ranks[i]
            w.ranks[i] = rk.with_inq((*rk.inq[:f], (*rk.inq[f], ("ADD", nxt, bw)), *rk.inq[f + 1 :]))
        if "send_first_req" in effects:
            w.coord_q = ((*w.coord_q[0], ("FIRST_REQ", i, bw)),)
        w.front = (front[0], front[1], nxt + 1, front[3], front[4])
        return w.freeze()

    def _holder(self, s: G, r: int) -> int:
        """The rank request ``r`` was sent to, while it is still there (queued ADD, waiting or running)."""
        for i, rk in enumerate(s.ranks):
            if any(q[0] == r for q in rk.waiting) or any(q[0] == r for q in rk.running):
                return i
            if any(m[0] == "ADD" and m[1] == r for q in rk.inq for m in q):
                return i
        return -1

    def _send_abort(self, s: G, i: int, r: int) -> G:
        """The client aborts request ``r``: the front-end sends ABORT(r) on rank ``i``'s input socket."""
        w = _Work(s)
        f = self.f_add
        rk = w.ranks[i]
        w.ranks[i] = rk._replace(inq=(*rk.inq[:f], (*rk.inq[f], ("ABORT", r)), *rk.inq[f + 1 :]))
        bw, brun, nxt, gated, cab = s.front
        w.front = (bw, brun, nxt, gated, tuple(sorted((*cab, r))))
        return w.freeze()

    def _init_holds_front(self, s: G) -> bool:
        """An orchestrator that initialises the transfer engine before serving holds requests until the
        init returned (:func:`weightsync.spec.controller.init_holds_requests`)."""
        c = s.ctrl
        return init_holds_requests(c.phase, c.cycles_started, lambda: self._all_replied(s, INIT))

    # -- controller and trainer

    def _all_replied(self, s: G, phase: int) -> bool:
        if not all(r.status in (REPLIED, FAILED_REPLY) for r in s.ranks):
            return False
        return phase not in TRAINER_COLLECTIVE or s.trainer[1] in (REPLIED, FAILED_REPLY)

    def _phase_failed(self, s: G) -> bool:
        """Some rank (or the trainer) answered the current phase's call with an error."""
        return any(r.status == FAILED_REPLY for r in s.ranks) or s.trainer[1] == FAILED_REPLY

    def _controller(self, s: G, out: list[tuple[Label, G]]) -> None:
        """The RL controller (reference s9): every row of the controller table
        (:func:`weightsync.spec.controller.controller_table`) whose guard holds for the outcome of the
        current phase's call, under the model's policy (``recover``: :mod:`weightsync.spec.controller`).
        Each row's effect is the move: a fan-out of its target phase's call (``fan_out``), the front-end
        answering it (``front_end_call``), or an untracked call (``retry_resume``, ``extra_pause``,
        ``extra_resume``; their replies are not counted)."""
        c = s.ctrl
        answered = self._all_replied(s, c.phase)
        ev = controller_event(c.phase, answered, answered and self._phase_failed(s))
        key = (c, ev, s.front[2] == 0)
        moves = self._ctrl_cache.get(key)
        if moves is None:
            moves = self._ctrl_moves(c, ev, s.front[2])
            self._ctrl_cache[key] = moves
        # The controller's fan-out is atomic under both channel semantics: only the controller writes the
        # controller->rank FIFOs, so sending to every rank at once and letting each rank receive at its
        # own time reaches the same interleavings as per-rank sends (the receipts stay independent).
        for eff, call, ctrl2 in moves:
            if eff == "fan_out":
                out.append((("fan", call, -1), self._fan_out(s, ctrl2, None, True)))
            elif eff == "front_end_call":
                out.append((("fe", call), self._front_end_call(s, ctrl2.phase, ctrl2)))
            elif eff == "retry_resume":
                out.append((("retry", call), self._retry(s, ctrl2)))
            elif eff in _UNTRACKED:
                out.append((("extra", _UNTRACKED[eff]), self._retry(s, ctrl2, _UNTRACKED[eff])))
            else:  # the round is over (policy one_round only): the controller stops, no message
                out.append((("end", eff), s._replace(ctrl=ctrl2)))

    def _ctrl_moves(self, c: Ctrl, ev: CtrlEvent, requests_sent: int) -> tuple[tuple[str, str, Ctrl], ...]:
        """The controller table's choices from ``c`` on ``ev``: ``(effect, call, controller after)``."""
        v = CtrlVars(
            Phase(c.phase),
            c.cycles_started,
            c.update_rounds,
            c.transfer_initialised,
            c.stray_resume_used,
            c.repeat_resume_used,
            c.recovering,
            c.extra_used,
        )
        out = []
        for tr, after in controller_choices(self.ctrl_table, v, ev, self._ctrl_args(requests_sent)):
            ctrl2 = Ctrl(
                int(after.phase),
                after.cycles_started,
                after.update_rounds,
                after.transfer_initialised,
                after.stray_resume_used,
                after.repeat_resume_used,
                c.failures_used,
                after.recovering,
                after.extra_used,
            )
            (eff,) = tr.effects
            out.append((eff, PHASE_CALL.get(after.phase, ""), ctrl2))
        return tuple(out)

    def _ctrl_args(self, requests_sent: int) -> dict[str, Any]:
        """The controller table's arguments: the model's policy and bounds."""
        return {
            "policy": self.ctrl_policy,
            "cycles": self.C,
            "requests_sent": requests_sent,
            "stray_resume": self.stray_resume,
            "repeat_resume": self.repeat_resume,
            "pause_during_update": self.pause_during_update,
            "resume_during_update": self.resume_during_update,
        }

    def _retry(self, s: G, ctrl: Ctrl, call: str = "resume") -> G:
        """Send ``call`` to every rank (behind whatever each rank's controller FIFO holds), untracked."""
        w = _Work(s)
        w.ctrl = ctrl
        w.untracked = True
        f = self.f_ctrl
        for i in range(self.n):
            if not self._deliver_now(w, i, call):
                rk = w.ranks[i]
                w.ranks[i] = rk._replace(
                    inq=(*rk.inq[:f], (*rk.inq[f], ("U", call, RETRY)), *rk.inq[f + 1 :])
                )
        w.untracked = False
        return w.freeze()

    def _deliver_now(self, w: _Work, i: int, call: str, queued: bool = False) -> bool:
        """Reduction: a resume sent to a rank that will take it as a no-op whenever it arrives is received
        at once. It applies when the rank is not blocked, nothing is queued before the call (its
        controller FIFO, or its only FIFO under ``ordered``), and the table has a single unguarded row for
        RESUME in the rank's state that changes no variable and only replies. Such a rank can leave its
        state only through a later controller call (queued behind this one), so the row that fires is the
        same at any delivery time; delivering later differs only in the controller's view of the reply
        (it may always wait longer) and reaches no other state. The lookup goes through :meth:`fire`, so
        a mutant of that row is still seen (mutation equivalence)."""
        if call != "resume":
            return False
        rk = w.ranks[i]
        if rk.blocked or (not queued and rk.inq[self.f_ctrl]):
            return False
        v = rk.vars
        rows = self.table.get((v.state, RankEvent.RESUME), ())
        if len(rows) != 1:
            return False
        row = rows[0]
        if row.guard != ALWAYS or row.target != v.state or not set(row.effects) <= _REPLIES:
            return False
        tr, after = self.fire(i, v, RankEvent.RESUME, ())
        if tr is None or after != v:
            return False
        w.ranks[i] = rk.with_status(rk.status, 0)
        for eff in tr.effects:
            self._effect(w, i, eff, v, -1)
        return True

    def _fan_out(
        self,
        s: G,
        ctrl: Ctrl,
        target: int | None,
        new_phase: bool,
        trainer: bool = False,
    ) -> G:
        """Send the call of ``ctrl``'s phase to rank ``target`` (None: every rank at once, ``ordered``
        channels), or let the trainer join the weight-transfer collective (``trainer=True``)."""
        w = _Work(s)
        phase = ctrl.phase
        call = PHASE_CALL[phase]
        f = self.f_ctrl
        if new_phase:
            for i in range(self.n):
                w.ranks[i] = w.ranks[i].with_status(NOT_SENT, w.ranks[i].pz)
            w.trainer = ("", NOT_SENT)
        w.ctrl = ctrl
        targets = [] if trainer else (list(range(self.n)) if target is None else [target])
        arg = call_version(phase, ctrl.update_rounds)  # finish carries the version
        for i in targets:
            rk = w.ranks[i].with_status(SENT, w.ranks[i].pz)
            w.ranks[i] = rk
            if not self._deliver_now(w, i, call):
                w.ranks[i] = rk.with_inq((*rk.inq[:f], (*rk.inq[f], ("U", call, arg)), *rk.inq[f + 1 :]))
        if phase in TRAINER_COLLECTIVE and (trainer or target is None):
            w.trainer = (TRAINER_COLLECTIVE[phase].value, SENT)
        return w.freeze()

    def _front_end_call(self, s: G, phase: int, ctrl: Ctrl) -> G:
        """front-end-pause: the API front-end applies pause/resume to every rank machine at once."""
        w = _Work(s)
        w.ctrl = ctrl
        w.trainer = ("", NOT_SENT)
        ev = CALL_EVENT[PHASE_CALL[phase]]
        for i in range(self.n):
            rk = w.ranks[i]._replace(status=SENT, pz=1 if ev is RankEvent.PAUSE else 0)
            w.ranks[i] = rk
            extra = self.call_extra(rk, ev)
            before = rk.vars
            tr, after = self.fire(i, before, ev, extra)
            w.ranks[i] = rk._replace(vars=after)
            if tr is not None:
                for eff in tr.effects:
                    self._effect(w, i, eff, before, -1)
        return w.freeze()
