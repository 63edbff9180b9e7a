"""Vocabulary of the per-rank protocol: states, events, pause modes, PauseState, collective kinds (their
data: :mod:`weightsync.spec.collectives`).

Names follow vLLM (``START_DP_WAVE``, ``PauseState``, ``pending_pause``, ``ignore_start_dp_wave``,
``engines_running``, ``current_wave``) and torch.distributed.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class RankState(StrEnum):
    """Protocol state of one DP engine rank (weightsync's labels over vLLM's variables).

    - ``running``: ``PauseState.UNPAUSED``; serving, idle or in a wave.
    - ``pausing``: a pause was accepted but running requests still drain (mode ``wait``).
    - ``paused``: nothing is schedulable locally; the rank still honours START_DP_WAVE and keeps
      stepping (dummy batches) until the global check agrees (phase 1 of vLLM PR #39366).
    - ``verified``: the global DP all-reduce agreed that every rank paused and the ranks stopped at the
      same step (phase 2); the pause call has returned. Weight-transfer calls are legal only here.
    - ``updating``: between ``start_weight_update`` and ``finish_weight_update``.
    - ``resuming``: ``resume`` accepted; the rank is in the resume barrier.
    - ``failed``: a weight-transfer round failed on this rank (a transfer collective timed out or was
      aborted, ``start_weight_update`` or ``finish_weight_update`` raised, a version was refused). Its
      weights may be partial: it never steps, queues new requests, drops START_DP_WAVE and refuses
      pause, resume, update and finish with an error reply; a new round (``start_weight_update`` ->
      ``update_weights`` -> ``finish_weight_update``) recovers it without a restart (weightsync).
    - ``error``: sticky after a protocol error.
    """

    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    VERIFIED = "verified"
    UPDATING = "updating"
    RESUMING = "resuming"
    FAILED = "failed"
    ERROR = "error"


class PauseState(IntEnum):
    """vLLM's scheduler ``PauseState`` (vLLM 0.32 ``v1/core/sched/interface.py:24-35``)."""

    UNPAUSED = 0
    PAUSED_NEW = 1  # nothing new scheduled; running requests continue
    PAUSED_ALL = 2  # nothing scheduled


class PauseMode(StrEnum):
    """``pause_generation(mode=...)`` (vLLM 0.32 ``v1/engine/async_llm.py:952-984``)."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


#: PauseState each mode sets (vLLM 0.32 ``v1/engine/core.py:2094``).
PAUSE_STATE_OF_MODE: dict[PauseMode, PauseState] = {
    PauseMode.ABORT: PauseState.PAUSED_NEW,
    PauseMode.WAIT: PauseState.PAUSED_NEW,
    PauseMode.KEEP: PauseState.PAUSED_ALL,
}
#: How a request in flight when the pause arrives may finish, per mode (vLLM 0.32 ``pause_scheduler``,
#: ``v1/engine/core.py:2061-2103``): ``abort`` finishes it at once as aborted (``FinishReason.ABORT``); ``wait``
#: lets it run to its own end (``length`` or ``stop``) before the pause returns; ``keep`` freezes it under
#: PAUSED_ALL and it runs to its own end after the resume. (vLLM's finish-reason strings.)
IN_FLIGHT_FINISH: dict[PauseMode, frozenset[str]] = {
    PauseMode.ABORT: frozenset({"length", "stop", "abort"}),
    PauseMode.WAIT: frozenset({"length", "stop"}),
    PauseMode.KEEP: frozenset({"length", "stop"}),
}


#: The modes whose pause returns only once every request that reached the rank before it has finished:
#: vLLM's contract for ``wait`` (PR #34125: "``mode=wait`` finishes processing"; PR #51488 treats the pause as
#: a generation boundary). vLLM 0.32 keeps it for running requests only (a queued one waits for the resume,
#: ``v1/core/sched/scheduler.py:900-917``); property ``wait_drains`` judges it.
DRAINS_BEFORE_RETURN: frozenset[PauseMode] = frozenset({PauseMode.WAIT})


class RankEvent(StrEnum):
    """Inputs of a rank machine: local (utility) calls, received messages, loop steps and collective outcomes."""

    # local calls (utility calls run on the busy-loop thread between steps)
    PAUSE = "pause"
    RESUME = "resume"
    INIT_TRANSFER = "init_weight_transfer_engine"
    START_UPDATE = "start_weight_update"
    UPDATE_WEIGHTS = "update_weights"
    FINISH_UPDATE = "finish_weight_update"
    # received messages
    ADD = "ADD"
    ABORT = "ABORT"
    START_DP_WAVE = "START_DP_WAVE"
    # the busy loop decides to run one step (real or dummy batch) or to stay idle
    STEP = "step"
    # collective outcomes
    DP_STEP_DONE = "dp_step_done"
    DP_SYNC_DONE = "dp_sync_done"
    RESUME_BARRIER_DONE = "resume_barrier_done"
    WEIGHT_BROADCAST_DONE = "weight_broadcast_done"
    TRANSFER_INIT_DONE = "transfer_init_done"
    # outcomes of the worker's weight-transfer operations (weightsync: failures are table events)
    FINISH_DONE = "finish_done"  # the workers' finish_weight_update returned (every layer complete)
    TRANSFER_FAILED = "transfer_failed"  # init, start, update or finish raised or timed out on this rank


LOCAL_CALLS: frozenset[RankEvent] = frozenset(
    {
        RankEvent.PAUSE,
        RankEvent.RESUME,
        RankEvent.INIT_TRANSFER,
        RankEvent.START_UPDATE,
        RankEvent.UPDATE_WEIGHTS,
        RankEvent.FINISH_UPDATE,
    }
)


class Collective(StrEnum):
    """Collective kinds. A collective completes only when every member entered the same (kind, seq).

    - ``dp_step``: the per-step forward collective of the DP/EP group (dummy batches included).
    - ``dp_sync``: a step whose forward is followed by the DP sync SUM all-reduce of
      ``[has_unfinished, pending_pause]`` (every ``sync_interval`` steps; 32 in vLLM, PR #21617).
    - ``resume_barrier``: the MAX all-reduce of has-unfinished on resume (PR #39366); in
      ``two-phase-epoch`` it also carries ``current_wave``.
    - ``weight_broadcast``: the weight-transfer group (trainer + all workers) broadcast of one update.
    - ``transfer_init``: the weight-transfer group rendezvous of ``init_weight_transfer_engine``.
    """

    DP_STEP = "dp_step"
    DP_SYNC = "dp_sync"
    RESUME_BARRIER = "resume_barrier"
    WEIGHT_BROADCAST = "weight_broadcast"
    TRANSFER_INIT = "transfer_init"


def admits_waiting(pause_state: PauseState) -> bool:
    """Whether the scheduler may start waiting requests under ``pause_state``: only UNPAUSED (vLLM 0.32
    ``v1/core/sched/scheduler.py:900, 916``: PAUSED_NEW and PAUSED_ALL both hold new requests)."""
    return pause_state is PauseState.UNPAUSED


def advances_running(pause_state: PauseState) -> bool:
    """Whether the scheduler may advance running requests under ``pause_state``: all but PAUSED_ALL
    (vLLM 0.32 ``v1/core/sched/scheduler.py:615-617``: keep mode freezes them)."""
    return pause_state is not PauseState.PAUSED_ALL


def schedulable(pause_state: PauseState, waiting: int, running: int) -> bool:
    """Whether the scheduler has work it may schedule under ``pause_state`` (vLLM 0.32
    ``v1/core/sched/scheduler.py:615-617, 900-917``).

    UNPAUSED: waiting or running requests; PAUSED_NEW: running requests only; PAUSED_ALL: nothing.
    """
    return (admits_waiting(pause_state) and waiting > 0) or (advances_running(pause_state) and running > 0)


def unfinished_for_sync(pause_state: PauseState, waiting: int, running: int) -> int:
    """The has-unfinished contribution (0 or 1) to the DP sync all-reduce (vLLM 0.32
    ``v1/core/sched/scheduler.py:2803-2811``):
    unfinished work counts 0 under PAUSED_ALL and only running requests under PAUSED_NEW."""
    return 1 if schedulable(pause_state, waiting, running) else 0
