"""Promela that fires a rank's table and runs the effects of the row it takes, as
:mod:`weightsync.model.system.effects` interprets them (``_rank_event``, ``_nested``, ``_effect``), and the
pause ghost's encoding (with its mode under ANY_MODE)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from weightsync.model.spin.build import ABORTED, DONE, RUNNING_Q, WAITING, Build, UnsupportedModel, kind
from weightsync.model.spin.translate import Expr, Value, and_, not_, or_, text
from weightsync.model.system.state import (
    ENTER_EFFECT,
    FAIL_PHASE,
    FAILABLE_EFFECTS,
    FAILED_REPLY,
    GHOST_MODES,
    GHOST_QUEUED,
    GHOST_RECEIVED,
    GHOST_REPLY,
    GHOST_STRIDE,
    OWE_PAUSE,
    OWE_RESUME,
    PAUSE,
    REPLIED,
    RETRY,
    SENT,
    SPURIOUS,
)
from weightsync.spec.calls import WORKER_OUTCOME, worker_outcome
from weightsync.spec.front_end import RANK_EFFECT_EVENT
from weightsync.spec.rank import EFFECT_RANKS, effect_acts_on
from weightsync.spec.states import DRAINS_BEFORE_RETURN, PauseMode, RankEvent, RankState
from weightsync.spec.table import Transition
from weightsync.spec.worker import WORKER_EVENT_OF_EFFECT, WorkerState


class RankCode(Build):
    """A rank's table with the model's interpretation of its effects (see the module docstring)."""

    def fire_rank(
        self,
        i: int,
        ev: RankEvent,
        args: Mapping[str, Value],
        req: str = "-1",
        arg: str = "0",
        top: bool = True,
        untracked: str = "0",
        fail: bool = False,
    ) -> str:
        """``_rank_event`` (``top``) or ``_nested``: fire ``ev`` on rank ``i`` and run the row's effects.
        ``untracked``: a Promela condition, the call's replies are not counted; ``fail``: the first failable
        worker operation among the effects raises (TRANSFER_FAILED fires instead of the rest)."""
        t = self.rank_tables[i]

        def on_row(row: Transition) -> str:
            out = []
            for eff in row.effects:
                out.append(self.effect(i, eff, req, untracked))
                if top and eff in FAILABLE_EFFECTS and fail:
                    failed = {**self.base_args(i), "phase": FAIL_PHASE[eff]}
                    out.append("ct_failures_used++")
                    out.append(
                        self.fire_rank(i, RankEvent.TRANSFER_FAILED, failed, top=False, untracked=untracked)
                    )
                    break
                if top and eff in WORKER_OUTCOME:
                    oev, oargs = worker_outcome(eff, {"weight_version": Expr(arg)})
                    out.append(
                        self.fire_rank(i, oev, {**self.base_args(i), **oargs}, top=False, untracked=untracked)
                    )
            return "; ".join(o for o in out if o)

        return t.fire(ev, args, on_row, f"r_state[{i}] = {self.c(RankState.ERROR)}")

    def effect(self, i: int, eff: str, req: str, untracked: str = "0") -> str:
        """``_effect``: the model's interpretation of rank ``i``'s effect ``eff``."""
        c = self.c
        if eff in EFFECT_RANKS and not effect_acts_on(eff, i):
            return ""
        R = self.R
        if eff == "queue_request":
            return (
                f"rq_where[{req}] = {WAITING}; rq_rank[{req}] = {i}; rq_left[{req}] = {self.m.tokens}; "
                f"rq_kv[{req}] = 0; r_nw[{i}]++"
            )
        if eff == "admit_waiting":
            return "; ".join(
                f"if :: rq_where[{r}] == {WAITING} && rq_rank[{r}] == {i} -> {self._admit(i, r)} :: else -> skip fi"
                for r in range(R)
            )
        if eff == "execute_step":
            admits = self.states_fn.call("admits_waiting", Expr(f"r_pause_state[{i}]"))
            advances = self.states_fn.call("advances_running", Expr(f"r_pause_state[{i}]"))
            out = []
            if admits is not False:
                out += [
                    f"if :: {text(self.codes, admits)} && rq_where[{r}] == {WAITING} && rq_rank[{r}] == {i} -> "
                    f"{self._admit(i, r)} :: else -> skip fi"
                    for r in range(R)
                ]
            if advances is not False:
                out += [
                    f"if :: {text(self.codes, advances)} && rq_where[{r}] == {RUNNING_Q} && rq_rank[{r}] == {i} -> "
                    f"if :: rq_left[{r}] > 1 -> rq_left[{r}]-- :: else -> {self._retire(r, DONE)}; r_nr[{i}]-- fi "
                    ":: else -> skip fi"
                    for r in range(R)
                ]
            return "; ".join(out)
        if eff in ENTER_EFFECT or eff in WORKER_EVENT_OF_EFFECT:
            out = []
            if eff in ENTER_EFFECT:
                out.append(f"r_blocked[{i}] = {c(ENTER_EFFECT[eff])}")
            if eff in WORKER_EVENT_OF_EFFECT:
                w = self.worker_tables[i]
                out.append(
                    w.fire(
                        WORKER_EVENT_OF_EFFECT[eff],
                        {},
                        lambda row: "",
                        f"w_state[{i}] = {c(WorkerState.ERROR)}",
                    )
                )
            return "; ".join(out)
        if eff in ("reply", "reply_pause", "reply_resume"):
            out = [self.ghost_replied(i)] if eff == "reply_pause" else []
            counted = f"r_status[{i}] = (r_status[{i}] == {SENT} -> {REPLIED} : {SPURIOUS})"
            if self.m.track_owed and eff != "reply":
                counted = self.owed_reply(i, eff, counted)
            out.append(f"if :: {untracked} -> skip :: else -> {counted} fi")
            return "; ".join(out)
        if eff in ("reply_failure", "refuse"):
            return (
                f"if :: {untracked} -> skip :: else -> "
                f"r_status[{i}] = (r_status[{i}] == {SENT} -> {FAILED_REPLY} : {SPURIOUS}) fi"
            )
        if eff == "abort_requests":
            return "; ".join(
                [
                    f"if :: (rq_where[{r}] == {WAITING} || rq_where[{r}] == {RUNNING_Q}) && rq_rank[{r}] == {i} -> "
                    f"{self._retire(r, ABORTED)} :: else -> skip fi"
                    for r in range(R)
                ]
                + [f"r_nw[{i}] = 0; r_nr[{i}] = 0"]
            )
        if eff == "abort_request":
            return "; ".join(
                f"if :: {req} == {r} && rq_where[{r}] == {WAITING} && rq_rank[{r}] == {i} -> r_nw[{i}]--; "
                f"{self._retire(r, ABORTED)} "
                f":: {req} == {r} && rq_where[{r}] == {RUNNING_Q} && rq_rank[{r}] == {i} -> r_nr[{i}]--; "
                f"{self._retire(r, ABORTED)} :: else -> skip fi"
                for r in range(R)
            )
        if eff == "clear_cache":
            return "; ".join(
                f"if :: r_clear_cache[{i}] && rq_where[{r}] == {RUNNING_Q} && rq_rank[{r}] == {i} -> "
                f"rq_where[{r}] = {WAITING}; rq_kv[{r}] = 0; r_nr[{i}]--; r_nw[{i}]++ :: else -> skip fi"
                for r in range(R)
            )
        if eff == "emit_wave_complete":
            return self.to_coord(i, "wave_complete", f"(r_current_wave[{i}] - 1)")
        if eff == "emit_start_wave":
            return self.to_coord(i, "start_wave", f"r_current_wave[{i}]")
        if eff in RANK_EFFECT_EVENT:
            return self.front_table.fire(RANK_EFFECT_EVENT[eff], {}, lambda row: "", "assert(false)")
        raise UnsupportedModel(f"effect {eff!r} is not known to the Promela generator")

    @staticmethod
    def _admit(i: int, r: int) -> str:
        """Request ``r``, waiting on rank ``i``, starts running under the rank's weight version."""
        return f"rq_where[{r}] = {RUNNING_Q}; rq_kv[{r}] = r_weight_version[{i}]; r_nw[{i}]--; r_nr[{i}]++"

    @staticmethod
    def _retire(r: int, where: int) -> str:
        """Request ``r`` leaves its rank, finished (DONE) or aborted (ABORTED): only its place is kept."""
        return f"rq_where[{r}] = {where}; rq_rank[{r}] = 0; rq_left[{r}] = 0; rq_kv[{r}] = 0"

    def ghost_replied(self, i: int) -> str:
        """``ghost_replied``: the ghost after its pause's reply, its mode field kept."""
        branches = " ".join(
            f":: (r_ghost[{i}] % {GHOST_STRIDE}) == {b} -> r_ghost[{i}] = r_ghost[{i}] - {b} + {a}"
            for b, a in GHOST_REPLY.items()
        )
        return f"if {branches} :: else -> skip fi"

    def owed_reply(self, i: int, eff: str, counted: str) -> str:
        """``_owed_reply``: a deferred pause or resume reply (``untracked_replies`` variants)."""
        if eff == "reply_resume":
            return (
                f"if :: (r_owed[{i}] & {OWE_RESUME}) -> r_owed[{i}] = r_owed[{i}] & {~OWE_RESUME & 255} "
                f":: else -> {counted} fi"
            )
        b = self.qbase(i, self.m.f_ctrl)
        queued = " || ".join(
            f"(q_k[{b + p}] == {kind('U')} && q_a[{b + p}] == {self.c('pause')} && q_b[{b + p}] != {RETRY})"
            for p in range(self.cap)
        )
        tracked = f"(r_status[{i}] == {SENT} && ct_state == {PAUSE} && !({queued}))"
        return (
            f"if :: (r_owed[{i}] & {OWE_PAUSE}) -> r_owed[{i}] = r_owed[{i}] & {~OWE_PAUSE & 255}; "
            f"r_status[{i}] = ({tracked} -> {REPLIED} : r_status[{i}]) :: else -> {counted} fi"
        )

    def mode_index(self, mode: str) -> str:
        """The index in ``GHOST_MODES`` of the pause mode whose code is ``mode`` (a Promela expression)."""
        out = str(len(GHOST_MODES) - 1)
        for k, pm in reversed(list(enumerate(GHOST_MODES[:-1]))):
            out = f"(({mode} == {self.c(pm)}) -> {k} : {out})"
        return out

    def tagged(self, base: str, mode: str | None) -> str:
        """``ghost_with_mode(base, mode)``: ``mode`` a Promela mode code (None: a model with one mode)."""
        if mode is None:
            return base
        return f"({base} + {GHOST_STRIDE} * (1 + {self.mode_index(mode)}))"

    def ghost_mode_is(self, ghost: str, mode: PauseMode) -> str:
        """The pause a ghost records has ``mode`` (a model with one mode: whether it is that mode)."""
        if self.mode is not None:
            return "true" if mode is self.mode else "false"
        return f"(({ghost} / {GHOST_STRIDE}) - 1 == {GHOST_MODES.index(mode)})"

    def received_ghost(self, i: int, row_admits: Value, mode: str | None) -> str:
        """``_received_ghost`` as a Promela expression: the ghost of a pause of ``mode`` (a Promela mode
        code; None: the model's one mode) taken by a row that is none or admits waiting requests when
        ``row_admits``."""
        received = self.tagged(str(GHOST_RECEIVED), mode)
        queued = self.tagged(str(GHOST_QUEUED), mode)
        drains = " || ".join(f"{mode} == {self.c(d)}" for d in sorted(DRAINS_BEFORE_RETURN)) if mode else ""
        if mode is None and self.mode is not None and self.mode not in DRAINS_BEFORE_RETURN:
            return received
        waiting = self.any_at(i, WAITING)
        cond = f"({waiting} && !{text(self.codes, row_admits)}" + (f" && ({drains}))" if drains else ")")
        return f"({cond} -> {queued} : {received})"

    def row_condition(
        self, i: int, ev: RankEvent, args: Mapping[str, Value], pred: Callable[[Transition | None], Value]
    ) -> Value:
        """A Promela condition: ``pred`` holds of the row ``ev`` takes on rank ``i`` (``pred(None)``: no row
        is legal). ``pred`` gives a constant or a Promela condition (read before the row fires)."""
        t = self.rank_tables[i]
        out: Value = False
        none_legal: Value = True
        for s in t.states_for(ev):
            in_s = Expr(f"(r_state[{i}] == {self.c(s)})")
            for row, cond in t.selected(t.table[(s, ev)], args):
                out = or_(out, and_(and_(in_s, cond), pred(row)))
                none_legal = and_(none_legal, not_(and_(in_s, cond)))
        return or_(out, and_(none_legal, pred(None)))


__all__ = ["RankCode"]
