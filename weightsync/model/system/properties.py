"""The properties: state invariants, transition checks, terminal states and progress goals."""

from __future__ import annotations

from weightsync.model.system.environment import Environment
from weightsync.model.system.state import (
    DP_KINDS,
    FINISH,
    IDLE,
    PAUSE,
    RESUME,
    SENT,
    SPURIOUS,
    TRANSFER_KINDS,
    G,
    Label,
)
from weightsync.spec.states import PauseMode, PauseState, RankState, admits_waiting, advances_running
from weightsync.spec.worker import WorkerState


class Properties(Environment):
    """The property checks of :class:`Model` (see :data:`weightsync.model.check.PROPERTIES`)."""

    def invariant(self, s: G) -> list[str]:
        """Names of the state properties ``s`` violates (see :data:`weightsync.model.check.PROPERTIES`)."""
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
            or s.trainer[1] == SPURIOUS
        ):
            bad.append("phase_bracketing")
        if not self._conserved(s):
            bad.append("request_conservation")
        phase = s.ctrl.phase
        if phase in (RESUME, FINISH) and self._all_replied(s, phase) and not self._phase_failed(s):
            want = s.ctrl.update_rounds + (1 if phase == FINISH else 0)
            if any(r.vars.weight_version != want for r in ranks):
                bad.append("version_agreement")
        if not self._coordinator_belief_right(s):
            bad.append("coordinator_belief")
        if self.mode is PauseMode.ABORT and any(r.pz == 2 and r.running for r in ranks):
            bad.append("mode_semantics")
        if not self.seen_all_verified and all(r.vars.state is RankState.VERIFIED for r in ranks):
            self.seen_all_verified = True
        return bad

    def _coordinator_belief_right(self, s: G) -> bool:
        """Once the engines are idle and nothing is in flight (no message, no collective, no outstanding
        call), the coordinator's ``(current_wave, engines_running)`` equals the ranks' (vLLM 0.32
        ``v1/engine/coordinator.py:363-375``: the belief comes only from the engines' own reports)."""
        if s.coord[1] is False and all(r.vars.current_wave == s.coord[0] for r in s.ranks):
            return True
        if any(s.coord_q) or s.trainer[0]:
            return True
        w0 = s.ranks[0].vars.current_wave
        for r in s.ranks:
            v = r.vars
            if r.blocked or any(r.inq) or r.outq or r.waiting or r.running or r.status == SENT:
                return True
            if v.state is not RankState.RUNNING or v.engines_running or v.current_wave != w0:
                return True
        return False

    def _conserved(self, s: G) -> bool:
        nxt = s.front[2]
        seen = [*s.done, *s.aborted]
        for r in s.ranks:
            seen += [q[0] for q in r.waiting]
            seen += [q[0] for q in r.running]
            for f in r.inq:
                if f:
                    seen += [m[1] for m in f if m[0] == "ADD"]
        if len(seen) != nxt or (nxt > 1 and sorted(seen) != list(range(nxt))) or (nxt == 1 and seen[0] != 0):
            return False
        if self.mode is PauseMode.ABORT:
            return True
        cab = s.front[4]
        return all(r in cab for r in s.aborted)  # keep and wait abort nothing the client did not abort

    def edge_check(self, s: G, label: Label, t: G) -> list[str]:
        """Transition properties: quiescence (no rank steps or enters a DP collective while another rank
        is inside a weight-transfer collective; issue #36594, PR #39366), plus the non-vacuity witness
        'an update completes while a START_DP_WAVE is in flight'."""
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

    def _step_check(self, s: G, i: int, t: G) -> list[str]:
        """Properties of one loop step of rank ``i``: tokens_exactly_once, pause_gating, mode_semantics,
        no_stale_kv (see :data:`weightsync.model.check.PROPERTIES`)."""
        rb, ra = s.ranks[i], t.ranks[i]
        if not rb.waiting and not rb.running:
            return []
        newdone = set(t.done) - set(s.done)
        left0 = {q[0]: q[1] for q in rb.waiting}
        left0.update((q[0], q[1]) for q in rb.running)
        left1 = {q[0]: q[1] for q in ra.waiting}
        left1.update((q[0], q[1]) for q in ra.running)
        left1.update((r, 0) for r in newdone)
        ps = rb.vars.pause_state
        sched = {q[0] for q in rb.waiting if admits_waiting(ps)} | {
            q[0] for q in rb.running if advances_running(ps)
        }
        ran = ra.blocked in DP_KINDS  # the step ran a forward (it entered the DP collective)
        bad: list[str] = []
        for r, left in left0.items():
            want = left - 1 if ran and r in sched else left
            if left1.get(r, -1) != want:
                bad.append("tokens_exactly_once")
                break
        advanced = {r for r, left in left0.items() if left1.get(r, -1) != left}
        started = {q[0] for q in rb.waiting if any(x[0] == q[0] for x in ra.running) or q[0] in newdone}
        frozen = rb.pz == 2 or (rb.pz == 1 and self.mode is PauseMode.KEEP)
        if (rb.pz and started) or (advanced and frozen):
            bad.append("pause_gating")
        if advanced and rb.pz and self.mode is PauseMode.ABORT:
            bad.append("mode_semantics")
        if self.clear and any(q[0] in advanced and q[2] != rb.vars.weight_version for q in rb.running):
            bad.append("no_stale_kv")
        if advanced and (
            rb.worker.partial or rb.worker.state is WorkerState.ACTIVE or rb.vars.state is RankState.FAILED
        ):
            bad.append("no_partial_serving")
        return bad

    def is_end(self, s: G) -> bool:
        """A legitimate end: the controller finished its cycles, every request was sent and finished (or
        aborted), all channels are empty, nobody is blocked, and every rank is running and unpaused."""
        phase, started = s.ctrl.phase, s.ctrl.cycles_started
        if started != self.C or not (phase == IDLE or self._all_replied(s, phase)):
            return False
        if phase not in (IDLE, RESUME):
            return False
        if s.front[2] != self.R or len(s.done) + len(s.aborted) != self.R:
            return False
        if any(s.coord_q) or s.trainer[0]:
            return False
        for r in s.ranks:
            if r.blocked or any(r.inq) or r.outq or r.waiting or r.running:
                return False
            if r.vars.state is not RankState.RUNNING or r.vars.pause_state is not PauseState.UNPAUSED:
                return False
        return True

    def terminal_check(self, s: G) -> list[str]:
        """A state without successors that is not a legitimate end: 'no_one_sided_collective' when some
        rank is blocked in a collective there, else 'no_deadlock'."""
        if self.is_end(s):
            return []
        if any(r.blocked for r in s.ranks) or s.trainer[0]:
            return ["no_one_sided_collective"]
        return ["no_deadlock"]

    # progress goals (reverse reachability)
    def goal_pause(self, s: G) -> bool:
        """No pause outstanding: the controller is not waiting for a pause reply."""
        return s.ctrl.phase != PAUSE or self._all_replied(s, PAUSE)

    def goal_resume(self, s: G) -> bool:
        """No resume outstanding."""
        return s.ctrl.phase != RESUME or self._all_replied(s, RESUME)

    def goal_requests(self, s: G) -> bool:
        """Every admitted request finished or was aborted."""
        return len(s.done) + len(s.aborted) == s.front[2]
