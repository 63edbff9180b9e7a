"""The Promela model's moves: one ``do`` option per move of :meth:`Model.successors` (same label, same
change), each a ``d_step`` whose first statement is the move's enabling condition."""

from __future__ import annotations

from weightsync.model.spin.build import (
    ABORTED,
    DONE,
    RUNNING_Q,
    WAITING,
    kind,
)
from weightsync.model.spin.ctrl import ControllerCode
from weightsync.model.spin.translate import Expr, Value, and_, not_, or_, text
from weightsync.model.system.effects import _IMMEDIATE_REPLIES
from weightsync.model.system.state import (
    CALL_EVENT,
    DONE_EVENT,
    DP_KINDS,
    FAIL_PHASE,
    FAILABLE_CALLS,
    FAILED_REPLY,
    GHOST_STRIDE,
    OWE_PAUSE,
    OWE_RESUME,
    REPLIED,
    RETRY,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
)
from weightsync.spec.calls import Phase
from weightsync.spec.collectives import (
    ABANDONED_ON_REFUSAL,
    COLLECTIVES,
    DONE_CARRIES_HAS_WORK,
    Reduction,
)
from weightsync.spec.coordinator import BROADCASTS, MESSAGE_FIELDS, PUBLISH, CoordEvent, CoordState
from weightsync.spec.front_end import FrontEvent, FrontState
from weightsync.spec.states import Collective, RankEvent, RankState


class Moves(ControllerCode):
    """Every move of :meth:`Model.successors` as a Promela ``do`` option."""

    def options(self) -> list[str]:
        out: list[str] = []
        for i in range(self.n):
            out += self.rank_moves(i)
        out += self.collective_moves()
        out += self.coord_moves()
        out += self.send_moves()
        out += self.refresh_moves()
        out += self.abort_moves()
        out += self.controller_moves()
        return out

    # ------------------------------------------------------------------ ranks

    def rank_moves(self, i: int) -> list[str]:
        c = self.c
        live = f"r_blocked[{i}] == {c('')} && r_state[{i}] != {c(RankState.ERROR)}"
        out = []
        failable = " || ".join(f"q_a[{{b}}] == {c(call)}" for call in sorted(FAILABLE_CALLS))
        in_transfer = " || ".join(
            f"r_state[{i}] == {c(s)}" for s in (RankState.VERIFIED, RankState.FAILED, RankState.UPDATING)
        )
        for f in range(self.nf):
            q = i * self.nf + f
            body = self.pop(i, f) + "; " + self.receive(i, f)
            out.append(self.option(f"{live} && q_len[{q}] > 0", body, f"recv {i} {f}"))
            if self.m.failures and f == self.m.f_ctrl and FAILABLE_CALLS:
                b = self.qbase(i, f)
                may = f"ct_failures_used < {self.m.failures} && q_k[{b}] == {kind('U')} && ({failable.format(b=b)})"
                if not self.m.worker_args:
                    may += f" && ({in_transfer})"
                body = self.pop(i, f) + "; " + self.receive(i, f, fail=True)
                out.append(self.option(f"{live} && q_len[{q}] > 0 && {may}", body, f"recv {i} {f} fail"))
        args = {**self.base_args(i), "has_work": self.has_work(i)}
        t = self.rank_tables[i]
        # a step is a move unless its row changes nothing (no effects, variables unchanged): Model._step
        idle: Value = False
        for s in t.states_for(RankEvent.STEP):
            in_s = Expr(f"(r_state[{i}] == {c(s)})")
            for row, cond in t.selected(t.table[(s, RankEvent.STEP)], args):
                if not row.effects:
                    idle = or_(idle, and_(and_(in_s, cond), t.noop(row, args)))
        guard = f"{live} && !{text(self.codes, idle)}" if idle is not False else live
        body = f"h_hw = {text(self.codes, args['has_work'])}; " + self.fire_rank(
            i, RankEvent.STEP, {**args, "has_work": Expr("h_hw")}
        )
        out.append(self.option(guard, body, f"step {i}"))
        return out

    def receive(self, i: int, f: int, fail: bool = False) -> str:
        """``_recv``: the message in ``m_k, m_a, m_b, m_c`` reaches rank ``i`` (``fail``: the failing variant
        of a weight-transfer call)."""
        m = self.m
        kinds = []
        if f == m.f_add and not fail:
            kinds += [
                (
                    "ADD",
                    self.fire_rank(i, RankEvent.ADD, {**self.base_args(i), "wave": Expr("m_b")}, req="m_a"),
                ),
                ("ABORT", self.fire_rank(i, RankEvent.ABORT, self.base_args(i), req="m_a")),
            ]
        if f == m.f_wave and not fail:
            wave_args = {**self.base_args(i), "exclude": Expr("m_b"), "wave": Expr("m_a")}
            kinds.append(("W", self.fire_rank(i, RankEvent.START_DP_WAVE, wave_args)))
        if f == m.f_ctrl:
            calls = " ".join(
                f":: m_a == {self.c(call)} -> {self.call(i, ev, fail)}"
                for call, ev in CALL_EVENT.items()
                if not fail or call in FAILABLE_CALLS
            )
            kinds.append(("U", f"if {calls} fi"))
        return "if " + " ".join(f":: m_k == {kind(k)} -> {code}" for k, code in kinds) + " fi"

    def call(self, i: int, ev: RankEvent, fail: bool = False) -> str:
        """A controller call ``ev`` (its version or RETRY in ``m_b``, its mode in ``m_c`` under ANY_MODE)
        received by rank ``i``: the pause ghost and the owed replies (``_owe`` / ``_received_ghost``), then
        ``_rank_event``."""
        mode = "m_c" if self.any_mode else None
        args = self.call_args(i, ev, Expr(mode) if mode else None)
        untracked = f"(m_b == {RETRY})"
        pre = ""
        if ev is RankEvent.PAUSE:
            admits = self.row_condition(
                i, ev, args, lambda row: row is None or "admit_waiting" in row.effects
            )
            ghost = self.received_ghost(i, admits, mode)
            if self.m.track_owed:
                pre = self.owe(i, ev, args, ghost, untracked)
            else:
                pre = f"r_ghost[{i}] = {ghost}; "
        elif ev is RankEvent.RESUME:
            pre = self.owe(i, ev, args, "0", untracked) if self.m.track_owed else f"r_ghost[{i}] = 0; "
        return pre + self.fire_rank(i, ev, args, arg="m_b", untracked=untracked, fail=fail)

    def owe(self, i: int, ev: RankEvent, args: dict[str, Value], ghost: str, untracked: str) -> str:
        """``_owe``: an accepted pause starts the pause ghost (an untracked one keeps a pause in effect, unless
        under ANY_MODE it is in another mode and the rank takes it up), an accepted resume ends it; an
        untracked pause or resume whose reply is deferred is owed."""
        refused = self.row_condition(i, ev, args, lambda row: row is None or "refuse" in row.effects)
        deferred = self.row_condition(
            i, ev, args, lambda row: row is not None and not _IMMEDIATE_REPLIES & set(row.effects)
        )
        bit = OWE_PAUSE if ev is RankEvent.PAUSE else OWE_RESUME
        if ev is RankEvent.PAUSE:
            keeps = f"!{untracked} || r_ghost[{i}] == 0"
            if self.any_mode:
                changes = self.row_changes(i, ev, args)
                other = f"!{self.mode_matches(f'r_ghost[{i}]', 'm_c')}"
                keeps += f" || ({other} && {text(self.codes, changes)})"
            take = f"if :: {keeps} -> r_ghost[{i}] = {ghost} :: else -> skip fi"
        else:
            take = f"r_ghost[{i}] = 0"
        owe = f"if :: {untracked} && {text(self.codes, deferred)} -> r_owed[{i}] = r_owed[{i}] | {bit} :: else -> skip fi"
        return f"if :: {text(self.codes, refused)} -> skip :: else -> {take}; {owe} fi; "

    def mode_matches(self, ghost: str, mode: str) -> str:
        """The ghost's pause mode is the mode whose code is ``mode`` (ANY_MODE)."""
        return f"((({ghost} / {GHOST_STRIDE}) - 1) == {self.mode_index(mode)})"

    def row_changes(self, i: int, ev: RankEvent, args: dict[str, Value]) -> Value:
        """The row ``ev`` takes on rank ``i`` changes its variables (no row: it moves to ``error``)."""
        t = self.rank_tables[i]
        return self.row_condition(i, ev, args, lambda row: True if row is None else not_(t.noop(row, args)))

    # ------------------------------------------------------------------ collectives

    def collective_moves(self) -> list[str]:
        out = []
        c = self.c
        for k in COLLECTIVES:
            kd = str(k.value)
            all_in = " && ".join(f"r_blocked[{i}] == {c(kd)}" for i in range(self.n))
            guard = all_in if kd in DP_KINDS else f"{all_in} && t_blocked == {c(kd)}"
            out.append(self.option(guard, self.complete(k), f"done {kd}"))
            if kd in TRANSFER_KINDS and self.m.failures:
                fguard = f"{guard} && ct_failures_used < {self.m.failures}"
                out.append(self.option(fguard, self.complete(k, fail=True), f"done {kd} fail"))
        out += self.timeouts()
        return out

    def complete(self, k: Collective, fail: bool = False) -> str:
        """``_complete``: the outcome from every member's contribution, then each member's completion;
        ``fail``: a transfer collective that fails on every member and the trainer."""
        spec = COLLECTIVES[k]
        kd = str(k.value)
        if fail:
            body = []
            for i in range(self.n):
                args = {**self.base_args(i), "phase": FAIL_PHASE[kd]}
                body.append(f"r_blocked[{i}] = {self.c('')}")
                body.append(self.fire_rank(i, RankEvent.TRANSFER_FAILED, args, top=False))
            body.append(
                f"t_status = (t_status == {SENT} -> {FAILED_REPLY} : {SPURIOUS}); t_blocked = {self.c('')}"
            )
            body.append("ct_failures_used++")
            return "; ".join(body)
        pre = []
        outcome: dict[str, Value] = {}
        for pos, name in enumerate(spec.contributes):
            acc = ("h_a", "h_b")[pos]
            vals = []
            for i in range(self.n):
                if name == "has_unfinished":
                    v = self.states_fn.call(
                        "unfinished_for_sync",
                        Expr(f"r_pause_state[{i}]"),
                        Expr(self.count(i, WAITING)),
                        Expr(self.count(i, RUNNING_Q)),
                    )
                    vals.append(text(self.codes, v))
                elif name == "pending_pause":
                    vals.append(f"r_pending_pause[{i}]")
                else:
                    vals.append(f"r_current_wave[{i}]")
            if spec.reduction is Reduction.SUM:
                pre.append(f"{acc} = " + " + ".join(f"({v})" for v in vals))
            else:
                pre.append(f"{acc} = {vals[0]}")
                pre += [f"if :: ({v}) > {acc} -> {acc} = ({v}) :: else -> skip fi" for v in vals[1:]]
            outcome[spec.outcome[pos]] = Expr(acc)
        body = list(pre)
        for i in range(self.n):
            args = {**self.base_args(i), **outcome}
            body.append(f"r_blocked[{i}] = {self.c('')}")
            if kd in DONE_CARRIES_HAS_WORK:
                body.append(f"h_hw = {text(self.codes, self.has_work(i))}")
                args["has_work"] = Expr("h_hw")
            body.append(self.fire_rank(i, DONE_EVENT[kd], args, top=False))
        if kd in TRANSFER_KINDS:
            body.append(
                f"t_status = (t_status == {SENT} -> {REPLIED} : {SPURIOUS}); t_blocked = {self.c('')}"
            )
        return "; ".join(body)

    def timeouts(self) -> list[str]:
        """``_timeouts``: members of a transfer collective that can never complete time out."""
        c = self.c
        out = []
        for kd in sorted(TRANSFER_KINDS):
            failed_out = " || ".join(
                f"(r_state[{i}] == {c(RankState.FAILED)} && r_blocked[{i}] != {c(kd)})" for i in range(self.n)
            )
            stuck = f"({failed_out}) || (t_blocked != {c(kd)} && t_status == {FAILED_REPLY})"
            if kd in ABANDONED_ON_REFUSAL:
                refused = " || ".join(
                    f"(r_status[{i}] == {FAILED_REPLY} && r_blocked[{i}] != {c(kd)})" for i in range(self.n)
                )
                stuck += f" || {refused}"
            for i in range(self.n):
                args = {**self.base_args(i), "phase": FAIL_PHASE[kd]}
                body = f"r_blocked[{i}] = {c('')}; " + self.fire_rank(
                    i, RankEvent.TRANSFER_FAILED, args, top=False
                )
                out.append(self.option(f"r_blocked[{i}] == {c(kd)} && ({stuck})", body, f"timeout {i} {kd}"))
            out.append(
                self.option(
                    f"t_blocked == {c(kd)} && ({stuck})",
                    f"t_blocked = {c('')}; t_status = {FAILED_REPLY}",
                    f"timeout -1 {kd}",
                )
            )
        return out

    # ------------------------------------------------------------------ coordinator and front-end

    def coord_moves(self) -> list[str]:
        out = [self.option("cq_len > 0", self.coord_take_own(), "coord -1 0")]
        if not self.m.ordered:
            for i in range(self.n):
                out.append(self.option(f"o_len[{i}] > 0", self.coord_take_rank(i), f"coord {i} 0"))
        return out

    def coord_take_own(self) -> str:
        pop = (
            "m_k = cq_k[0]; m_a = cq_a[0]; m_b = cq_b[0]; m_c = cq_c[0]; k = 0; "
            "do :: k + 1 < cq_len -> cq_k[k] = cq_k[k + 1]; cq_a[k] = cq_a[k + 1]; cq_b[k] = cq_b[k + 1]; "
            "cq_c[k] = cq_c[k + 1]; k++ :: else -> break od; cq_len--; cq_k[cq_len] = 0; cq_a[cq_len] = 0; "
            "cq_b[cq_len] = 0; cq_c[cq_len] = 0"
        )
        return pop + "; " + self.coord_fire()

    def coord_take_rank(self, i: int) -> str:
        b = i * self.cap
        pop = (
            f"m_k = o_k[{b}]; m_a = o_a[{b}]; m_b = o_b[{b}]; k = 0; "
            f"do :: k + 1 < o_len[{i}] -> o_k[{b} + k] = o_k[{b} + k + 1]; o_a[{b} + k] = o_a[{b} + k + 1]; "
            f"o_b[{b} + k] = o_b[{b} + k + 1]; k++ :: else -> break od; o_len[{i}]--; "
            f"o_k[{b} + o_len[{i}]] = 0; o_a[{b} + o_len[{i}]] = 0; o_b[{b} + o_len[{i}]] = 0"
        )
        return pop + "; " + self.coord_fire()

    def coord_fire(self) -> str:
        """``coord_take``: the coordinator's table on the message in ``m_k, m_a, m_b`` (FIRST_REQ:
        exclude, wave; a rank's: wave, sender), then its START_DP_WAVE broadcasts to every rank."""
        c = self.c
        branches = []
        for ev in CoordEvent:
            fields = MESSAGE_FIELDS[ev]
            if ev is CoordEvent.FIRST_REQ:
                args = {"exclude": Expr("m_a"), "wave": Expr("m_b")}
            else:
                args = {"wave": Expr("m_a"), "sender": Expr("m_b")}
            assert set(args) == set(fields)

            def on_row(row: object, args: dict[str, Value] = args) -> str:
                out = []
                for eff in row.effects:  # type: ignore[attr-defined]
                    if eff == PUBLISH:
                        out.append("co_pub = 1")
                    elif eff in BROADCASTS:
                        who = BROADCASTS[eff]
                        exclude = "-1" if who == "none" else text(self.codes, args[who])
                        out += [self.push(i, self.m.f_wave, "W", "co_wave", exclude) for i in range(self.n)]
                return "; ".join(out) or "skip"

            # the broadcast carries current_wave after the row; pushed after the updates (fire's order)
            code = self.coord_table.fire(ev, args, on_row, "assert(false)")
            branches.append(f":: m_k == {kind(ev.value)} -> {code}")
        running = c(CoordState.RUNNING)
        settle = (
            f"if :: co_pub && f_wave == co_wave && (f_state == {c(FrontState.RUNNING)}) == (co_state == {running}) "
            "-> co_pub = 0 :: else -> skip fi"
        )
        return "if " + " ".join(branches) + " fi; " + settle

    def send_moves(self) -> list[str]:
        """``send_moves``: the client's next request to rank ``i`` (unless the front-end holds it)."""
        if not self.R:
            return []
        t = self.front_table
        out = []
        holds = ""
        if self.m.init_transfer:
            answered = self.all_replied_expr(Phase.INIT)
            h = self.ctrl_fn.call(
                "init_holds_requests", Expr("ct_state"), Expr("ct_cycles_started"), answered
            )
            holds = f" && !{text(self.codes, h)}" if h is not False else ""
        for i in range(self.n):
            args = {"target": i}
            sends: Value = False
            for s in t.states_for(FrontEvent.SEND_REQUEST):
                for row, cond in t.selected(t.table[(s, FrontEvent.SEND_REQUEST)], args):
                    if "hold_request" not in row.effects:
                        sends = or_(sends, and_(Expr(f"(f_state == {self.c(s)})"), cond))
            guard = f"f_next < {self.R}{holds} && {text(self.codes, sends)}"

            def on_row(row: object, i: int = i) -> str:
                out = []
                for eff in row.effects:  # type: ignore[attr-defined]
                    if eff == "send_add":
                        out.append(self.push(i, self.m.f_add, "ADD", "f_next", "h_w"))
                    elif eff == "send_first_req":
                        out.append(
                            f"{self.full('cq_len')}; cq_k[cq_len] = {kind('FIRST_REQ')}; "
                            f"cq_a[cq_len] = {i}; cq_b[cq_len] = h_w; cq_c[cq_len] = 0; cq_len++"
                        )
                return "; ".join(out) or "skip"

            body = (
                "h_w = f_wave; "
                + t.fire(FrontEvent.SEND_REQUEST, args, on_row, "assert(false)")
                + "; f_next++"
            )
            out.append(self.option(guard, body, f"send {i}"))
        return out

    def refresh_moves(self) -> list[str]:
        c = self.c
        running = f"(co_state == {c(CoordState.RUNNING)})"
        differs = f"f_wave != co_wave || (f_state == {c(FrontState.RUNNING)}) != {running}"
        args = {"wave": Expr("co_wave"), "running": Expr(running)}
        body = self.front_table.fire(FrontEvent.STATS, args, lambda row: "", "assert(false)") + "; co_pub = 0"
        return [self.option(differs, body, "refresh")]

    def abort_moves(self) -> list[str]:
        """``abort_moves``: the client aborts request ``r`` still held by rank ``i``."""
        if not self.m.client_aborts:
            return []
        out = []
        for r in range(self.R):
            for i in range(self.n):
                held_q = " || ".join(
                    f"(q_k[{self.qbase(i, g) + p}] == {kind('ADD')} && q_a[{self.qbase(i, g) + p}] == {r})"
                    for g in range(self.nf)
                    for p in range(self.cap)
                )
                held = f"((rq_where[{r}] == {WAITING} || rq_where[{r}] == {RUNNING_Q}) && rq_rank[{r}] == {i}) || {held_q}"
                nab = " + ".join(f"((f_cab >> {x}) & 1)" for x in range(self.R))
                guard = (
                    f"({nab}) < {self.m.client_aborts} && {r} < f_next && !((f_cab >> {r}) & 1) && "
                    f"rq_where[{r}] != {DONE} && rq_where[{r}] != {ABORTED} && ({held})"
                )
                body = self.push(i, self.m.f_add, "ABORT", str(r)) + f"; f_cab = f_cab | {1 << r}"
                out.append(self.option(guard, body, f"abort {i} {r}"))
        return out

    # ------------------------------------------------------------------ controller


__all__ = ["Moves"]
