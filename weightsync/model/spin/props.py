"""The Promela model's checks: the state invariants, edge checks and terminal check of
:class:`~weightsync.model.system.properties.Properties`, each failing the run with ``assert`` after printing
``VIOLATION <property>``."""

from __future__ import annotations

from weightsync.model.spin.build import ABORTED, DONE, RUNNING_Q, WAITING, kind
from weightsync.model.spin.ranks import RankCode
from weightsync.model.system.state import (
    DP_KINDS,
    FAILED_REPLY,
    FINISH,
    GHOST_QUEUED_REPLIED,
    GHOST_RECEIVED,
    GHOST_STRIDE,
    GHOSTS_REPLIED,
    IDLE,
    RESUME,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
)
from weightsync.spec.states import DRAINS_BEFORE_RETURN, PauseMode, PauseState, RankState
from weightsync.spec.worker import WorkerState


def _any(terms: list[str]) -> str:
    return "(" + " || ".join(terms) + ")" if terms else "false"


def _all(terms: list[str]) -> str:
    return "(" + " && ".join(terms) + ")" if terms else "true"


def fail(prop: str, cond: str) -> str:
    """``cond`` violates ``prop``: print its name and fail the run."""
    return f'if :: {cond} -> printf("VIOLATION {prop}\\n"); assert(false) :: else -> skip fi'


class Props(RankCode):
    """The checks (see the module docstring)."""

    # ------------------------------------------------------------------ state invariants

    def check_state(self) -> str:
        """:meth:`Properties.invariant`: with the checks on, a violation fails the run; with them off, the
        state is marked (``inv_bad``) and not expanded, as the explorer leaves such states unexpanded."""
        conds = self.invariant_conditions()
        if self.checks:
            return "; ".join(fail(p, cond) for p, cond in conds)
        return "inv_bad = (" + " || ".join(f"({cond} -> 1 : 0)" for _, cond in conds) + ")"

    def invariant_conditions(self) -> list[tuple[str, str]]:
        """Each state invariant with the Promela condition that ``s`` violates it."""
        c, n = self.c, self.n
        out: list[tuple[str, str]] = []
        none = c("")
        blocked = [f"r_blocked[{i}]" for i in range(n)]
        two_kinds = _any(
            [
                f"({a} != {none} && {b} != {none} && {a} != {b})"
                for x, a in enumerate(blocked)
                for b in blocked[x + 1 :]
            ]
        )
        mismatch = _any([f"r_collective[{i}] != r_blocked[{i}]" for i in range(n)])
        out.append(("collectives_match", f"({two_kinds} || {mismatch})"))
        bracket = _any(
            [
                f"(r_state[{i}] == {c(RankState.ERROR)} || r_status[{i}] == {SPURIOUS} || "
                f"w_state[{i}] == {c(WorkerState.ERROR)})"
                for i in range(n)
            ]
            + [f"t_status == {SPURIOUS}"]
        )
        out.append(("phase_bracketing", bracket))
        out.append(("request_conservation", f"!{self.conserved()}"))
        out.append(("version_agreement", self.version_disagrees()))
        out.append(("coordinator_belief", f"!{self.coordinator_belief()}"))
        out.append(("front_end_belief", f"!{self.front_end_belief()}"))
        if self.any_mode or self.mode is PauseMode.ABORT:
            runs = _any(
                [
                    f"(({' || '.join(f'(r_ghost[{i}] % {GHOST_STRIDE}) == {g}' for g in GHOSTS_REPLIED)}) && "
                    f"{self.any_at(i, RUNNING_Q)} && {self.ghost_mode_is(f'r_ghost[{i}]', PauseMode.ABORT)})"
                    for i in range(n)
                ]
            )
            out.append(("mode_semantics", runs))
        return out

    def conserved(self) -> str:
        """``_conserved``: every request sent is in exactly one place, and (keep, wait) only the client
        aborts one."""
        terms = []
        for r in range(self.R):
            placed = f"((rq_where[{r}] != 0) -> 1 : 0)"
            in_fifos = " + ".join(
                f"((q_k[{p}] == {kind('ADD')} && q_a[{p}] == {r}) -> 1 : 0)"
                for p in range(self.n * self.nf * self.cap)
            )
            terms.append(f"(({placed} + {in_fifos}) == (({r} < f_next) -> 1 : 0))")
            if not self.any_mode and self.mode is not PauseMode.ABORT:
                terms.append(f"(rq_where[{r}] != {ABORTED} || ((f_cab >> {r}) & 1))")
        return _all(terms)

    def version_disagrees(self) -> str:
        answered = self.all_replied_expr(None).text
        want = f"(ct_update_rounds + ((ct_state == {FINISH}) -> 1 : 0))"
        differs = _any([f"r_weight_version[{i}] != {want}" for i in range(self.n)])
        return f"((ct_state == {RESUME} || ct_state == {FINISH}) && {answered} && !{self.phase_failed_expr()} && {differs})"

    def coord_running(self) -> str:
        from weightsync.spec.coordinator import CoordState

        return f"(co_state == {self.c(CoordState.RUNNING)})"

    def coordinator_belief(self) -> str:
        n = self.n
        agrees = f"(!{self.coord_running()} && {_all([f'r_current_wave[{i}] == co_wave' for i in range(n)])})"
        in_flight = f"(cq_len > 0 || t_blocked != {self.c('')})"
        unsettled = _any(
            [
                f"({self.coordinator_unsettled(i)} || r_current_wave[{i}] != r_current_wave[0])"
                for i in range(n)
            ]
        )
        return f"({agrees} || {in_flight} || {unsettled})"

    def coordinator_unsettled(self, i: int) -> str:
        c = self.c
        return (
            f"(r_blocked[{i}] != {c('')} || !{self.inq_empty(i)} || o_len[{i}] > 0 || {self.any_at(i, WAITING)} || "
            f"{self.any_at(i, RUNNING_Q)} || r_status[{i}] == {SENT} || r_state[{i}] != {c(RankState.RUNNING)} || "
            f"r_engines_running[{i}])"
        )

    def front_end_belief(self) -> str:
        from weightsync.spec.front_end import FrontState

        c = self.c
        believes = f"(f_state == {c(FrontState.RUNNING)})"
        unsettled = _any([self.front_end_unsettled(i) for i in range(self.n)])
        return f"(!{believes} || {self.coord_running()} || co_pub || cq_len > 0 || {unsettled})"

    def front_end_unsettled(self, i: int) -> str:
        c = self.c
        queued = f"({self.any_at(i, WAITING)} || {self.any_at(i, RUNNING_Q)})"
        return (
            f"(r_blocked[{i}] != {c('')} || o_len[{i}] > 0 || r_engines_running[{i}] || r_pending_pause[{i}] || "
            f"(r_state[{i}] == {c(RankState.RUNNING)} && {queued}) || {self.fifo_has(i, ('W', 'ADD'))})"
        )

    # ------------------------------------------------------------------ edge checks

    def snapshot(self, label: str) -> str:
        """What the edge checks of move ``label`` read of the state before it."""
        out = [
            f"b_where[{r}] = rq_where[{r}]; b_rank[{r}] = rq_rank[{r}]; b_left[{r}] = rq_left[{r}]; b_kv[{r}] = rq_kv[{r}]"
            for r in range(self.R)
        ]
        out += [f"b_blocked[{i}] = r_blocked[{i}]; b_ghost[{i}] = r_ghost[{i}]" for i in range(self.n)]
        parts = label.split()
        if parts[0] == "step":
            out.append(self.rank_snapshot(int(parts[1])))
        return "; ".join(out) or "skip"

    def check_edge(self, label: str) -> str:
        """:meth:`Properties.edge_check` of the move ``label`` just made."""
        out = []
        if self.m.drains_before_return:
            out.append(fail("wait_drains", self.undrained()))
        parts = label.split()
        if parts[0] == "step":
            i = int(parts[1])
            c = self.c
            transfer = _any(
                [f"b_blocked[{x}] == {c(k)}" for x in range(self.n) for k in sorted(TRANSFER_KINDS)]
            )
            dp = _any([f"r_blocked[{i}] == {c(k)}" for k in sorted(DP_KINDS)])
            out.append(fail("quiescence", f"({dp} && {transfer})"))
            out.append(self.step_check(i))
        elif parts[0] == "recv":
            i, f = int(parts[1]), int(parts[2])
            if f == self.m.f_add:
                held = " || ".join(
                    f"(m_a == {r} && (b_where[{r}] == {WAITING} || b_where[{r}] == {RUNNING_Q}) && b_rank[{r}] == {i} "
                    f"&& rq_where[{r}] != {ABORTED})"
                    for r in range(self.R)
                )
                if held:
                    out.append(fail("abort_honoured", f"(m_k == {kind('ABORT')} && ({held}))"))
        return "; ".join(out) or "skip"

    def undrained(self) -> str:
        """``_wait_drained`` fails: a rank's pause returned on this move (its ghost became a replied one)
        while it still runs a request, or one it found queued is still queued."""
        terms = []
        for i in range(self.n):
            base = f"(r_ghost[{i}] % {GHOST_STRIDE})"
            replied = " || ".join(f"{base} == {g}" for g in GHOSTS_REPLIED)
            left = f"({self.any_at(i, RUNNING_Q)} || ({base} == {GHOST_QUEUED_REPLIED} && {self.any_at(i, WAITING)}))"
            drains = " || ".join(self.ghost_mode_is(f"r_ghost[{i}]", d) for d in sorted(DRAINS_BEFORE_RETURN))
            terms.append(f"(b_ghost[{i}] != r_ghost[{i}] && ({replied}) && ({drains}) && {left})")
        return _any(terms)

    def step_check(self, i: int) -> str:
        """``_step_check`` of rank ``i``'s step (read off the request arrays before and after)."""
        c = self.c
        had = _any(
            [
                f"((b_where[{r}] == {WAITING} || b_where[{r}] == {RUNNING_Q}) && b_rank[{r}] == {i})"
                for r in range(self.R)
            ]
        )
        ran = _any([f"r_blocked[{i}] == {c(k)}" for k in sorted(DP_KINDS)])
        ps = "b_ps"
        admits = self.states_fn.call("admits_waiting", _E(ps))
        advances = self.states_fn.call("advances_running", _E(ps))
        from weightsync.model.spin.translate import text

        tokens, advanced, started, stale = [], [], [], []
        for r in range(self.R):
            on_before = f"((b_where[{r}] == {WAITING} || b_where[{r}] == {RUNNING_Q}) && b_rank[{r}] == {i})"
            sched = (
                f"((b_where[{r}] == {WAITING} && {text(self.codes, admits)}) || "
                f"(b_where[{r}] == {RUNNING_Q} && {text(self.codes, advances)}))"
            )
            newdone = f"(rq_where[{r}] == {DONE} && b_where[{r}] != {DONE})"
            on_after = (
                f"((rq_where[{r}] == {WAITING} || rq_where[{r}] == {RUNNING_Q}) && rq_rank[{r}] == {i})"
            )
            left1 = f"({on_after} -> rq_left[{r}] : ({newdone} -> 0 : 255))"
            want = f"(({ran} && {sched}) -> b_left[{r}] - 1 : b_left[{r}])"
            tokens.append(f"({on_before} && {left1} != {want})")
            adv = f"({on_before} && {left1} != b_left[{r}])"
            advanced.append(adv)
            started.append(
                f"(b_where[{r}] == {WAITING} && b_rank[{r}] == {i} && ((rq_where[{r}] == {RUNNING_Q} && rq_rank[{r}] == {i}) "
                f"|| {newdone}))"
            )
            stale.append(f"({adv} && b_where[{r}] == {RUNNING_Q} && b_kv[{r}] != b_wv)")
        adv_any = _any(advanced)
        base = f"(b_ghost[{i}] % {GHOST_STRIDE})"
        replied = " || ".join(f"{base} == {g}" for g in GHOSTS_REPLIED)
        keep = self.ghost_mode_is(f"b_ghost[{i}]", PauseMode.KEEP)
        frozen = f"({replied} || ({base} == {GHOST_RECEIVED} && {keep}))"
        checks = [
            fail("tokens_exactly_once", _any(tokens)),
            fail("pause_gating", f"((b_ghost[{i}] != 0 && {_any(started)}) || ({adv_any} && {frozen}))"),
        ]
        if self.any_mode or self.mode is PauseMode.ABORT:
            abort = self.ghost_mode_is(f"b_ghost[{i}]", PauseMode.ABORT)
            checks.append(fail("mode_semantics", f"({adv_any} && b_ghost[{i}] != 0 && {abort})"))
        if self.m.clear_cache:
            checks.append(fail("no_stale_kv", _any(stale)))
        checks.append(
            fail(
                "no_partial_serving",
                f"({adv_any} && (b_partial || b_wstate == {c(WorkerState.ACTIVE)} || b_state == {c(RankState.FAILED)}))",
            )
        )
        return f"if :: {had} -> " + "; ".join(checks) + " :: else -> skip fi"

    def rank_snapshot(self, i: int) -> str:
        """The stepping rank's variables before its step (the step check reads them)."""
        return (
            f"b_ps = r_pause_state[{i}]; b_wv = r_weight_version[{i}]; b_wstate = w_state[{i}]; "
            f"b_partial = w_partial[{i}]; b_state = r_state[{i}]"
        )

    # ------------------------------------------------------------------ terminal states

    def terminal_check(self) -> str:
        """:meth:`Properties.terminal_check` in a state without moves."""
        c = self.c
        phase_ok = f"(ct_state == {IDLE} || ct_state == {RESUME})"
        answered = self.all_replied_expr(None).text
        done = (
            " + ".join(
                f"((rq_where[{r}] == {DONE} || rq_where[{r}] == {ABORTED}) -> 1 : 0)" for r in range(self.R)
            )
            or "0"
        )
        goal_run = (
            f"(ct_cycles_started == {self.m.cycles} && (ct_state == {IDLE} || {answered}) && f_next == {self.R} && "
            f"({done}) == {self.R})"
        )
        ranks = _all(
            [
                f"(r_blocked[{i}] == {c('')} && {self.inq_empty(i)} && o_len[{i}] == 0 && !{self.any_at(i, WAITING)} && "
                f"!{self.any_at(i, RUNNING_Q)} && r_owed[{i}] == 0 && r_state[{i}] == {c(RankState.RUNNING)} && "
                f"r_pause_state[{i}] == {c(PauseState.UNPAUSED)})"
                for i in range(self.n)
            ]
        )
        is_end = f"({phase_ok} && {goal_run} && cq_len == 0 && t_blocked == {c('')} && {ranks})"
        blocked = _any([f"r_blocked[{i}] != {c('')}" for i in range(self.n)] + [f"t_blocked != {c('')}"])
        return (
            f"d_step {{ if :: {is_end} -> skip :: else -> if :: {blocked} -> "
            f'printf("VIOLATION no_one_sided_collective\\n") :: else -> printf("VIOLATION no_deadlock\\n") fi; '
            f"assert(false) fi }}"
        )


def _E(s: str) -> object:
    from weightsync.model.spin.translate import Expr

    return Expr(s)


__all__ = ["FAILED_REPLY", "Props"]
