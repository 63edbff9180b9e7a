"""The environment of the ranks: the DP coordinator, the API front-end, the RL controller and the trainer,
and the channel moves between them."""

from __future__ import annotations

from typing import Any

from weightsync.model.system.effects import RankEffects
from weightsync.model.system.state import (
    CALL_EVENT,
    FAILED_REPLY,
    GHOST_RECEIVED,
    INIT,
    NOT_SENT,
    PHASE_CALL,
    REPLIED,
    RETRY,
    SENT,
    TRAINER_IDLE,
    Coordinator,
    Ctrl,
    FrontEnd,
    GlobalState,
    Label,
    Rank,
    Trainer,
    _new_tuple,
    _ScratchState,
    ghost_with_mode,
)
from weightsync.spec.calls import CALL_ARGS, TRAINER_COLLECTIVE, Phase, call_version
from weightsync.spec.controller import (
    CtrlEvent,
    CtrlVars,
    controller_choices,
    controller_event,
    init_holds_requests,
)
from weightsync.spec.coordinator import (
    MESSAGE_FIELDS,
    PUBLISH,
    CoordEvent,
    CoordState,
    CoordVars,
    coordinator_fire,
)
from weightsync.spec.front_end import FrontEvent
from weightsync.spec.states import PauseMode, RankEvent
from weightsync.spec.table import ALWAYS

#: The controller calls whose table arguments include the pause mode (``spec/calls.py`` CALL_ARGS): under
#: ANY_MODE the controller picks it per call.
MODE_CALLS = frozenset(c for c, ev in CALL_EVENT.items() if "mode" in CALL_ARGS.get(ev, ()))
#: The untracked calls of the controller table's effects (``Bounds.pause_during_update`` /
#: ``resume_during_update``).
_UNTRACKED = {"extra_pause": "pause", "extra_resume": "resume"}
#: The effects a RESUME row may have for :meth:`Environment._deliver_now` to receive the resume at once.
_REPLIES = frozenset({"reply", "reply_resume"})


class Environment(RankEffects):
    """The coordinator, front-end, controller and trainer transitions of :class:`Model`."""

    # -- coordinator (vLLM DPCoordinator, 0.32 v1/engine/coordinator.py:197-466)

    def _coord_recv(self, s: GlobalState, src: int, f: int) -> GlobalState:
        scratch = _ScratchState(s)
        for wave, exclude in self.coord_take(scratch, src, f):
            self._broadcast(scratch, wave, exclude)
        return scratch.freeze()

    def coord_take(self, scratch: _ScratchState, src: int, f: int) -> tuple[tuple[int, int], ...]:
        """The coordinator takes the head of FIFO ``f`` (``src`` < 0: its own, else rank ``src``'s) into
        ``scratch`` and fires its table; returns the START_DP_WAVE broadcasts ``(wave, exclude)`` that the
        caller must still deliver to every rank (:meth:`wave_to`). It reads and changes only the state
        outside the ranks and rank ``src``'s FIFO to the coordinator."""
        if src < 0:
            q = scratch.coord_q[f]
            msg = q[0]
            scratch.coord_q = (*scratch.coord_q[:f], q[1:], *scratch.coord_q[f + 1 :])
        else:
            rank = scratch.ranks[src]
            msg = rank.outq[0]
            scratch.ranks[src] = rank.with_outq(rank.outq[1:])
        key = (scratch.coord, msg)
        r = self._coord_cache.get(key)
        if r is None:
            coord = scratch.coord
            ev = CoordEvent(msg[0])
            args = dict(zip(MESSAGE_FIELDS[ev], msg[1:], strict=True))
            state = CoordState.RUNNING if coord.engines_running else CoordState.IDLE
            fired = coordinator_fire(self.coord_table, CoordVars(state, coord.current_wave), ev, args)
            publishing = coord.publishing or PUBLISH in fired.transition.effects
            after = Coordinator(fired.after.current_wave, fired.after.engines_running, publishing)
            r = (after, fired.broadcasts)
            self._coord_cache[key] = r
        after = r[0]
        front = scratch.front
        if after.publishing and (front.believed_wave, front.believed_running) == after[:2]:
            after = after._replace(publishing=False)  # nothing to tell the front-end
        scratch.coord = after
        return r[1]

    def _broadcast(self, scratch: _ScratchState, wave: int, exclude: int) -> None:
        for i in range(self.n):
            scratch.ranks[i] = self.wave_to(scratch.ranks[i], wave, exclude)

    def wave_to(self, rank: Rank, wave: int, exclude: int) -> Rank:
        """``rank`` with START_DP_WAVE(``wave``, ``exclude``) appended to its wave FIFO."""
        f = self.f_wave
        q = rank.inq[f]
        return rank.with_inq((*rank.inq[:f], (*q, ("W", wave, exclude)), *rank.inq[f + 1 :]))

    # -- front-end

    def _send_request(self, s: GlobalState, i: int) -> GlobalState:
        """The client sends request ``next_request`` to rank ``i`` through the front-end's table (the
        caller offers this only when the row does not hold it)."""
        effects, front = self._front(s.front, FrontEvent.SEND_REQUEST, target=i)
        wave, request = s.front.believed_wave, s.front.next_request
        scratch = _ScratchState(s)
        if "send_add" in effects:
            f = self.f_add
            rank = scratch.ranks[i]
            scratch.ranks[i] = rank.with_inq(
                (*rank.inq[:f], (*rank.inq[f], ("ADD", request, wave)), *rank.inq[f + 1 :])
            )
        if "send_first_req" in effects:
            scratch.coord_q = ((*scratch.coord_q[0], ("FIRST_REQ", i, wave)),)
        scratch.front = _new_tuple(
            FrontEnd,
            (front.believed_wave, front.believed_running, request + 1, front.gated, front.client_aborted),
        )
        return scratch.freeze()

    def _holder(self, s: GlobalState, r: int) -> int:
        """The rank request ``r`` was sent to, while it is still there (queued ADD, waiting or running)."""
        for i, rank in enumerate(s.ranks):
            if any(q[0] == r for q in rank.waiting) or any(q[0] == r for q in rank.running):
                return i
            if any(m[0] == "ADD" and m[1] == r for q in rank.inq for m in q):
                return i
        return -1

    def _send_abort(self, s: GlobalState, i: int, r: int) -> GlobalState:
        """The client aborts request ``r``: the front-end sends ABORT(r) on rank ``i``'s input socket."""
        scratch = _ScratchState(s)
        f = self.f_add
        rank = scratch.ranks[i]
        scratch.ranks[i] = rank._replace(
            inq=(*rank.inq[:f], (*rank.inq[f], ("ABORT", r)), *rank.inq[f + 1 :])
        )
        scratch.front = s.front._replace(client_aborted=tuple(sorted((*s.front.client_aborted, r))))
        return scratch.freeze()

    def _init_holds_front(self, s: GlobalState) -> bool:
        """An orchestrator that initialises the transfer engine before serving holds requests until the
        init returned (:func:`weightsync.spec.controller.init_holds_requests`)."""
        c = s.ctrl
        return init_holds_requests(c.phase, c.cycles_started, lambda: self._all_replied(s, INIT))

    # -- controller and trainer

    def _all_replied(self, s: GlobalState, phase: int) -> bool:
        if not all(r.status in (REPLIED, FAILED_REPLY) for r in s.ranks):
            return False
        return phase not in TRAINER_COLLECTIVE or s.trainer.status in (REPLIED, FAILED_REPLY)

    def _phase_failed(self, s: GlobalState) -> bool:
        """Some rank (or the trainer) answered the current phase's call with an error."""
        return any(r.status == FAILED_REPLY for r in s.ranks) or s.trainer.status == FAILED_REPLY

    def _controller(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """The RL controller (vLLM 0.32 AsyncLLM, v1/engine/async_llm.py:952-992, 1315-1363): every row of the controller table
        (:func:`weightsync.spec.controller.controller_table`) whose guard holds for the outcome of the
        current phase's call, under the model's policy (``recover``: :mod:`weightsync.spec.controller`).
        Each row's effect is the move: a fan-out of its target phase's call (``fan_out``), the front-end
        answering it (``front_end_call``), or an untracked call (``retry_resume``, ``extra_pause``,
        ``extra_resume``; their replies are not counted)."""
        moves = self.controller_moves(s)
        # The controller's fan-out is atomic under both channel semantics: only the controller writes the
        # controller->rank FIFOs, so sending to every rank at once and letting each rank receive at its
        # own time reaches the same interleavings as per-rank sends (the receipts stay independent).
        # Under ANY_MODE every pause is one move per mode; its label and its messages name the mode.
        any_mode = self.any_mode
        for eff, call, ctrl2 in moves:
            if eff == "fan_out":
                if any_mode and call in MODE_CALLS:
                    for m in self.pause_modes:
                        out.append((("fan", call, -1, m.value), self._fan_out(s, ctrl2, None, True, mode=m)))
                else:
                    out.append((("fan", call, -1), self._fan_out(s, ctrl2, None, True)))
            elif eff == "front_end_call":
                if any_mode and call in MODE_CALLS:
                    for m in self.pause_modes:
                        out.append((("fe", call, m.value), self._front_end_call(s, ctrl2.phase, ctrl2, m)))
                else:
                    out.append((("fe", call), self._front_end_call(s, ctrl2.phase, ctrl2)))
            elif eff == "retry_resume":
                out.append((("retry", call), self._retry(s, ctrl2)))
            elif eff in _UNTRACKED:
                extra = _UNTRACKED[eff]
                if any_mode and extra in MODE_CALLS:
                    for m in self.pause_modes:
                        out.append((("extra", extra, m.value), self._retry(s, ctrl2, extra, m)))
                else:
                    out.append((("extra", extra), self._retry(s, ctrl2, extra)))
            else:  # the round is over (policy one_round only): the controller stops, no message
                out.append((("end", eff), s._replace(ctrl=ctrl2)))

    def controller_moves(self, s: GlobalState) -> tuple[tuple[str, str, Ctrl], ...]:
        """The controller table's choices in ``s`` (see :meth:`_ctrl_moves`). They read the state outside
        the ranks and every rank's ``status`` only (the compact engine's memo relies on it)."""
        c = s.ctrl
        answered = self._all_replied(s, c.phase)
        ev = controller_event(c.phase, answered, answered and self._phase_failed(s))
        requests_sent = s.front.next_request
        key = (c, ev, requests_sent == 0)
        moves = self._ctrl_cache.get(key)
        if moves is None:
            moves = self._ctrl_moves(c, ev, requests_sent)
            self._ctrl_cache[key] = moves
        return moves

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
            "cycles": self.cycles,
            "requests_sent": requests_sent,
            "stray_resume": self.stray_resume,
            "repeat_resume": self.repeat_resume,
            "pause_during_update": self.pause_during_update,
            "repeat_pause": self.repeat_pause,
            "init_while_serving": self.init_while_serving,
            "resume_during_update": self.resume_during_update,
        }

    def _retry(
        self, s: GlobalState, ctrl: Ctrl, call: str = "resume", mode: PauseMode | None = None
    ) -> GlobalState:
        """Send ``call`` to every rank (behind whatever each rank's controller FIFO holds), untracked; a
        pause under :data:`ANY_MODE` names its ``mode``."""
        msg = ("U", call, RETRY) if mode is None else ("U", call, RETRY, mode.value)
        scratch = _ScratchState(s)
        scratch.ctrl = ctrl
        scratch.untracked = True
        f = self.f_ctrl
        for i in range(self.n):
            if not self._deliver_now(scratch, i, call):
                rank = scratch.ranks[i]
                scratch.ranks[i] = rank._replace(inq=(*rank.inq[:f], (*rank.inq[f], msg), *rank.inq[f + 1 :]))
        scratch.untracked = False
        return scratch.freeze()

    def _deliver_now(self, scratch: _ScratchState, i: int, call: str, queued: bool = False) -> bool:
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
        rank = scratch.ranks[i]
        if rank.blocked or (not queued and rank.inq[self.f_ctrl]):
            return False
        v = rank.vars
        rows = self.table.get((v.state, RankEvent.RESUME), ())
        if len(rows) != 1:
            return False
        row = rows[0]
        if row.guard != ALWAYS or row.target != v.state or not set(row.effects) <= _REPLIES:
            return False
        tr, after = self.fire(i, v, RankEvent.RESUME, ())
        if tr is None or after != v:
            return False
        scratch.ranks[i] = rank.with_status(rank.status, 0)
        for eff in tr.effects:
            self._effect(scratch, i, eff, v, -1)
        return True

    def _fan_out(
        self,
        s: GlobalState,
        ctrl: Ctrl,
        target: int | None,
        new_phase: bool,
        trainer: bool = False,
        mode: PauseMode | None = None,
    ) -> GlobalState:
        """Send the call of ``ctrl``'s phase to rank ``target`` (None: every rank at once, ``ordered``
        channels), or let the trainer join the weight-transfer collective (``trainer=True``); a pause under
        :data:`ANY_MODE` names its ``mode``."""
        scratch = _ScratchState(s)
        phase = ctrl.phase
        call = PHASE_CALL[phase]
        f = self.f_ctrl
        if new_phase:
            for i in range(self.n):
                scratch.ranks[i] = scratch.ranks[i].with_status(NOT_SENT, scratch.ranks[i].pause_ghost)
            scratch.trainer = TRAINER_IDLE
        scratch.ctrl = ctrl
        targets = [] if trainer else (list(range(self.n)) if target is None else [target])
        arg = call_version(phase, ctrl.update_rounds)  # finish carries the version
        msg = ("U", call, arg) if mode is None else ("U", call, arg, mode.value)
        for i in targets:
            rank = scratch.ranks[i].with_status(SENT, scratch.ranks[i].pause_ghost)
            scratch.ranks[i] = rank
            if not self._deliver_now(scratch, i, call):
                scratch.ranks[i] = rank.with_inq((*rank.inq[:f], (*rank.inq[f], msg), *rank.inq[f + 1 :]))
        if phase in TRAINER_COLLECTIVE and (trainer or target is None):
            scratch.trainer = _new_tuple(Trainer, (TRAINER_COLLECTIVE[phase].value, SENT))
        return scratch.freeze()

    def _front_end_call(
        self, s: GlobalState, phase: int, ctrl: Ctrl, mode: PauseMode | None = None
    ) -> GlobalState:
        """front-end-pause: the API front-end applies pause/resume to every rank machine at once (a pause
        under :data:`ANY_MODE` in ``mode``)."""
        scratch = _ScratchState(s)
        scratch.ctrl = ctrl
        scratch.trainer = TRAINER_IDLE
        ev = CALL_EVENT[PHASE_CALL[phase]]
        for i in range(self.n):
            ghost = ghost_with_mode(GHOST_RECEIVED, mode) if ev is RankEvent.PAUSE else 0
            rank = scratch.ranks[i]._replace(status=SENT, pause_ghost=ghost)
            scratch.ranks[i] = rank
            self._nested(scratch, i, ev, self.call_extra(rank, ev, mode))
        return scratch.freeze()
