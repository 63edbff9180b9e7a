"""The model's state: the constants, :class:`Bounds`, :class:`Config`, one rank's slice (:class:`Rank`), the
controller's (:class:`Ctrl`), the coordinator's (:class:`Coordinator`), the front-end's (:class:`FrontEnd`), the
trainer's (:class:`Trainer`), the global state (:class:`GlobalState`, alias ``G``) and its mutable scratch copy
(:class:`_ScratchState`)."""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

from weightsync.spec.calls import CALL_EVENT as CALL_EVENT
from weightsync.spec.calls import PHASE_CALL as PHASE_CALL
from weightsync.spec.calls import Phase
from weightsync.spec.collectives import DONE_EVENT as DONE_EVENT
from weightsync.spec.collectives import DP_KINDS as DP_KINDS
from weightsync.spec.collectives import ENTER_EFFECT as ENTER_EFFECT
from weightsync.spec.collectives import FAIL_PHASE as FAIL_PHASE
from weightsync.spec.collectives import TRANSFER_KINDS as TRANSFER_KINDS
from weightsync.spec.controller import X_PAUSE as X_PAUSE
from weightsync.spec.controller import X_RESUME as X_RESUME
from weightsync.spec.rank import RankVars
from weightsync.spec.states import PauseMode
from weightsync.spec.worker import WorkerVars

# Controller phases (the spec's :class:`~weightsync.spec.controller.Phase`, as ints in the state), the call
# each makes and the rank event each call is (spec data: :mod:`weightsync.spec.controller`).
IDLE, PAUSE, START, UPDATE, FINISH, RESUME, INIT = (int(p) for p in Phase)
# Controller per-rank call status (FAILED_REPLY: the call returned an error: a refusal or a failure).
NOT_SENT, SENT, REPLIED, SPURIOUS, FAILED_REPLY = 0, 1, 2, 3, 4
#: The third field of a controller message ("U", call, arg): the version a finish_weight_update carries,
#: RETRY for a resume re-sent by an orchestrator while its first is outstanding (its reply is not counted).
RETRY = -1
#: Rank effects that are worker operations that may fail (when Bounds.failures allows one): those with a
#: ``transfer_failed`` phase that are no collective (spec/collectives.py FAIL_PHASE; a transfer collective
#: fails through its own completion).
FAILABLE_EFFECTS = frozenset(k for k in FAIL_PHASE if k not in TRANSFER_KINDS)
#: The controller calls whose row runs such an operation (vLLM 0.32 names the call and the worker
#: operation alike, ``v1/worker/gpu_worker.py:1507, 1587``).
FAILABLE_CALLS = frozenset(c for c in CALL_EVENT if c in FAILABLE_EFFECTS)

# Per-socket rank input FIFOs.
F_ADD, F_CTRL, F_WAVE = 0, 1, 2
#: Channel semantics -> (number of rank input FIFOs, FIFO of ADD/ABORT, of utility calls, of START_DP_WAVE).
CHANNEL_FIFOS: dict[str, tuple[int, int, int, int]] = {
    "per-socket": (3, F_ADD, F_CTRL, F_WAVE),
    "one-api-server": (2, 0, 0, 1),
    "ordered": (1, 0, 0, 0),
}
CHANNELS = tuple(CHANNEL_FIFOS)


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
            sent it to; vLLM 0.32 v1/engine/core.py:1685-1686). 0 in the default proofs.
        init_transfer: the controller calls ``init_weight_transfer_engine`` once (joined by the trainer),
            either before the first request (the front-end waits for it) or lazily in the first cycle
            between pause and start; when False the transfer engine is assumed initialised at start.
        stray_resume: the controller may issue one ``resume`` that no pause preceded (an orchestrator's
            ``finally`` path, as prime-rl's resume in ``finally``), when idle or after a completed resume, with requests
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
        repeat_pause: the controller may send ``pause`` to every rank once more while its pause is
            outstanding or after it returned, before the round (a client retry, a second controller, or,
            under ``--mode any``, a pause in another mode while paused); its replies are not counted.
        init_while_serving: after a completed resume the controller may call ``init_weight_transfer_engine``
            once more, joined by the trainer, while the engines serve and with no pause (a restarted
            trainer reconnecting); client requests are not held for it. Ranks that served refuse it (the
            init gate, guard ``alone_or_never_served``); the controller then pauses and inits while paused.
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
    repeat_pause: bool = False
    init_while_serving: bool = False


class AnyMode(Enum):
    """The controller picks the pause mode at each pause it sends (``weightsync check --mode any``): an RL
    orchestrator that aborts at one pause and keeps at the next, or pauses again in another mode."""

    ANY = "any"


ANY_MODE = AnyMode.ANY
#: a model's pause-mode setting: one mode for every pause, or :data:`ANY_MODE`
ModeSetting = PauseMode | AnyMode


class Config(NamedTuple):
    """One model instance: variant, number of DP ranks, pause mode (or :data:`ANY_MODE`), channel
    semantics and bounds."""

    variant: str = "two-phase-epoch"
    ranks: int = 2
    mode: ModeSetting = PauseMode.KEEP
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
        pause_ghost: ghost for the pause properties: 0 no pause in effect, 1 the rank received pause (and no
            resume since), 2 its pause reply was sent; 3 and 4 are 1 and 2 for a wait-mode pause that left
            requests queued on the rank when it arrived (:data:`GHOST_RECEIVED`, :data:`GHOST_REPLIED`).
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
    pause_ghost: int
    worker: WorkerVars
    owed: int = 0

    # Field setters for the successor function's hot paths (``_replace`` is several times slower).
    def with_vars(self, rank_vars: RankVars) -> Rank:
        """This slice with protocol variables ``rank_vars``."""
        return _new_rank(
            Rank, (rank_vars, self[1], self[2], self[3], self[4], self[5], self[6], self[7], self[8], self[9])
        )

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

    def with_status(self, status: int, pause_ghost: int) -> Rank:
        """This slice with controller-call status ``status`` and pause ghost ``pause_ghost``."""
        return _new_rank(
            Rank,
            (self[0], self[1], self[2], self[3], self[4], self[5], status, pause_ghost, self[8], self[9]),
        )

    def with_outq(self, outq: tuple[tuple[Any, ...], ...]) -> Rank:
        """This slice with the FIFO to the coordinator ``outq``."""
        return _new_rank(
            Rank, (self[0], self[1], self[2], self[3], self[4], outq, self[6], self[7], self[8], self[9])
        )

    def with_fifos(
        self, inq: tuple[tuple[tuple[Any, ...], ...], ...], outq: tuple[tuple[Any, ...], ...]
    ) -> Rank:
        """This slice with input FIFOs ``inq`` and the FIFO to the coordinator ``outq``."""
        return _new_rank(
            Rank, (self[0], self[1], self[2], self[3], inq, outq, self[6], self[7], self[8], self[9])
        )


#: ``tuple.__new__``: builds a NamedTuple from a tuple of its fields without the generated ``__new__``'s
#: Python-level call (the successor function's hot paths).
_new_rank = _new_tuple = tuple.__new__


class Ctrl(NamedTuple):
    """The RL controller's state (see :class:`GlobalState`): the spec's :class:`~weightsync.spec.controller.CtrlVars`
    plus the model's failure-injection counter, advanced only by the controller table.

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
        extra_used: the controller's bits (:data:`weightsync.spec.controller.X_PAUSE` and the others).
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


#: ``Rank.pause_ghost`` values: received (no reply yet) and replied, each plain or for a wait-mode pause that
#: left requests it found queued (property ``wait_drains``).
GHOST_RECEIVED, GHOST_REPLIED, GHOST_QUEUED, GHOST_QUEUED_REPLIED = 1, 2, 3, 4
#: The replied ghost of each received one (the ``reply_pause`` effect).
GHOST_REPLY = {GHOST_RECEIVED: GHOST_REPLIED, GHOST_QUEUED: GHOST_QUEUED_REPLIED}
#: Ghosts of a pause whose reply was sent.
GHOSTS_REPLIED = frozenset({GHOST_REPLIED, GHOST_QUEUED_REPLIED})
#: Under :data:`ANY_MODE` a ghost also names its pause's mode: ``base + GHOST_STRIDE * (1 + k)`` for mode
#: ``GHOST_MODES[k]`` (a model with one mode keeps the plain values, so its state space is unchanged).
GHOST_STRIDE = 8
GHOST_MODES: tuple[PauseMode, ...] = tuple(PauseMode)


def ghost_base(ghost: int) -> int:
    """The ghost without its mode field (0 no pause in effect, else a ``GHOST_*`` value)."""
    return ghost % GHOST_STRIDE


def ghost_with_mode(base: int, mode: PauseMode | None) -> int:
    """Ghost ``base`` carrying ``mode`` (None: a model with one mode, the plain value)."""
    return base if mode is None or base == 0 else base + GHOST_STRIDE * (1 + GHOST_MODES.index(mode))


def ghost_replied(ghost: int) -> int:
    """The ghost after its pause's reply (the ``reply_pause`` effect), its mode field kept."""
    base = ghost_base(ghost)
    return ghost - base + GHOST_REPLY.get(base, base)


#: ``Rank.owed`` bits.
OWE_PAUSE, OWE_RESUME = 1, 2


class Coordinator(NamedTuple):
    """The DP coordinator's state (vLLM's ``DPCoordinator``): the wave it believes current, whether it
    believes the engines running, and whether a publish of them to the front-end is in flight (a row with
    the ``publish_stats`` effect fired and the front-end has not refreshed since; False whenever the
    front-end already believes what the coordinator does). Without one in flight, only the coordinator's
    5 s poll timeout refreshes the front-end (vLLM 0.32 ``v1/engine/coordinator.py:264-290``)."""

    current_wave: int
    engines_running: bool
    publishing: bool = False


class FrontEnd(NamedTuple):
    """The API front-end's state.

    Attributes:
        believed_wave: the wave it stamps requests with (its last stats refresh of the coordinator's).
        believed_running: whether it believes the engines running (else a request also sends FIRST_REQ).
        next_request: the id of the next request the client sends (= requests sent so far).
        gated: it holds new requests (``front_end_gate`` .. ``front_end_ungate``).
        client_aborted: the requests the client aborted, sorted.
    """

    believed_wave: int
    believed_running: bool
    next_request: int
    gated: bool
    client_aborted: tuple[int, ...]


class Trainer(NamedTuple):
    """The trainer's state: the weight-transfer collective it is blocked in (``""`` if none) and the status
    of its part in the controller's current call (NOT_SENT, SENT, REPLIED, SPURIOUS, FAILED_REPLY)."""

    blocked: str
    status: int


#: The trainer outside any collective with no call outstanding.
TRAINER_IDLE = Trainer("", NOT_SENT)


class GlobalState(NamedTuple):
    """Global state.

    Attributes:
        ranks: one :class:`Rank` per DP rank.
        coord_q: the coordinator's input FIFOs other than the ranks' (per-socket: FIRST_REQ from the
            front-end; ordered: the single FIFO of everything sent to the coordinator, with senders).
        coord: the coordinator's :class:`Coordinator`.
        front: the front-end's :class:`FrontEnd`.
        ctrl: the controller's :class:`Ctrl`.
        trainer: the trainer's :class:`Trainer`.
        done: finished requests (sorted).
        aborted: aborted requests (sorted).
    """

    ranks: tuple[Rank, ...]
    coord_q: tuple[tuple[tuple[Any, ...], ...], ...]
    coord: Coordinator
    front: FrontEnd
    ctrl: Ctrl
    trainer: Trainer
    done: tuple[int, ...]
    aborted: tuple[int, ...]

    def with_ranks(self, ranks: tuple[Rank, ...]) -> GlobalState:
        """This state with rank slices ``ranks`` (a hot path: no ``_replace``)."""
        return _new_tuple(GlobalState, (ranks, *self[1:]))

    def with_ranks_and_coord_q(
        self, ranks: tuple[Rank, ...], coord_q: tuple[tuple[tuple[Any, ...], ...], ...]
    ) -> GlobalState:
        """This state with rank slices ``ranks`` and coordinator FIFOs ``coord_q``."""
        return _new_tuple(GlobalState, (ranks, coord_q, *self[2:]))


#: The short name every importer uses.
G = GlobalState


#: A compact transition label; see :meth:`Model.describe` for the human form.
Label = tuple[Any, ...]


class _ScratchState:
    """Mutable scratch copy of a global state used while building one successor."""

    __slots__ = ("aborted", "coord", "coord_q", "ctrl", "done", "front", "ranks", "trainer", "untracked")

    def __init__(self, s: GlobalState) -> None:
        self.ranks = list(s.ranks)
        self.coord_q = s.coord_q
        self.coord = s.coord
        self.front = s.front
        self.ctrl = s.ctrl
        self.trainer = s.trainer
        self.done = list(s.done)
        self.aborted = list(s.aborted)
        self.untracked = False

    def freeze(self) -> GlobalState:
        done = self.done
        aborted = self.aborted
        return GlobalState(
            tuple(self.ranks),
            self.coord_q,
            self.coord,
            self.front,
            self.ctrl,
            self.trainer,
            tuple(sorted(done)) if len(done) > 1 else tuple(done),
            tuple(sorted(aborted)) if len(aborted) > 1 else tuple(aborted),
        )
