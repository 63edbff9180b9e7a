"""The :class:`Model`: its parts combined, with the successor function."""

from __future__ import annotations

from weightsync.model.system.properties import Properties
from weightsync.model.system.reduction import SilentWaves
from weightsync.model.system.state import (
    DP_KINDS,
    FAILABLE_CALLS,
    RETRY,
    TRANSFER_KINDS,
    GlobalState,
    Label,
    _ScratchState,
)
from weightsync.model.system.symmetry import Symmetry
from weightsync.spec.front_end import FrontEvent
from weightsync.spec.states import RankState


class Model(Properties, Symmetry, SilentWaves):
    """The N-rank product of one :class:`Config`, with its successor function and property checks.

    The parts are mixins, one per concern: :class:`~weightsync.model.system.base.ModelBase` (configuration,
    initial state, table lookups), :class:`~weightsync.model.system.effects.RankEffects` (rank transitions
    and effects), :class:`~weightsync.model.system.environment.Environment` (coordinator, front-end,
    controller, trainer), :class:`~weightsync.model.system.properties.Properties` and
    :class:`~weightsync.model.system.symmetry.Symmetry`; this class adds :meth:`successors`.

    Args:
        config: variant, N, mode, channels, bounds.
        table: override the variant's table (mutation testing).
        guards: guard registry (default :data:`weightsync.spec.rank.GUARDS`).
        updates: update registry (default :data:`weightsync.spec.rank.UPDATES`).
        silent_waves: the silent-wave reduction (:mod:`~weightsync.model.system.reduction`; safety and
            deadlock only).
    """

    def successors(self, s: GlobalState) -> list[tuple[Label, GlobalState]]:
        """Every enabled transition of ``s`` as ``(label, next_state)``, in a deterministic order:
        rank inputs and steps (rank by rank, :meth:`rank_moves`), collective completions and timeouts
        (:meth:`collective_moves`), the coordinator (:meth:`coord_moves`), the front-end (:meth:`send_moves`,
        :meth:`refresh_moves`, :meth:`abort_moves`), the controller and the trainer (:meth:`_controller`).
        Transitions that change nothing (an idle loop pass) are omitted. The compact engine
        (:mod:`weightsync.model.compact`) calls the same parts in the same order."""
        out: list[tuple[Label, GlobalState]] = []
        for i in range(self.n):
            self.rank_moves(s, i, out)
        self.collective_moves(s, out)
        self.coord_moves(s, out)
        self.send_moves(s, out)
        self.refresh_moves(s, out)
        self.abort_moves(s, out)
        self._controller(s, out)
        if self.stray_resume or self.repeat_resume or self.silent_waves:
            reduced = self.reduced
            return [(label, reduced(t)) for label, t in out]
        return out

    def reduced(self, s: GlobalState) -> GlobalState:
        """``s`` after the reductions the successor function applies to every successor: the settle
        reduction of stray/repeated resumes (:meth:`_settle`) and the silent-wave reduction
        (:meth:`~weightsync.model.system.reduction.SilentWaves.quiet`), to their common fixpoint. Under
        ``ordered`` channels both take from one FIFO, so one may uncover a message the other takes; otherwise
        they take from different FIFOs, change no rank variable, and one pass suffices."""
        settle = self.stray_resume or self.repeat_resume
        while True:
            t = self._settle(s) if settle else s
            if self.silent_waves:
                t = self.quiet(t)
            if not self.ordered or t is s or t == s:  # (a settle that delivers nothing may copy the state)
                return t
            s = t

    def rank_moves(self, s: GlobalState, i: int, out: list[tuple[Label, GlobalState]]) -> None:
        """Rank ``i``'s inputs (the head of each FIFO, and its failing variant) and its loop step. They read
        rank ``i``'s slice, ``i`` and the state outside the ranks, and change only those (the compact
        engine's memo relies on it)."""
        rank = s.ranks[i]
        if rank.blocked or rank.vars.state is RankState.ERROR:
            return
        for f, q in enumerate(rank.inq):
            if q:
                out.append((("recv", i, f), self._recv(s, i, f)))
                if (
                    s.ctrl.failures_used < self.failures
                    and q[0][0] == "U"
                    and q[0][1] in FAILABLE_CALLS
                    and (
                        self.worker_args
                        or rank.vars.state in (RankState.VERIFIED, RankState.FAILED, RankState.UPDATING)
                    )
                ):
                    out.append((("recv", i, f, "fail"), self._recv(s, i, f, fail=True)))
        t = self._step(s, i)
        if t is not None:
            out.append((("step", i), t))

    def collective_moves(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """Collective completions (every rank blocked in the same collective, and the trainer in a transfer
        one), then timeouts (:meth:`_timeouts`). None unless some rank or the trainer is blocked."""
        ranks = s.ranks
        k0 = ranks[0].blocked
        if (
            k0
            and all(r.blocked == k0 for r in ranks)
            and (k0 in DP_KINDS or (k0 in TRANSFER_KINDS and s.trainer.blocked == k0))
        ):
            out.append((("done", k0), self._complete(s, k0)))
            if k0 in TRANSFER_KINDS and s.ctrl.failures_used < self.failures:
                out.append((("done", k0, "fail"), self._complete(s, k0, fail=True)))
        self._timeouts(s, out)

    def coord_moves(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """The coordinator receives the head of one of its FIFOs (the front-end's, then each rank's)."""
        for f, q in enumerate(s.coord_q):
            if q:
                out.append((("coord", -1, f), self._coord_recv(s, -1, f)))
        if not self.ordered:
            ranks = s.ranks
            for i in range(self.n):
                if ranks[i].outq:
                    out.append((("coord", i, 0), self._coord_recv(s, i, 0)))

    def send_moves(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """The client sends its next request to some rank (none once ``requests`` were sent)."""
        front = s.front
        if front.next_request < self.requests and not self._init_holds_front(s):
            for i in range(self.n):
                if "hold_request" not in self._front(front, FrontEvent.SEND_REQUEST, target=i)[0]:
                    out.append((("send", i), self._send_request(s, i)))

    def refresh_moves(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """The front-end's stats refresh (a refresh that changes nothing is a self-loop, omitted). It reads
        and changes only the front-end and the coordinator."""
        front, coord = s.front, s.coord
        if front.believed_wave != coord.current_wave or front.believed_running != coord.engines_running:
            _, refreshed = self._front(
                front, FrontEvent.STATS, wave=coord.current_wave, running=coord.engines_running
            )
            coord = coord._replace(publishing=False) if coord.publishing else coord
            out.append((("refresh",), s._replace(front=refreshed, coord=coord)))

    def abort_moves(self, s: GlobalState, out: list[tuple[Label, GlobalState]]) -> None:
        """The client aborts a request it sent that is still held by a rank (``client_aborts`` bound)."""
        front = s.front
        client_aborted = front.client_aborted
        if len(client_aborted) < self.client_aborts:
            for r in range(front.next_request):
                if r not in client_aborted and r not in s.done and r not in s.aborted:
                    i = self._holder(s, r)
                    if i >= 0:
                        out.append((("abort", i, r), self._send_abort(s, i, r)))

    def _settle(self, s: GlobalState) -> GlobalState:
        """Reduction (with stray or repeated resumes only): a resume at the head of a rank's controller FIFO
        that the rank takes as a no-op (see :meth:`_deliver_now`) is received at once. It is independent
        of every other transition (it changes no rank variable, and no other transition can change which
        row it takes: the rank leaves its state only through a later controller call, queued behind it),
        so exploring it first loses no reachable state other than those that differ only in the
        controller's view of that reply."""
        scratch: _ScratchState | None = None
        for i in range(self.n):
            while True:
                rank = (scratch.ranks if scratch is not None else s.ranks)[i]
                f = self.f_ctrl
                q = rank.inq[f]
                if rank.blocked or not q or q[0][0] != "U" or q[0][1] != "resume":
                    break
                if scratch is None:
                    scratch = _ScratchState(s)
                scratch.untracked = q[0][2] == RETRY
                scratch.ranks[i] = rank.with_inq((*rank.inq[:f], q[1:], *rank.inq[f + 1 :]))
                if not self._deliver_now(scratch, i, "resume", queued=True):
                    scratch.ranks[i] = rank
                    break
        if scratch is None:
            return s
        scratch.untracked = False
        return scratch.freeze()
