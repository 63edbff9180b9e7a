"""The properties: state invariants, transition checks, terminal states and progress goals."""

from __future__ import annotations

from weightsync.model.system.environment import Environment
from weightsync.model.system.state import (
    DP_KINDS,
    FINISH,
    GHOST_QUEUED_REPLIED,
    GHOST_RECEIVED,
    GHOSTS_REPLIED,
    IDLE,
    PAUSE,
    RESUME,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
    GlobalState,
    Label,
    Rank,
    ghost_base,
)
from weightsync.spec.states import (
    DRAINS_BEFORE_RETURN,
    PauseMode,
    PauseState,
    RankState,
    admits_waiting,
    advances_running,
)
from weightsync.spec.worker import WorkerState


class Properties(Environment):
    """The property checks of :class:`Model` (see :data:`weightsync.model.check.PROPERTIES`)."""

    def invariant(self, s: GlobalState) -> list[str]:
        """Names of the state properties ``s`` violates (see :data:`weightsync.model.check.PROPERTIES`), in
        this order: :meth:`invariant_slices`, request_conservation (:meth:`_conserved`),
        :meth:`invariant_beliefs`, :meth:`invariant_modes`. The compact engine memoises each group by the
        fields it reads (:mod:`weightsync.model.compact`)."""
        bad = self.invariant_slices(s)
        bad += self.invariant_requests(s)
        bad += self.invariant_beliefs(s)
        bad += self.invariant_modes(s)
        return bad

    def invariant_slices(self, s: GlobalState) -> list[str]:
        """collectives_match and phase_bracketing: they read each rank's blocked, collective, state, status
        and worker state, and the trainer's status."""
        bad: list[str] = []
        ranks = s.ranks
        blocked = {r.blocked for r in ranks if r.blocked}
        if len(blocked) > 1 or any(r.vars.collective != r.blocked for r in ranks):
            bad.append("collectives_match")
        if (
            any(
                r.vars.state is RankState.ERROR or r.status == SPURIOUS or r.worker.state is WorkerState.ERROR
                for r in ranks
            )
            or s.trainer.status == SPURIOUS
        ):
            bad.append("phase_bracketing")
        return bad

    def invariant_requests(self, s: GlobalState) -> list[str]:
        """request_conservation (:meth:`_conserved`)."""
        return [] if self._conserved(s) else ["request_conservation"]

    def invariant_beliefs(self, s: GlobalState) -> list[str]:
        """version_agreement, coordinator_belief and front_end_belief: they read the controller's phase and
        rounds, the trainer, the coordinator and its FIFOs, the front-end's belief, and of each rank its
        status, weight version, wave, blocked, whether anything is queued or running, state, flags."""
        bad = self.invariant_version(s)
        if not self._coordinator_belief_right(s):
            bad.append("coordinator_belief")
        if not self._front_end_belief_right(s):
            bad.append("front_end_belief")
        return bad

    def invariant_version(self, s: GlobalState) -> list[str]:
        """version_agreement: it reads the controller's phase and rounds, the trainer's status, and each
        rank's status and weight version."""
        phase = s.ctrl.phase
        if phase in (RESUME, FINISH) and self._all_replied(s, phase) and not self._phase_failed(s):
            want = s.ctrl.update_rounds + (1 if phase == FINISH else 0)
            if any(r.vars.weight_version != want for r in s.ranks):
                return ["version_agreement"]
        return []

    def invariant_modes(self, s: GlobalState) -> list[str]:
        """mode_semantics (each rank's pause ghost and whether it runs requests), and the non-vacuity
        witness 'every rank verified' (each rank's state)."""
        ranks = s.ranks
        bad: list[str] = []
        if (self.any_mode or self.mode is PauseMode.ABORT) and any(
            ghost_base(r.pause_ghost) in GHOSTS_REPLIED
            and r.running
            and self.ghost_mode(r.pause_ghost) is PauseMode.ABORT
            for r in ranks
        ):
            bad.append("mode_semantics")
        if not self.seen_all_verified and all(r.vars.state is RankState.VERIFIED for r in ranks):
            self.seen_all_verified = True
        return bad

    def _wait_drained(self, s: GlobalState, t: GlobalState) -> bool:
        """An edge ``s -> t`` on which some rank's pause returns (its ghost becomes a replied one), under a
        mode that drains before its pause returns (``wait``, :data:`~weightsync.spec.states.DRAINS_BEFORE_RETURN`),
        leaves that rank running no request, and none it found queued when the pause arrived still queued
        (the ghost GHOST_QUEUED_REPLIED: vLLM 0.32 ``v1/core/sched/scheduler.py:900-917`` holds them under
        PAUSED_NEW until the resume). A request the client aborted in between is indistinguishable from a
        later one, so a rank whose ghost says so and whose queue is empty is drained. An edge property, so
        the states after such a pause are still explored (the update and resume that follow it)."""
        for a, b in zip(s.ranks, t.ranks, strict=True):
            base = ghost_base(b.pause_ghost)
            if a.pause_ghost == b.pause_ghost or base not in GHOSTS_REPLIED:
                continue
            if self.any_mode and self.ghost_mode(b.pause_ghost) not in DRAINS_BEFORE_RETURN:
                continue  # that pause's mode returns without draining
            if b.running or (base == GHOST_QUEUED_REPLIED and b.waiting):
                return False
        return True

    def _coordinator_belief_right(self, s: GlobalState) -> bool:
        """Once the engines are idle and nothing is in flight (no message, no collective, no outstanding
        call), the coordinator's ``(current_wave, engines_running)`` equals the ranks' (vLLM 0.32
        ``v1/engine/coordinator.py:363-375``: the belief comes only from the engines' own reports)."""
        coord = s.coord
        if coord.engines_running is False and all(r.vars.current_wave == coord.current_wave for r in s.ranks):
            return True
        if any(s.coord_q) or s.trainer.blocked:
            return True
        wave0 = s.ranks[0].vars.current_wave
        return any(self.coordinator_unsettled(r) or r.vars.current_wave != wave0 for r in s.ranks)

    @staticmethod
    def coordinator_unsettled(r: Rank) -> bool:
        """Rank slice ``r`` has something in flight or outstanding for ``coordinator_belief`` (blocked, a
        message queued either way, requests, a call not answered), or is not running idle."""
        if r.blocked or any(r.inq) or r.outq or r.waiting or r.running or r.status == SENT:
            return True
        v = r.vars
        return v.state is not RankState.RUNNING or bool(v.engines_running)

    def _front_end_belief_right(self, s: GlobalState) -> bool:
        """Once no rank steps or is about to (each is out of the wave loop and not in a collective, and
        none is unpaused with a request to run), and no message is in flight to the coordinator or on a
        wave socket, the front-end does not believe the engines running while the coordinator believes them
        idle, unless a publish the coordinator made is on its way to tell it so (whether the coordinator's
        own belief is right is ``coordinator_belief``) (vLLM 0.32 ``v1/engine/core_client.py:1540-1549`` sets the belief
        on forwarding FIRST_REQ; only the coordinator's stats replace it, lines 1562-1565)."""
        coord = s.coord
        if not s.front.believed_running or coord.engines_running or coord.publishing or any(s.coord_q):
            return True
        return any(self.front_end_unsettled(r) for r in s.ranks)

    @staticmethod
    def front_end_unsettled(r: Rank) -> bool:
        """Rank slice ``r`` steps or is about to, for ``front_end_belief``: in a collective, a message to the
        coordinator, in the wave loop or a pause pending, unpaused with a request to run, or a START_DP_WAVE
        or ADD queued."""
        if r.blocked or r.outq or r.vars.engines_running or r.vars.pending_pause:
            return True
        if r.vars.state is RankState.RUNNING and (r.waiting or r.running):
            return True
        return any(m[0] in ("W", "ADD") for q in r.inq for m in q)

    def _conserved(self, s: GlobalState) -> bool:
        sent = s.front.next_request
        seen = [*s.done, *s.aborted]
        for r in s.ranks:
            seen += [q[0] for q in r.waiting]
            seen += [q[0] for q in r.running]
            for f in r.inq:
                if f:
                    seen += [m[1] for m in f if m[0] == "ADD"]
        if (
            len(seen) != sent
            or (sent > 1 and sorted(seen) != list(range(sent)))
            or (sent == 1 and seen[0] != 0)
        ):
            return False
        if self.mode is PauseMode.ABORT or self.any_mode:
            # an abort-mode pause may have aborted any request (under ANY_MODE the state does not say
            # which pause aborted what, so only the count and the identities are checked)
            return True
        client_aborted = s.front.client_aborted
        return all(
            r in client_aborted for r in s.aborted
        )  # keep and wait abort nothing the client did not abort

    def edge_check(self, s: GlobalState, label: Label, t: GlobalState) -> list[str]:
        """Transition properties: wait_drains (:meth:`_wait_drained`), quiescence (no rank steps or enters a DP collective while another rank
        is inside a weight-transfer collective; issue #36594, PR #39366), plus the non-vacuity witness
        'an update completes while a START_DP_WAVE is in flight'."""
        if self.drains_before_return and not self._wait_drained(s, t):
            return ["wait_drains", *self._edge_check(s, label, t)]
        return self._edge_check(s, label, t)

    def _edge_check(self, s: GlobalState, label: Label, t: GlobalState) -> list[str]:
        kind = label[0]
        if kind == "step":
            i = label[1]
            if t.ranks[i].blocked in DP_KINDS and any(r.blocked in TRANSFER_KINDS for r in s.ranks):
                return ["quiescence"]
            return self._step_check(s, i, t)
        if kind == "recv" and s.ranks[label[1]].inq[label[2]][0][0] == "ABORT":
            i, r = label[1], s.ranks[label[1]].inq[label[2]][0][1]
            held = any(q[0] == r for q in s.ranks[i].waiting + s.ranks[i].running)
            if held and r not in t.aborted:
                return ["abort_honoured"]
        elif (
            kind == "done"
            and label[1] == "weight_broadcast"
            and not self.seen_update_with_wave_in_flight
            and any(m[0] == "W" for r in s.ranks for q in r.inq for m in q)
        ):
            self.seen_update_with_wave_in_flight = True
        return []

    def _step_check(self, s: GlobalState, i: int, t: GlobalState) -> list[str]:
        """Properties of one loop step of rank ``i``: tokens_exactly_once, pause_gating, mode_semantics,
        no_stale_kv (see :data:`weightsync.model.check.PROPERTIES`)."""
        before, after = s.ranks[i], t.ranks[i]
        if not before.waiting and not before.running:
            return []
        newdone = set(t.done) - set(s.done)
        left0 = {q[0]: q[1] for q in before.waiting}
        left0.update((q[0], q[1]) for q in before.running)
        left1 = {q[0]: q[1] for q in after.waiting}
        left1.update((q[0], q[1]) for q in after.running)
        left1.update((r, 0) for r in newdone)
        ps = before.vars.pause_state
        sched = {q[0] for q in before.waiting if admits_waiting(ps)} | {
            q[0] for q in before.running if advances_running(ps)
        }
        ran = after.blocked in DP_KINDS  # the step ran a forward (it entered the DP collective)
        bad: list[str] = []
        for r, left in left0.items():
            want = left - 1 if ran and r in sched else left
            if left1.get(r, -1) != want:
                bad.append("tokens_exactly_once")
                break
        advanced = {r for r, left in left0.items() if left1.get(r, -1) != left}
        started = {
            q[0] for q in before.waiting if any(x[0] == q[0] for x in after.running) or q[0] in newdone
        }
        pause_ghost = before.pause_ghost
        base = ghost_base(pause_ghost)
        pause_mode = self.ghost_mode(pause_ghost) if pause_ghost else None
        frozen = base in GHOSTS_REPLIED or (base == GHOST_RECEIVED and pause_mode is PauseMode.KEEP)
        if (pause_ghost and started) or (advanced and frozen):
            bad.append("pause_gating")
        if advanced and pause_ghost and pause_mode is PauseMode.ABORT:
            bad.append("mode_semantics")
        if self.clear_cache and any(
            q[0] in advanced and q[2] != before.vars.weight_version for q in before.running
        ):
            bad.append("no_stale_kv")
        if advanced and (
            before.worker.partial
            or before.worker.state is WorkerState.ACTIVE
            or before.vars.state is RankState.FAILED
        ):
            bad.append("no_partial_serving")
        return bad

    def is_end(self, s: GlobalState) -> bool:
        """A legitimate end: the controller's run is over (:meth:`goal_run`) after a resume or idle, all
        channels are empty, nobody is blocked, every rank is running and unpaused, and no rank owes a reply
        to an untracked call (a retried or repeated pause or resume returns too; a terminal
        state where one never will is a deadlock of that call)."""
        if s.ctrl.phase not in (IDLE, RESUME) or not self.goal_run(s):
            return False
        if any(s.coord_q) or s.trainer.blocked:
            return False
        for r in s.ranks:
            if r.blocked or any(r.inq) or r.outq or r.waiting or r.running or r.owed:
                return False
            if r.vars.state is not RankState.RUNNING or r.vars.pause_state is not PauseState.UNPAUSED:
                return False
        return True

    def terminal_check(self, s: GlobalState) -> list[str]:
        """A state without successors that is not a legitimate end: 'no_one_sided_collective' when some
        rank is blocked in a collective there, else 'no_deadlock'."""
        if self.is_end(s):
            return []
        if any(r.blocked for r in s.ranks) or s.trainer.blocked:
            return ["no_one_sided_collective"]
        return ["no_deadlock"]

    # progress goals (reverse reachability)
    def goal_pause(self, s: GlobalState) -> bool:
        """No pause outstanding: the controller is not waiting for a pause reply."""
        return s.ctrl.phase != PAUSE or self._all_replied(s, PAUSE)

    def goal_resume(self, s: GlobalState) -> bool:
        """No resume outstanding."""
        return s.ctrl.phase != RESUME or self._all_replied(s, RESUME)

    def goal_requests(self, s: GlobalState) -> bool:
        """Every admitted request finished or was aborted."""
        return len(s.done) + len(s.aborted) == s.front.next_request

    def goal_run(self, s: GlobalState) -> bool:
        """The controller's run is over: it started its ``cycles`` cycles and its last call was answered (or
        it is idle), and every request was sent and finished or was aborted. It reads the state outside
        the ranks and each rank's ``status`` only, as the other goals (the compact view groups by them)."""
        phase = s.ctrl.phase
        if s.ctrl.cycles_started != self.cycles or not (phase == IDLE or self._all_replied(s, phase)):
            return False
        return s.front.next_request == self.requests and len(s.done) + len(s.aborted) == self.requests
