"""The global model: N rank machines x DP coordinator x API front-end x controller x trainer x channels.

Each rank's protocol state is a :class:`~weightsync.spec.rank.RankVars` advanced *only* through
:func:`weightsync.spec.rank.select` / :func:`~weightsync.spec.rank.apply` on the variant's table; this
module interprets the table's *effects* symbolically (reference section 10, design.md section 3):

- ``queue_request`` / ``abort_requests`` / ``execute_step`` / ``clear_cache``: scheduler changes on the rank;
- ``emit_start_wave`` / ``emit_wave_complete``: a message on the rank's socket to the DP coordinator;
- ``enter_<collective>``: the rank is blocked in that collective until every member entered it;
- ``reply`` / ``reply_pause`` / ``reply_resume``: the controller sees the rank's reply;
- ``front_end_gate`` / ``front_end_ungate``: the API front-end holds / releases new requests.

Processes (reference sections 1, 5, 6):

- **Ranks**: take one input (the head of one of their FIFOs) or run one loop step per transition.
- **DP coordinator** (vLLM's ``DPCoordinator``): ``(current_wave, engines_running)``.
- **Front-end**: stamps each request with its believed wave, sends ADD to any rank, and FIRST_REQ to the
  coordinator when it believes engines idle; a nondeterministic stats refresh copies the coordinator's
  ``(current_wave, engines_running)`` (the 100 ms stats).
- **Controller** (the RL orchestrator, its own socket per rank): pause -> start -> update (with the trainer
  joining the broadcast) -> finish -> resume, or pause -> resume; at most ``cycles`` cycles, started at
  any point.
- **Trainer**: the sender of the weight broadcast.

Channels: ``per-socket`` (default): one FIFO per (source, destination, socket) -- front-end->rank (ADD),
controller->rank (utility calls), coordinator->rank (START_DP_WAVE), rank->coordinator, front-end->
coordinator -- mutually unordered, and fan-outs reach ranks one at a time in any order (two or more API
servers: requests and utility calls come from different processes). ``one-api-server``: ADD, ABORT and
utility calls share one FIFO per rank (vLLM 0.32 with one API server: one ROUTER socket per engine,
``v1/engine/core_client.py:1250-1257``), START_DP_WAVE from the coordinator comes on another (the engine's
input thread polls both sockets, ``v1/engine/core.py:1831-1931``), the coordinator's inputs as under
per-socket. ``ordered``: one FIFO per destination for everything sent to it, and atomic fan-outs.

The global state is a plain tuple (see :class:`G`); everything in it is hashable.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from weightsync.spec.rank import GUARDS, UPDATES, RankVars, Table, Variant, apply, get_variant, select
from weightsync.spec.states import (
    DP_COLLECTIVES,
    PauseMode,
    PauseState,
    RankEvent,
    RankState,
    admits_waiting,
    advances_running,
    schedulable,
    unfinished_for_sync,
)
from weightsync.spec.table import ALWAYS, Transition, apply_transition, select_transition
from weightsync.spec.worker import (
    WORKER_EVENT_OF_EFFECT,
    WORKER_GUARDS,
    WORKER_TABLE,
    WORKER_UPDATES,
    WorkerEvent,
    WorkerState,
    WorkerVars,
)

# Controller phases.
IDLE, PAUSE, START, UPDATE, FINISH, RESUME, INIT = range(7)
PHASE_CALL = {
    PAUSE: "pause",
    START: "start_weight_update",
    UPDATE: "update_weights",
    FINISH: "finish_weight_update",
    RESUME: "resume",
    INIT: "init_weight_transfer_engine",
}
CALL_EVENT = {
    "pause": RankEvent.PAUSE,
    "resume": RankEvent.RESUME,
    "start_weight_update": RankEvent.START_UPDATE,
    "update_weights": RankEvent.UPDATE_WEIGHTS,
    "finish_weight_update": RankEvent.FINISH_UPDATE,
    "init_weight_transfer_engine": RankEvent.INIT_TRANSFER,
}
# Controller per-rank call status (FAILED_REPLY: the call returned an error: a refusal or a failure).
NOT_SENT, SENT, REPLIED, SPURIOUS, FAILED_REPLY = 0, 1, 2, 3, 4
#: The third field of a controller message ("U", call, arg): the version a finish_weight_update carries,
#: RETRY for a resume re-sent by an orchestrator while its first is outstanding (its reply is not counted).
RETRY = -1
#: Rank effects that are worker operations that may fail (when Bounds.failures allows one).
FAILABLE_EFFECTS = frozenset({"start_weight_update", "finish_weight_update"})
_REPLIES = frozenset({"reply", "reply_resume"})
_IMMEDIATE_REPLIES = frozenset({"reply", "reply_pause", "reply_resume", "refuse", "reply_failure"})
FAIL_PHASE = {
    "start_weight_update": "start",
    "finish_weight_update": "finish",
    "weight_broadcast": "update",
    "transfer_init": "init",
}

# Per-socket rank input FIFOs.
F_ADD, F_CTRL, F_WAVE = 0, 1, 2
#: Channel semantics -> (number of rank input FIFOs, FIFO of ADD/ABORT, of utility calls, of START_DP_WAVE).
CHANNEL_FIFOS: dict[str, tuple[int, int, int, int]] = {
    "per-socket": (3, F_ADD, F_CTRL, F_WAVE),
    "one-api-server": (2, 0, 0, 1),
    "ordered": (1, 0, 0, 0),
}
CHANNELS = tuple(CHANNEL_FIFOS)

DONE_EVENT = {
    "dp_step": RankEvent.DP_STEP_DONE,
    "dp_sync": RankEvent.DP_SYNC_DONE,
    "resume_barrier": RankEvent.RESUME_BARRIER_DONE,
    "weight_broadcast": RankEvent.WEIGHT_BROADCAST_DONE,
    "transfer_init": RankEvent.TRANSFER_INIT_DONE,
}
ENTER_EFFECT = {f"enter_{k}": k for k in DONE_EVENT}
DP_KINDS = frozenset(str(c.value) for c in DP_COLLECTIVES)
TRANSFER_KINDS = frozenset({"weight_broadcast", "transfer_init"})


class Bounds(NamedTuple):
    """Bounds of the model.

    Attributes:
        requests: client requests in total (R).
        cycles: pause/update/resume cycles the controller may run (C).
        sync_interval: K, the DP sync all-reduce every K steps (PR #21617: 32; vLLM 0.32: 16,
            ``config/parallel.py:162``; the vllm-0.32 tables also sync at the first step of every wave).
        tokens: steps each request needs to finish (>= 2 lets keep mode freeze a request mid-generation).
        clear_cache: the pause's ``clear_cache`` argument (vLLM default True).
        client_aborts: client ABORTs the front-end may send (each for one request it sent, to the rank it
            sent it to; reference s5). 0 in the default proofs.
        init_transfer: the controller calls ``init_weight_transfer_engine`` once (joined by the trainer),
            either before the first request (the front-end waits for it) or lazily in the first cycle
            between pause and start; when False the transfer engine is assumed initialised at start.
        stray_resume: the controller may issue one ``resume`` that no pause preceded (an orchestrator's
            ``finally`` path, reference s9 prime-rl), when idle or after a completed resume, with requests
            arriving at any point around it.
        repeat_resume: the controller may re-send ``resume`` to every rank once while its first resume is
            still outstanding (a client-side retry, or a second controller); those replies are not counted.
        failures: weight-transfer failures that may be injected (0 in the default proofs): a
            ``transfer_init`` or ``weight_broadcast`` collective that fails on every member, or a
            ``start_weight_update`` / ``finish_weight_update`` that raises on one rank. A transfer collective
            that a failed rank will never join times out on each member (no bound). The controller then
            re-initialises (after a failed init) and runs a new round before it resumes.
        pause_during_update: the controller may send a second ``pause`` to every rank once while a round is in
            flight (phase start, update or finish: a second controller, or a defensive re-pause); its
            replies are not counted.
        resume_during_update: the controller may send ``resume`` to every rank once while a round is in flight
            (an orchestrator's timeout or ``finally`` path racing its own update); its replies are not
            counted, and the round then carries on.
    """

    requests: int = 1
    cycles: int = 1
    sync_interval: int = 2
    tokens: int = 2
    clear_cache: bool = True
    client_aborts: int = 0
    init_transfer: bool = False
    stray_resume: bool = False
    repeat_resume: bool = False
    failures: int = 0
    pause_during_update: bool = False
    resume_during_update: bool = False


class Config(NamedTuple):
    """One model instance: variant, number of DP ranks, pause mode, channel semantics and bounds."""

    variant: str = "two-phase-epoch"
    ranks: int = 2
    mode: PauseMode = PauseMode.KEEP
    channels: str = "per-socket"
    bounds: Bounds = Bounds()


class Rank(NamedTuple):
    """One rank's slice of the global state.

    Attributes:
        vars: protocol variables (advanced only by the table).
        blocked: the collective the rank is blocked in according to the effects it fired ("" if none).
        waiting: scheduler waiting queue, sorted ``(request, tokens_left)``.
        running: scheduler running batch, sorted ``(request, tokens_left)``.
        inq: input FIFOs (per-socket: ADD, controller, wave; ordered: one).
        outq: FIFO to the coordinator (per-socket only; ordered mode uses the coordinator's single FIFO).
        status: the controller's current call to this rank: 0 not sent, 1 sent, 2 replied, 3 spurious reply.
        pz: ghost for the pause properties: 0 no pause in effect, 1 the rank received pause (and no resume
            since), 2 its pause reply was sent.
        worker: the rank's worker-side weight-update machine (:mod:`weightsync.spec.worker`), driven by
            the table's ``start_weight_update`` / ``finish_weight_update`` / ``enter_weight_broadcast`` /
            ``enter_transfer_init`` effects.

        owed: (variants with ``untracked_replies``) the deferred replies the rank owes to untracked calls it
            received: bit 1 a pause, bit 2 a resume (see :meth:`Model._reply_status`).

    ``running`` entries are ``(request, tokens_left, kv_version)``: the weight version under which the
    request's KV was computed (set when it is scheduled from ``waiting``).
    """

    vars: RankVars
    blocked: str
    waiting: tuple[tuple[int, int], ...]
    running: tuple[tuple[int, int, int], ...]
    inq: tuple[tuple[tuple[Any, ...], ...], ...]
    outq: tuple[tuple[Any, ...], ...]
    status: int
    pz: int
    worker: WorkerVars
    owed: int = 0

    # Field setters for the successor function's hot paths (``_replace`` is several times slower).
    def with_inq(self, inq: tuple[tuple[tuple[Any, ...], ...], ...]) -> Rank:
        """This slice with input FIFOs ``inq``."""
        return _new_rank(
            Rank, (self[0], self[1], self[2], self[3], inq, self[5], self[6], self[7], self[8], self[9])
        )

    def with_queues(
        self, waiting: tuple[tuple[int, int], ...], running: tuple[tuple[int, int, int], ...]
    ) -> Rank:
        """This slice with scheduler queues ``waiting`` and ``running``."""
        return _new_rank(
            Rank, (self[0], self[1], waiting, running, self[4], self[5], self[6], self[7], self[8], self[9])
        )

    def with_status(self, status: int, pz: int) -> Rank:
        """This slice with controller-call status ``status`` and pause ghost ``pz``."""
        return _new_rank(
            Rank, (self[0], self[1], self[2], self[3], self[4], self[5], status, pz, self[8], self[9])
        )

    def with_outq(self, outq: tuple[tuple[Any, ...], ...]) -> Rank:
        """This slice with the FIFO to the coordinator ``outq``."""
        return _new_rank(
            Rank, (self[0], self[1], self[2], self[3], self[4], outq, self[6], self[7], self[8], self[9])
        )


_new_rank = tuple.__new__


class Ctrl(NamedTuple):
    """The RL controller's state (see :class:`G`).

    Attributes:
        phase: the call it is making (IDLE, PAUSE, INIT, START, UPDATE, FINISH, RESUME).
        cycles_started: pause/update/resume cycles begun.
        update_rounds: successful rounds (a finish_weight_update fan-out every rank answered without
            error); the version a finish carries is ``update_rounds + 1``.
        transfer_initialised: init_weight_transfer_engine has been called.
        stray_resume_used: the one resume no pause preceded was sent (``Bounds.stray_resume``).
        repeat_resume_used: the one retried resume was sent (``Bounds.repeat_resume``).
        failures_used: weight-transfer failures injected so far (``Bounds.failures``).
        recovering: a round failed and no round has succeeded since.
        extra_used: bits X_PAUSE / X_RESUME: the second pause / the resume during an update were sent.
    """

    phase: int
    cycles_started: int
    update_rounds: int
    transfer_initialised: bool
    stray_resume_used: bool
    repeat_resume_used: bool
    failures_used: int
    recovering: bool
    extra_used: int


#: ``extra_used`` bits: the second pause and the resume during an update (Bounds flags) were sent.
X_PAUSE, X_RESUME = 1, 2
#: Messages to the coordinator whose last field is the sending rank.
_SENDER_LAST = frozenset({"start_wave", "wave_complete"})
#: Every message kind naming a rank (see :meth:`Model.permute`).
_RANK_NAMING = _SENDER_LAST | {"W", "FIRST_REQ"}
#: ``Rank.owed`` bits.
OWE_PAUSE, OWE_RESUME = 1, 2


class G(NamedTuple):
    """Global state.

    Attributes:
        ranks: one :class:`Rank` per DP rank.
        coord_q: the coordinator's input FIFOs other than the ranks' (per-socket: FIRST_REQ from the
            front-end; ordered: the single FIFO of everything sent to the coordinator, with senders).
        coord: ``(current_wave, engines_running)``.
        front: ``(believed_wave, believed_running, next_request, gated, client_aborted)`` (the requests
            the client aborted, sorted).
        ctrl: ``(phase, cycles_started, update_rounds, transfer_initialised, stray_resume_used,
            repeat_resume_used, failures_used, recovering, extra_used)``; ``update_rounds`` counts successful
            rounds (a finish_weight_update fan-out every rank answered without error); ``recovering``: a
            round failed and no round has succeeded since; ``extra_used``: bits X_PAUSE / X_RESUME.
        trainer: ``(blocked, status)``.
        done: finished requests (sorted).
        aborted: aborted requests (sorted).
    """

    ranks: tuple[Rank, ...]
    coord_q: tuple[tuple[tuple[Any, ...], ...], ...]
    coord: tuple[int, bool]
    front: tuple[int, bool, int, bool, tuple[int, ...]]
    ctrl: Ctrl
    trainer: tuple[str, int]
    done: tuple[int, ...]
    aborted: tuple[int, ...]


#: A compact transition label; see :meth:`Model.describe` for the human form.
Label = tuple[Any, ...]


class Model:
    """The N-rank product of one :class:`Config`, with its successor function and property checks.

    Args:
        config: variant, N, mode, channels, bounds.
        table: override the variant's table (mutation testing).
        guards: guard registry (default :data:`weightsync.spec.rank.GUARDS`).
        updates: update registry (default :data:`weightsync.spec.rank.UPDATES`).
    """

    def __init__(
        self,
        config: Config,
        table: Table | None = None,
        guards: Mapping[str, Callable[[RankVars, Mapping[str, Any]], bool]] | None = None,
        updates: Mapping[str, Callable[[RankVars, Mapping[str, Any]], RankVars]] | None = None,
    ) -> None:
        if config.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {config.ranks}")
        if config.channels not in CHANNEL_FIFOS:
            raise ValueError(f"channels must be one of {', '.join(CHANNELS)}, got {config.channels!r}")
        b = config.bounds
        if b.sync_interval < 1 or b.tokens < 1 or b.requests < 0 or b.cycles < 0:
            raise ValueError(f"bad bounds {b}")
        self.config = config
        self.variant: Variant = get_variant(config.variant)
        self.table: Table = table if table is not None else self.variant.table
        self.guards = guards if guards is not None else GUARDS
        self.updates = updates if updates is not None else UPDATES
        self.n = config.ranks
        self.ordered = config.channels == "ordered"
        self.nq, self.f_add, self.f_ctrl, self.f_wave = CHANNEL_FIFOS[config.channels]
        self.mode = PauseMode(config.mode)
        self.K = b.sync_interval
        self.T = b.tokens
        self.R = b.requests
        self.C = b.cycles
        self.clear = b.clear_cache
        self.client_aborts = b.client_aborts
        self.init_transfer = b.init_transfer
        self.stray_resume = b.stray_resume
        self.repeat_resume = b.repeat_resume
        self.failures = b.failures
        self.pause_during_update = b.pause_during_update
        self.resume_during_update = b.resume_during_update
        self.track_owed = self.variant.untracked_replies
        self.worker_args = self.variant.worker_flags_decide
        if b.failures < 0:
            raise ValueError(f"bad bounds {b}: failures must be >= 0")
        self._cache: dict[tuple[Any, ...], tuple[Transition | None, RankVars]] = {}
        self._wcache: dict[tuple[WorkerVars, WorkerEvent], WorkerVars] = {}
        # non-vacuity witnesses, set while exploring
        self.seen_all_verified = False
        self.seen_update_with_wave_in_flight = False

    # ------------------------------------------------------------------ state construction

    def initial(self) -> G:
        """Every rank running and idle, wave 0, no messages, controller idle, no request sent."""
        wk = WorkerVars(WorkerState.READY, initialized=not self.init_transfer)
        r = Rank(RankVars(), "", (), (), ((),) * self.nq, (), NOT_SENT, 0, wk)
        return G(
            (r,) * self.n,
            ((),),
            (0, False),
            (0, False, 0, False, ()),
            Ctrl(IDLE, 0, 0, not self.init_transfer, False, False, 0, False, 0),
            ("", NOT_SENT),
            (),
            (),
        )

    # ------------------------------------------------------------------ the table

    def fire(
        self, i: int, v: RankVars, event: RankEvent, extra: tuple[tuple[str, Any], ...]
    ) -> tuple[Transition | None, RankVars]:
        """Fire ``event`` on rank ``i`` with variables ``v`` through the table: ``(transition, new vars)``;
        an illegal event gives ``(None, vars in ERROR)`` (the sticky error state)."""
        key = (v, event, i, extra)
        r = self._cache.get(key)
        if r is None:
            args: dict[str, Any] = {"rank": i, "dp_size": self.n, "sync_interval": self.K}
            args.update(extra)
            tr = select(self.table, v, event, args, self.guards)
            if tr is None:
                r = (None, v._replace(state=RankState.ERROR))
            else:
                r = (tr, apply(v, tr, args, self.updates))
            self._cache[key] = r
        return r

    def worker_fire(self, wv: WorkerVars, event: WorkerEvent) -> WorkerVars:
        """Fire ``event`` on a rank's worker machine (:data:`weightsync.spec.worker.WORKER_TABLE`); an
        illegal call leaves it in ``error``."""
        key = (wv, event)
        r = self._wcache.get(key)
        if r is None:
            tr = select_transition(WORKER_TABLE, wv.state, event, wv, {}, WORKER_GUARDS)
            r = (
                wv._replace(state=WorkerState.ERROR)
                if tr is None
                else apply_transition(wv, tr, {}, WORKER_UPDATES)
            )
            self._wcache[key] = r
        return r

    # ------------------------------------------------------------------ successors

    def successors(self, s: G) -> list[tuple[Label, G]]:
        """Every enabled transition of ``s`` as ``(label, next_state)``, in a deterministic order:
        rank inputs and steps (rank by rank), collective completions, the coordinator, the front-end,
        the controller and the trainer. Transitions that change nothing (an idle loop pass) are omitted."""
        out: list[tuple[Label, G]] = []
        n = self.n
        ranks = s.ranks
        for i in range(n):
            rk = ranks[i]
            if rk.blocked or rk.vars.state is RankState.ERROR:
                continue
            for f, q in enumerate(rk.inq):
                if q:
                    out.append((("recv", i, f), self._recv(s, i, f)))
                    if (
                        s.ctrl.failures_used < self.failures
                        and q[0][0] == "U"
                        and q[0][1] in ("start_weight_update", "finish_weight_update")
                        and (
                            self.worker_args
                            or rk.vars.state in (RankState.VERIFIED, RankState.FAILED, RankState.UPDATING)
                        )
                    ):
                        out.append((("recv", i, f, "fail"), self._recv(s, i, f, fail=True)))
            t = self._step(s, i)
            if t is not None:
                out.append((("step", i), t))
        # collectives
        k0 = ranks[0].blocked
        if (
            k0
            and all(r.blocked == k0 for r in ranks)
            and (k0 in DP_KINDS or (k0 in TRANSFER_KINDS and s.trainer[0] == k0))
        ):
            out.append((("done", k0), self._complete(s, k0)))
            if k0 in TRANSFER_KINDS and s.ctrl.failures_used < self.failures:
                out.append((("done", k0, "fail"), self._complete(s, k0, fail=True)))
        self._timeouts(s, out)
        # coordinator
        for f, q in enumerate(s.coord_q):
            if q:
                out.append((("coord", -1, f), self._coord_recv(s, -1, f)))
        if not self.ordered:
            for i in range(n):
                if ranks[i].outq:
                    out.append((("coord", i, 0), self._coord_recv(s, i, 0)))
        # front-end
        bw, brun, nxt, gated, cab = s.front
        if nxt < self.R and not gated and not self._init_holds_front(s):
            for i in range(n):
                out.append((("send", i), self._send_request(s, i)))
        if (bw, brun) != s.coord:
            out.append((("refresh",), s._replace(front=(s.coord[0], s.coord[1], nxt, gated, cab))))
        if len(cab) < self.client_aborts:
            for r in range(nxt):
                if r not in cab and r not in s.done and r not in s.aborted:
                    i = self._holder(s, r)
                    if i >= 0:
                        out.append((("abort", i, r), self._send_abort(s, i, r)))
        # controller and trainer
        self._controller(s, out)
        if self.stray_resume or self.repeat_resume:
            return [(label, self._settle(t)) for label, t in out]
        return out

    def _settle(self, s: G) -> G:
        """Reduction (with stray or repeated resumes only): a resume at the head of a rank's controller FIFO
        that the rank takes as a no-op (see :meth:`_deliver_now`) is received at once. It is independent
        of every other transition (it changes no rank variable, and no other transition can change which
        row it takes: the rank leaves its state only through a later controller call, queued behind it),
        so exploring it first loses no reachable state other than those that differ only in the
        controller's view of that reply."""
        w: _Work | None = None
        for i in range(self.n):
            while True:
                rk = (w.ranks if w is not None else s.ranks)[i]
                f = self.f_ctrl
                q = rk.inq[f]
                if rk.blocked or not q or q[0][0] != "U" or q[0][1] != "resume":
                    break
                if w is None:
                    w = _Work(s)
                w.untracked = q[0][2] == RETRY
                w.ranks[i] = rk.with_inq((*rk.inq[:f], q[1:], *rk.inq[f + 1 :]))
                if not self._deliver_now(w, i, "resume", queued=True):
                    w.ranks[i] = rk
                    break
        if w is None:
            return s
        w.untracked = False
        return w.freeze()

    # -- ranks

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
        elif eff == "emit_wave_complete":
            if i == 0:  # the wave that ended is the one before the rank's new current_wave
                self._to_coord(w, i, ("wave_complete", rk.vars.current_wave - 1, i))
        elif eff == "emit_start_wave":
            self._to_coord(w, i, ("start_wave", rk.vars.current_wave, i))
        elif eff == "front_end_gate":
            w.front = (w.front[0], w.front[1], w.front[2], True, w.front[4])
        elif eff == "front_end_ungate":
            w.front = (w.front[0], w.front[1], w.front[2], False, w.front[4])
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
        common: tuple[tuple[str, Any], ...] = ()
        if kind == "dp_sync":
            su = sum(unfinished_for_sync(r.vars.pause_state, len(r.waiting), len(r.running)) for r in ranks)
            sp = sum(1 for r in ranks if r.vars.pending_pause)
            common = (("sum_pending_pause", sp), ("sum_unfinished", su))
        elif kind == "resume_barrier":
            mu = max(unfinished_for_sync(r.vars.pause_state, len(r.waiting), len(r.running)) for r in ranks)
            mw = max(r.vars.current_wave for r in ranks)
            common = (("max_unfinished", mu), ("max_wave", mw))
        if fail:
            common = (("phase", FAIL_PHASE[kind]),)
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
        wave, running = w.coord
        kind = msg[0]
        if kind == "FIRST_REQ":
            exclude, mw = msg[1], msg[2]
            if mw < wave or not self.variant.first_req_exclusion:
                exclude = -1  # vLLM 0.32: bytes identity vs int index, never equal (core.py:2288)
            if not running:
                if (
                    self.variant.coordinator_latches
                ):  # issue #51476; vLLM 0.32 coordinator.py:363-375 does not
                    w.coord = (wave, True)
                self._broadcast(w, wave, exclude)
        elif kind == "start_wave":
            sw, sender = msg[1], msg[2]
            if sw > wave or (sw == wave and not running):
                w.coord = (sw, True)
                self._broadcast(w, sw, sender)
        elif kind == "wave_complete" and wave <= msg[1]:
            w.coord = (msg[1] + 1, False)
        return w.freeze()

    def _broadcast(self, w: _Work, wave: int, exclude: int) -> None:
        f = self.f_wave
        for i in range(self.n):
            rk = w.ranks[i]
            q = rk.inq[f]
            w.ranks[i] = rk.with_inq((*rk.inq[:f], (*q, ("W", wave, exclude)), *rk.inq[f + 1 :]))

    # -- front-end

    def _send_request(self, s: G, i: int) -> G:
        bw, brun, nxt, gated, cab = s.front
        w = _Work(s)
        f = self.f_add
        rk = w.ranks[i]
        w.ranks[i] = rk.with_inq((*rk.inq[:f], (*rk.inq[f], ("ADD", nxt, bw)), *rk.inq[f + 1 :]))
        if not brun:
            msg = ("FIRST_REQ", i, bw)
            w.coord_q = ((*w.coord_q[0], msg),)
            brun = True
        w.front = (bw, brun, nxt + 1, gated, cab)
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
        init returned."""
        return s.ctrl.phase == INIT and s.ctrl.cycles_started == 0 and not self._all_replied(s, INIT)

    # -- controller and trainer

    def _all_replied(self, s: G, phase: int) -> bool:
        if not all(r.status in (REPLIED, FAILED_REPLY) for r in s.ranks):
            return False
        return phase not in (UPDATE, INIT) or s.trainer[1] in (REPLIED, FAILED_REPLY)

    def _phase_failed(self, s: G) -> bool:
        """Some rank (or the trainer) answered the current phase's call with an error."""
        return any(r.status == FAILED_REPLY for r in s.ranks) or s.trainer[1] == FAILED_REPLY

    def _controller(self, s: G, out: list[tuple[Label, G]]) -> None:
        """The RL controller (reference s9): pause -> [init] -> start -> update -> finish -> resume, or pause
        -> resume. After a failed init it initialises again; after any other failure it carries the round
        through (a failed rank refuses the later calls) and then runs a new round with the same version
        before it resumes, so a resume never meets a failed rank."""
        phase, started, rounds, inited, stray, repeat, fails, recovering, xused = s.ctrl
        nexts: list[tuple[int, Ctrl]] = []
        done = self._all_replied(s, phase)
        failed = done and phase != IDLE and self._phase_failed(s)
        rec = recovering or failed

        def to(ph: int, started_: int = started, rounds_: int = rounds, **kw: Any) -> tuple[int, Ctrl]:
            return (
                ph,
                Ctrl(
                    ph,
                    started_,
                    rounds_,
                    kw.get("inited", inited),
                    kw.get("stray", stray),
                    kw.get("repeat", repeat),
                    fails,
                    kw.get("recovering", rec),
                    xused,
                ),
            )

        if phase == IDLE or (phase == RESUME and done):
            if started < self.C:
                nexts.append(to(PAUSE, started + 1))
                if not inited and phase == IDLE and s.front[2] == 0:
                    nexts.append(to(INIT, inited=True))  # init before serving
            if self.stray_resume and not stray:
                nexts.append(to(RESUME, stray=True))  # a `finally` resume
        elif phase == PAUSE and done:
            if inited:
                nexts.append(to(START))
            else:
                nexts.append(to(INIT, inited=True))  # lazy init, while paused
            nexts.append(to(RESUME))
        elif phase == INIT and done:
            if failed:
                nexts.append(to(INIT))  # the transfer group is gone: initialise again
            elif rec:
                nexts.append(to(START))  # a failed rank needs a new round before it may resume
            elif started == 0:
                if started < self.C:
                    nexts.append(to(PAUSE, started + 1))
            else:
                nexts.append(to(START))
                nexts.append(to(RESUME))
        elif phase == START and done:
            nexts.append(to(UPDATE))
        elif phase == UPDATE and done:
            nexts.append(to(FINISH))
        elif phase == FINISH and done:
            if failed:
                nexts.append(to(START))  # a new round, same version
            else:
                nexts.append(to(RESUME, rounds_=rounds + 1, recovering=False))
        # The controller's fan-out is atomic under both channel semantics: only the controller writes the
        # controller->rank FIFOs, so sending to every rank at once and letting each rank receive at its
        # own time reaches the same interleavings as per-rank sends (the receipts stay independent).
        for nph, ctrl2 in nexts:
            if self.variant.pause_in_front_end and nph in (PAUSE, RESUME):
                out.append((("fe", PHASE_CALL[nph]), self._front_end_call(s, nph, ctrl2)))
            else:
                out.append((("fan", PHASE_CALL[nph], -1), self._fan_out(s, ctrl2, None, True)))
        # a retried resume while the first is outstanding (its replies are not counted)
        if (
            self.repeat_resume
            and not repeat
            and phase == RESUME
            and not done
            and not self.variant.pause_in_front_end
        ):
            ctrl3 = s.ctrl._replace(repeat_resume_used=True)
            out.append((("retry", PHASE_CALL[RESUME]), self._retry(s, ctrl3)))
        # a second pause, or a resume, while a round is in flight (its replies are not counted)
        if phase in (START, UPDATE, FINISH) and not self.variant.pause_in_front_end:
            for flag, bit, call in (
                (self.pause_during_update, X_PAUSE, "pause"),
                (self.resume_during_update, X_RESUME, "resume"),
            ):
                if flag and not xused & bit:
                    ctrl4 = s.ctrl._replace(extra_used=xused | bit)
                    out.append((("extra", call), self._retry(s, ctrl4, call)))

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
        arg = (
            ctrl.update_rounds + 1 if phase == FINISH else 0
        )  # finish carries the version: successful rounds + 1
        for i in targets:
            rk = w.ranks[i].with_status(SENT, w.ranks[i].pz)
            w.ranks[i] = rk
            if not self._deliver_now(w, i, call):
                w.ranks[i] = rk.with_inq((*rk.inq[:f], (*rk.inq[f], ("U", call, arg)), *rk.inq[f + 1 :]))
        if phase in (UPDATE, INIT) and (trainer or target is None):
            w.trainer = ("weight_broadcast" if phase == UPDATE else "transfer_init", SENT)
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

    # ------------------------------------------------------------------ properties

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

    # ------------------------------------------------------------------ symmetry

    def canon(self, s: G) -> G:
        """Canonical representative under permutations of ranks 1..N-1 (rank 0 emits wave_complete and
        reports the wave's start, so it stays fixed).

        Ranks 1..N-1 are sorted by their slice's fields that name no rank (:func:`_slice_key`), ties broken
        by :meth:`_sym_key`, which sees the rank's FIFOs and every reference to it elsewhere (the
        coordinator's FIFOs) with rank ids renamed relative to the rank itself, so the order does not
        depend on the ranks' indices; the order is then applied by :meth:`permute`. The
        result is always in the orbit of ``s`` (``permute`` is an automorphism of the transition relation,
        checked by ``tests/test_model_symmetry.py``); ranks with equal keys are interchangeable at N <= 3."""
        n = self.n
        if n <= 2:
            return s
        ranks = s.ranks
        # The slice without rank ids decides the order unless two ranks tie on it (the full key starts
        # with the same fields, so the order is the full key's either way).
        if n == 3:  # the common case, without sorting
            r1, r2 = ranks[1], ranks[2]
            a, b = _slice_key(r1), _slice_key(r2)
            if a != b and a < b:
                return s
            plain = not _names_a_rank(s)  # then renaming changes no message: compare and swap as they are
            if a == b:
                if plain:
                    a, b = (r1[4], r1[5]), (r2[4], r2[5])
                else:
                    a, b = self._sym_key(s, 1), self._sym_key(s, 2)
                if a <= b:
                    return s
            if plain:
                return G((ranks[0], r2, r1), *s[1:])
            return self._permute(s, (0, 2, 1))
        cheap = {j: _slice_key(ranks[j]) for j in range(1, n)}
        order = sorted(range(1, n), key=cheap.__getitem__)
        if any(cheap[a] == cheap[b] for a, b in itertools.pairwise(order)):
            order = sorted(range(1, n), key=lambda j: (cheap[j], self._sym_key(s, j)))
        if order == list(range(1, n)):
            return s
        perm = [0] * n  # old -> new
        for new, old in enumerate(order, start=1):
            perm[old] = new
        return self._permute(s, perm)

    @staticmethod
    def _sym_key(s: G, j: int) -> tuple[Any, ...]:
        """Every FIFO of the state as seen from rank ``j``, with rank ids relative to ``j`` (-2 is ``j``
        itself, 0 and negative values stay, any other rank is -3): ``j``'s own, rank 0's, the other ranks'
        (as a sorted tuple, so their indices do not matter) and the coordinator's. Used after
        :func:`_slice_key` to break its ties; at N <= 3 equal keys mean the two ranks are interchangeable."""

        def rel(x: int) -> int:
            return -2 if x == j else (x if x <= 0 else -3)

        def rmsg(m: tuple[Any, ...]) -> tuple[Any, ...]:
            return _rename(m, rel)

        def fifos(r: Rank) -> tuple[Any, ...]:
            return (tuple(tuple(rmsg(m) for m in q) for q in r.inq), tuple(rmsg(m) for m in r.outq))

        ranks = s.ranks
        others = tuple(sorted(fifos(ranks[k]) for k in range(1, len(ranks)) if k != j))
        refs = tuple(tuple(rmsg(m) for m in q) for q in s.coord_q)
        return (fifos(ranks[j]), fifos(ranks[0]), others, refs)

    def permute(self, s: G, perm: Sequence[int]) -> G:
        """``s`` with rank ``i`` renamed ``perm[i]`` (``perm[0] == 0``): the rank slices move, and every
        message naming a rank is renamed (START_DP_WAVE's ``exclude``, FIRST_REQ's sender, the sender of
        ``start_wave`` / ``wave_complete``).

        Raises:
            ValueError: ``perm`` is not a permutation of ``range(N)`` fixing 0.
        """
        n = self.n
        if sorted(perm) != list(range(n)) or perm[0] != 0:
            raise ValueError(f"perm {list(perm)!r} is not a permutation of range({n}) fixing rank 0")
        return self._permute(s, perm)

    def _permute(self, s: G, perm: Sequence[int]) -> G:
        """:meth:`permute` without checking ``perm``."""
        n = self.n

        def ren(x: int) -> int:
            return perm[x] if x >= 0 else x

        def fix_msg(m: tuple[Any, ...]) -> tuple[Any, ...]:
            return _rename(m, ren)

        def fix_q(q: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
            return tuple(fix_msg(m) for m in q) if any(m[0] in _RANK_NAMING for m in q) else q

        new_ranks: list[Rank | None] = [None] * n
        for old, r in enumerate(s.ranks):
            inq = tuple(fix_q(q) for q in r.inq)
            new_ranks[perm[old]] = Rank(r[0], r[1], r[2], r[3], inq, fix_q(r.outq), r[6], r[7], r[8], r[9])
        coord_q = tuple(fix_q(q) for q in s.coord_q)
        return G(tuple(r for r in new_ranks if r is not None), coord_q, *s[2:])


def _rename(m: tuple[Any, ...], f: Callable[[int], int]) -> tuple[Any, ...]:
    """Message ``m`` with the rank it names (see :data:`_RANK_NAMING`) mapped through ``f``."""
    k = m[0]
    if k == "W" or k in _SENDER_LAST:
        return (k, m[1], f(m[2]))
    if k == "FIRST_REQ":
        return (k, f(m[1]), m[2])
    return m


def _names_a_rank(s: G) -> bool:
    """Some message in flight names a rank other than 0 (START_DP_WAVE's ``exclude``, FIRST_REQ's sender,
    the sender of ``start_wave`` / ``wave_complete``): only then does renaming ranks change a message."""
    naming = _RANK_NAMING
    for qs in (s.coord_q, *(r.inq for r in s.ranks), *((r.outq,) for r in s.ranks)):
        for q in qs:
            for m in q:
                if m[0] in naming and (m[1] if m[0] == "FIRST_REQ" else m[2]) > 0:
                    return True
    return False


def _slice_key(r: Rank) -> tuple[Any, ...]:
    """The fields of a rank's slice that name no rank (the first part of the symmetry order)."""
    return (r.vars, r.blocked, r.waiting, r.running, r.status, r.pz, r.worker, r.owed)


class _Work:
    """Mutable scratch copy of a global state used while building one successor."""

    __slots__ = ("aborted", "coord", "coord_q", "ctrl", "done", "front", "ranks", "trainer", "untracked")

    def __init__(self, s: G) -> None:
        self.ranks = list(s.ranks)
        self.coord_q = s.coord_q
        self.coord = s.coord
        self.front = s.front
        self.ctrl = s.ctrl
        self.trainer = s.trainer
        self.done = list(s.done)
        self.aborted = list(s.aborted)
        self.untracked = False

    def freeze(self) -> G:
        done = self.done
        aborted = self.aborted
        return G(
            tuple(self.ranks),
            self.coord_q,
            self.coord,
            self.front,
            self.ctrl,
            self.trainer,
            tuple(sorted(done)) if len(done) > 1 else tuple(done),
            tuple(sorted(aborted)) if len(aborted) > 1 else tuple(aborted),
        )


class Step(NamedTuple):
    """One counterexample step as a structured record.

    Attributes:
        process: who acts ("rank 1", "controller", "front-end", "coordinator", "trainer", "ranks 0,1").
        action: what it does ("receives", "steps", "enters", "fans out", "sends", "completes", ...).
        message: the message, call or collective involved (e.g. ``START_DP_WAVE(wave=1, exclude=0)``).
        detail: what the table did (guard, state change, effects) or the coordinator's reaction.
        lane_from: Mermaid lane of the sender for message arrows ("" for notes).
        lanes: Mermaid lanes the step concerns.
    """

    process: str
    action: str
    message: str
    detail: str
    lane_from: str
    lanes: tuple[str, ...]

    @property
    def text(self) -> str:
        """The human-readable one-liner, e.g. ``rank 1 receives START_DP_WAVE(wave=1, exclude=0) (...)``."""
        base = f"{self.process} {self.action} {self.message}".rstrip()
        return f"{base} ({self.detail})" if self.detail else base


def fmt_msg(m: tuple[Any, ...], mode: PauseMode) -> str:
    """A message as text: ``ADD(req=0, wave=1)``, ``START_DP_WAVE(wave=1, exclude=0)``, ``pause(keep)``..."""
    k = m[0]
    if k == "ADD":
        return f"ADD(req={m[1]}, wave={m[2]})"
    if k == "W":
        return f"START_DP_WAVE(wave={m[1]}, exclude={m[2]})"
    if k == "U":
        return f"pause({mode.value})" if m[1] == "pause" else str(m[1])
    if k == "FIRST_REQ":
        return f"FIRST_REQ(exclude={m[1]}, wave={m[2]})"
    if k == "ABORT":
        return f"ABORT(req={m[1]})"
    return f"{k}(wave={m[1]})"


def _lane_of_sender(m: tuple[Any, ...]) -> str:
    return {"ADD": "front-end", "ABORT": "front-end", "W": "coordinator", "U": "controller"}.get(m[0], "")


def message_event(
    model: Model, rk: Rank, m: tuple[Any, ...]
) -> tuple[RankEvent, tuple[tuple[str, Any], ...]]:
    """The table event and its arguments when a rank whose slice is ``rk`` receives message ``m``."""
    if m[0] == "ADD":
        return RankEvent.ADD, (("wave", m[2]),)
    if m[0] == "ABORT":
        return RankEvent.ABORT, ()
    if m[0] == "W":
        return RankEvent.START_DP_WAVE, (("exclude", m[2]), ("wave", m[1]))
    ev = CALL_EVENT[m[1]]
    return ev, model.call_extra(rk, ev)


def describe(model: Model, s: G, label: Label, t: G) -> Step:
    """The :class:`Step` record of the edge ``s --label--> t`` (a successor of ``model``)."""
    kind = label[0]
    mode = model.mode

    def rank_detail(i: int, event: RankEvent, extra: tuple[tuple[str, Any], ...]) -> str:
        before = s.ranks[i].vars
        tr, after = model.fire(i, before, event, extra)
        if tr is None:
            return f"illegal in {before.state.value}: protocol error, rank {i} -> error"
        d = f"{tr.guard}: {before.state.value}->{after.state.value}"
        eff = [e for e in tr.effects if e not in ("execute_step",) and not e.startswith("enter_")]
        if eff:
            d += "; " + ", ".join(eff)
        if before.current_wave != after.current_wave:
            d += f"; wave {before.current_wave}->{after.current_wave}"
        if before.engines_running != after.engines_running:
            d += f"; engines_running={after.engines_running}"
        return d

    if kind == "recv":
        i, f = label[1], label[2]
        m = s.ranks[i].inq[f][0]
        ev, extra = message_event(model, s.ranks[i], m)
        d = rank_detail(i, ev, extra)
        if t.ranks[i].blocked and not s.ranks[i].blocked:
            d += f"; enters {t.ranks[i].blocked}"
        return Step(f"rank {i}", "receives", fmt_msg(m, mode), d, _lane_of_sender(m), (f"rank {i}",))
    if kind == "step":
        i = label[1]
        rk = s.ranks[i]
        has = model._has_work(rk)
        d = rank_detail(i, RankEvent.STEP, (("has_work", has),))
        batch = "a real batch" if has else "a dummy batch"
        after = t.ranks[i]
        msg = after.blocked if after.blocked else ""
        return Step(f"rank {i}", f"steps ({batch}) and enters", msg, d, "", (f"rank {i}",))
    if kind == "done":
        k = label[1]
        members = ",".join(str(i) for i in range(model.n))
        proc = f"ranks {members}" + (" and trainer" if k in TRANSFER_KINDS else "")
        args = ""
        ranks = s.ranks
        if k == "dp_sync":
            su = sum(unfinished_for_sync(r.vars.pause_state, len(r.waiting), len(r.running)) for r in ranks)
            sp = sum(1 for r in ranks if r.vars.pending_pause)
            args = f"(sum_unfinished={su}, sum_pending_pause={sp})"
        elif k == "resume_barrier":
            mu = max(unfinished_for_sync(r.vars.pause_state, len(r.waiting), len(r.running)) for r in ranks)
            mw = max(r.vars.current_wave for r in ranks)
            args = f"(max_unfinished={mu}, max_wave={mw})"
        states = ", ".join(
            f"r{i}:{t.ranks[i].vars.state.value}/w{t.ranks[i].vars.current_wave}" for i in range(model.n)
        )
        lanes = tuple(f"rank {i}" for i in range(model.n)) + (("trainer",) if k in TRANSFER_KINDS else ())
        return Step(proc, "complete", k + args, states, "", lanes)
    if kind == "coord":
        src, f = label[1], label[2]
        m = s.coord_q[f][0] if src < 0 else s.ranks[src].outq[0]
        frm = "front-end" if m[0] == "FIRST_REQ" else f"rank {m[2]}"
        w0, r0 = s.coord
        w1, r1 = t.coord
        bc = [
            fmt_msg(q[-1], mode)
            for q, q0 in zip((r.inq[-1] for r in t.ranks), (r.inq[-1] for r in s.ranks), strict=True)
            if len(q) > len(q0)
        ]
        if (w0, r0) == (w1, r1) and not bc:
            d = f"ignored: current_wave={w0}, running={r0}"
        else:
            d = f"current_wave {w0}->{w1}, running {r0}->{r1}"
            if bc:
                d += f"; broadcasts {bc[0]}"
        return Step("coordinator", "receives", fmt_msg(m, mode) + f" from {frm}", d, frm, ("coordinator",))
    if kind == "send":
        i = label[1]
        bw, brun, nxt = s.front[:3]
        d = f"stamped with believed wave {bw}"
        if not brun:
            d += f"; believes engines idle: FIRST_REQ(exclude={i}, wave={bw}) to the coordinator"
        return Step(
            "front-end", "sends", f"ADD(req={nxt}, wave={bw}) to rank {i}", d, "front-end", (f"rank {i}",)
        )
    if kind == "refresh":
        return Step(
            "front-end",
            "refreshes",
            "stats",
            f"believes wave={s.coord[0]}, running={s.coord[1]}",
            "",
            ("front-end",),
        )
    if kind == "fan":
        call, i = label[1], label[2]
        msg = f"pause({mode.value})" if call == "pause" else call
        if i < 0:
            return Step(
                "controller",
                "fans out",
                f"{msg} to every rank (atomic)",
                "",
                "controller",
                tuple(f"rank {j}" for j in range(model.n)),
            )
        return Step("controller", "fans out", f"{msg} to rank {i}", "", "controller", (f"rank {i}",))
    if kind == "fe":
        call = label[1]
        msg = f"pause({mode.value})" if call == "pause" else call
        d = "; ".join(
            f"r{i}:{s.ranks[i].vars.state.value}->{t.ranks[i].vars.state.value}" for i in range(model.n)
        )
        return Step(
            "front-end",
            "applies",
            f"{msg} to every rank machine (no message)",
            d,
            "",
            tuple(f"rank {j}" for j in range(model.n)),
        )
    if kind == "trainer":
        if t.trainer[0] == "transfer_init":
            return Step("trainer", "enters", "transfer_init", "trainer_init", "", ("trainer",))
        return Step("trainer", "enters", "weight_broadcast", "trainer_send_weights", "", ("trainer",))
    if kind in ("retry", "extra"):
        call = label[1]
        msg = f"pause({mode.value})" if call == "pause" else call
        why = "a retry while the first is outstanding" if kind == "retry" else "while a round is in flight"
        return Step(
            "controller",
            "fans out",
            f"{msg} to every rank again (untracked)",
            why,
            "controller",
            tuple(f"rank {j}" for j in range(model.n)),
        )
    if kind == "timeout":
        i, k = label[1], label[2]
        who = "trainer" if i < 0 else f"rank {i}"
        return Step(who, "times out of", k, "the collective can never complete", "", (who,))
    if kind == "abort":
        i, r = label[1], label[2]
        return Step(
            "front-end",
            "sends",
            f"ABORT(req={r}) to rank {i}",
            "the client aborts",
            "front-end",
            (f"rank {i}",),
        )
    raise ValueError(f"unknown label {label!r}")  # pragma: no cover
