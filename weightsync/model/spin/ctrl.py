"""Promela for the RL controller's moves (every enabled row of its table: fan-outs, front-end calls,
untracked calls), the resumes a rank takes at once, and the settling of stray and repeated resumes, as
:mod:`weightsync.model.system.environment` and :meth:`Model._settle` make them."""

from __future__ import annotations

from weightsync.model.spin.build import kind
from weightsync.model.spin.quiet import QuietWaves
from weightsync.model.spin.translate import Expr, Value, and_, text
from weightsync.model.system.environment import _REPLIES, _UNTRACKED, MODE_CALLS
from weightsync.model.system.state import (
    CALL_EVENT,
    FAILED_REPLY,
    GHOST_RECEIVED,
    NOT_SENT,
    PHASE_CALL,
    REPLIED,
    RETRY,
    SENT,
)
from weightsync.spec.calls import TRAINER_COLLECTIVE, Phase, call_version
from weightsync.spec.states import PauseMode, RankEvent
from weightsync.spec.table import ALWAYS


class ControllerCode(QuietWaves):
    """The controller's moves and the resumes delivered at once (see the module docstring)."""

    def option(self, guard: str, body: str, label: str) -> str:
        """One move: ``guard`` enables it; ``body`` changes the state; ``label`` is printed for replay."""
        for after in (self.settle(), self.quiet()):  # Model.reduced: the settle, then the silent waves
            if after:
                body = f"{body}; {after}"
        pre = self.snapshot(label) + "; " if self.checks else ""
        if self.m.silent_waves:
            pre += self.premise_snapshot() + "; "
            body += "; " + self.premise_check()
        post = f"; {self.check_edge(label)}" if self.checks else f"; {self.check_state()}"
        if not self.checks:
            guard = f"!inv_bad && ({guard})"
        return f'  :: d_step {{ ({guard}) -> {pre}{body}; printf("MOVE {label}\\n"){post}; {self.reset()} }}'

    def all_replied_expr(self, phase: Phase | None) -> Value:
        """``_all_replied`` for ``phase`` (None: the controller's current phase)."""
        ranks = " && ".join(
            f"(r_status[{i}] == {REPLIED} || r_status[{i}] == {FAILED_REPLY})" for i in range(self.n)
        )
        trainer = f"(t_status == {REPLIED} || t_status == {FAILED_REPLY})"
        if phase is None:
            joins = " || ".join(f"ct_state == {int(p)}" for p in TRAINER_COLLECTIVE)
            return Expr(f"({ranks} && (!({joins}) || {trainer}))")
        return Expr(f"({ranks} && {trainer})" if phase in TRAINER_COLLECTIVE else f"({ranks})")

    def phase_failed_expr(self) -> str:
        ranks = " || ".join(f"r_status[{i}] == {FAILED_REPLY}" for i in range(self.n))
        return f"({ranks} || t_status == {FAILED_REPLY})"

    def controller_moves(self) -> list[str]:
        """``_controller``: every enabled row of the controller table is a move (``enabled_transitions``)."""
        m = self.m
        answered = self.all_replied_expr(None)
        ev_expr = self.ctrl_fn.call(
            "controller_event", Expr("ct_state"), answered, and_(answered, Expr(self.phase_failed_expr()))
        )
        args = {**m._ctrl_args(0), "requests_sent": Expr("f_next")}
        out = []
        t = self.ctrl_table
        for (phase, ev), rows in t.table.items():
            is_ev = Expr(f"({text(self.codes, ev_expr)} == {self.c(ev)})")
            for row in rows:
                g = t.guard(row, args)
                if g is False:
                    continue
                (eff,) = row.effects
                target = Phase(row.target) if row.target is not None else Phase(phase)
                guard = and_(and_(Expr(f"(ct_state == {int(phase)})"), is_ev), g)
                update = t.updates(row, args)
                label_call = PHASE_CALL.get(target, "")
                modes: list[PauseMode | None] = [None]
                if self.any_mode and (label_call in MODE_CALLS or _UNTRACKED.get(eff) in MODE_CALLS):
                    modes = list(m.pause_modes)
                for mode in modes:
                    tag = f" {mode.value}" if mode is not None else ""
                    if eff == "fan_out":
                        body = update + "; " + self.fan_out(target, mode)
                        label = f"fan {label_call} -1{tag}"
                    elif eff == "front_end_call":
                        body = update + "; " + self.front_end_call(target, mode)
                        label = f"fe {label_call}{tag}"
                    elif eff == "retry_resume":
                        body = update + "; " + self.retry(label_call, None)
                        label = f"retry {label_call}"
                    elif eff in _UNTRACKED:
                        body = update + "; " + self.retry(_UNTRACKED[eff], mode)
                        label = f"extra {_UNTRACKED[eff]}{tag}"
                    else:  # the controller stops (Environment._controller's "end" move)
                        body = update
                        label = f"end {eff}"
                    out.append(self.option(text(self.codes, guard), body, label))
        return out

    def fan_out(self, phase: Phase, mode: PauseMode | None = None) -> str:
        """``_fan_out`` of ``phase``'s call to every rank (the controller's variables already updated); a
        pause under ANY_MODE names its ``mode``."""
        call = PHASE_CALL[phase]
        out = [f"r_status[{i}] = {NOT_SENT}" for i in range(self.n)]
        out.append(f"t_blocked = {self.c('')}; t_status = {NOT_SENT}")
        version = "(ct_update_rounds + 1)" if call_version(phase, 0) else "0"
        cc = str(self.c(mode)) if mode is not None else "0"
        for i in range(self.n):
            out.append(f"r_status[{i}] = {SENT}")
            push = self.push(i, self.m.f_ctrl, "U", str(self.c(call)), version, cc)
            deliver = self.deliver_now(i, call)
            out.append(f"if :: {deliver[0]} -> {deliver[1]} :: else -> {push} fi" if deliver else push)
        if phase in TRAINER_COLLECTIVE:
            out.append(f"t_blocked = {self.c(str(TRAINER_COLLECTIVE[phase].value))}; t_status = {SENT}")
        return "; ".join(out)

    def retry(self, call: str, mode: PauseMode | None) -> str:
        """``_retry``: ``call`` to every rank again, untracked (behind whatever each controller FIFO holds)."""
        out = []
        cc = str(self.c(mode)) if mode is not None else "0"
        for i in range(self.n):
            push = self.push(i, self.m.f_ctrl, "U", str(self.c(call)), str(RETRY), cc)
            deliver = self.deliver_now(i, call, untracked="1")
            out.append(f"if :: {deliver[0]} -> {deliver[1]} :: else -> {push} fi" if deliver else push)
        return "; ".join(out)

    def settle(self) -> str:
        """``Model._settle`` (stray or repeated resumes): a resume at the head of a rank's controller FIFO
        that the rank takes as a no-op is received at once, as often as one is there."""
        if not (self.m.stray_resume or self.m.repeat_resume):
            return ""
        out = []
        for i in range(self.n):
            b = self.qbase(i, self.m.f_ctrl)
            head = f"q_len[{i * self.nf + self.m.f_ctrl}] > 0 && q_k[{b}] == {kind('U')} && q_a[{b}] == {self.c('resume')}"
            deliver = self.deliver_now(i, "resume", untracked="u_retry", queued=True)
            if deliver is None:
                continue
            cond, code = deliver
            out.append(
                f"do :: {head} && {cond} -> u_retry = (q_b[{b}] == {RETRY}); {self.pop(i, self.m.f_ctrl)}; {code} "
                f":: else -> break od"
            )
        return "; ".join(out)

    def deliver_now(
        self, i: int, call: str, untracked: str = "0", queued: bool = False
    ) -> tuple[str, str] | None:
        """``_deliver_now``: (condition, code) for a resume that rank ``i`` takes at once as a no-op (its
        controller FIFO empty unless ``queued``); None where no state of the table allows it."""
        if call != "resume":
            return None
        c = self.c
        states = []
        for (s, ev), rows in self.m.table.items():
            if ev is not RankEvent.RESUME or len(rows) != 1:
                continue
            row = rows[0]
            if row.guard != ALWAYS or row.target != s or not set(row.effects) <= _REPLIES or row.updates:
                continue
            states.append(s)
        if not states:
            return None
        in_states = " || ".join(f"r_state[{i}] == {c(s)}" for s in states)
        empty = "" if queued else f" && q_len[{i * self.nf + self.m.f_ctrl}] == 0"
        cond = f"r_blocked[{i}] == {c('')}{empty} && ({in_states})"
        code = f"r_ghost[{i}] = 0; " + self.fire_rank(
            i, RankEvent.RESUME, self.base_args(i), top=False, untracked=untracked
        )
        return cond, code

    def front_end_call(self, phase: Phase, mode: PauseMode | None = None) -> str:
        """``_front_end_call``: the front-end applies pause or resume to every rank machine (a pause under
        ANY_MODE in ``mode``)."""
        ev = CALL_EVENT[PHASE_CALL[phase]]
        out = [f"t_blocked = {self.c('')}; t_status = {NOT_SENT}"]
        for i in range(self.n):
            tag = str(self.c(mode)) if mode is not None else None
            ghost = self.tagged(str(GHOST_RECEIVED), tag) if ev is RankEvent.PAUSE else "0"
            out.append(f"r_status[{i}] = {SENT}; r_ghost[{i}] = {ghost}")
            out.append(self.fire_rank(i, ev, self.call_args(i, ev, mode), top=False))
        return "; ".join(out)


__all__ = ["ControllerCode"]
