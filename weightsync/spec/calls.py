"""The controller's call vocabulary: the phases (the call the controller made last), the engine call each
phase makes, the rank-table event each call is, the arguments each call carries into the rank table, the
calls whose reply comes later, and the worker operations whose success is an event of its own. The
controller's table (:mod:`weightsync.spec.controller`), the engines, the model and the trace walker read
them here."""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any

from weightsync.spec.states import Collective, PauseMode, RankEvent


class Phase(IntEnum):
    """The call the controller made last (ints: the model's state holds them as such)."""

    IDLE = 0
    PAUSE = 1
    START = 2
    UPDATE = 3
    FINISH = 4
    RESUME = 5
    INIT = 6


#: The engine call each phase makes (vLLM 0.32's names, ``v1/engine/async_llm.py:1315-1363``; ``pause`` /
#: ``resume`` are ``pause_generation`` / ``resume_generation``).
PHASE_CALL: dict[int, str] = {
    Phase.PAUSE: "pause",
    Phase.START: "start_weight_update",
    Phase.UPDATE: "update_weights",
    Phase.FINISH: "finish_weight_update",
    Phase.RESUME: "resume",
    Phase.INIT: "init_weight_transfer_engine",
}


#: The rank-table event each call is on an engine rank (the engines' and the model's one map).
CALL_EVENT: dict[str, RankEvent] = {
    "pause": RankEvent.PAUSE,
    "resume": RankEvent.RESUME,
    "init_weight_transfer_engine": RankEvent.INIT_TRANSFER,
    "start_weight_update": RankEvent.START_UPDATE,
    "update_weights": RankEvent.UPDATE_WEIGHTS,
    "finish_weight_update": RankEvent.FINISH_UPDATE,
}


#: The phases the trainer joins, with the transfer collective it enters (their outcome waits for it too).
TRAINER_COLLECTIVE: dict[int, Collective] = {
    Phase.UPDATE: Collective.WEIGHT_BROADCAST,
    Phase.INIT: Collective.TRANSFER_INIT,
}


#: The pause call's arguments and vLLM 0.32's defaults (``v1/engine/async_llm.py:952``
#: ``pause_generation(mode="abort", clear_cache=True)``; the rank table reads them as PAUSE's ``mode`` and
#: ``clear_cache``).
PAUSE_ARGS: dict[str, Any] = {"mode": "abort", "clear_cache": True}


#: The rank-table arguments each controller call carries (``spec/rank_vars.py``'s list): the call's own
#: keyword arguments (:data:`PAUSE_ARGS`) and what the receiving rank reads off its scheduler when the call
#: arrives (``running``: the requests ``wait`` must drain, ``v1/engine/core.py:2216-2273`` in vLLM 0.32;
#: ``waiting``: the requests queued there and not yet scheduled, which vLLM 0.32's ``wait`` leaves queued
#: under PAUSED_NEW, ``v1/core/sched/scheduler.py:900-917``, and the fixed variants drain too).
CALL_ARGS: dict[RankEvent, tuple[str, ...]] = {RankEvent.PAUSE: (*PAUSE_ARGS, "running", "waiting")}


#: The calls whose reply a later transition gives, by the effect that gives it: a pause returns once the rank
#: paused (the ``reply_pause`` effect, which answers every pause still pending on the rank), not when it
#: arrives: vLLM 0.32's ``pause_scheduler`` returns a Future that an idle-state callback completes once
#: ``_pause_complete()`` holds (``v1/engine/core.py:2061-2103``; DP ranks: ``:2216``).
DEFERRED_REPLY: dict[RankEvent, str] = {RankEvent.PAUSE: "reply_pause"}


#: The worker operations (rank-table effects) whose success is a rank-table event of its own, with the call's
#: keyword arguments that event carries and their defaults: ``finish_weight_update`` succeeds as
#: ``finish_done(weight_version, monotonic)`` (vLLM 0.32 ``finish_weight_update(weight_version=None)``,
#: ``v1/engine/async_llm.py:1351-1355``; ``monotonic`` is weightsync's opt-in guard). The others' success is
#: the call's end (``start_weight_update``) or a collective's completion (``spec/collectives.py``).
WORKER_OUTCOME: dict[str, tuple[RankEvent, dict[str, Any]]] = {
    "finish_weight_update": (RankEvent.FINISH_DONE, {"weight_version": None, "monotonic": False}),
}


def call_args(event: RankEvent, kwargs: Mapping[str, Any], running: int, waiting: int) -> dict[str, Any]:
    """The rank-table arguments of controller call ``event`` (:data:`CALL_ARGS`; none for a call not listed
    there), from the call's keyword arguments ``kwargs`` (a missing one takes vLLM 0.32's default,
    :data:`PAUSE_ARGS`) and the receiving rank's ``running`` and ``waiting`` (requests running there now,
    and queued there and not yet scheduled). The engine, the model and the trace walker build them here.

    Raises:
        ValueError: ``kwargs`` has an argument the call does not take, or a ``mode`` that is no
            :class:`~weightsync.spec.states.PauseMode` (nothing has changed on the rank).
    """
    if event not in CALL_ARGS:
        return {}  # a weight-transfer call: its keyword arguments are the worker's payload, no table's
    unknown = sorted(set(kwargs) - set(PAUSE_ARGS))
    if unknown:
        raise ValueError(
            f"{event.value} takes no argument(s) {unknown}; its arguments are {list(PAUSE_ARGS)}"
        )
    mode = kwargs.get("mode", PAUSE_ARGS["mode"])
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"{event.value}: mode={mode!r} is no pause mode; use one of {list(_MODES)}")
    clear_cache = bool(kwargs.get("clear_cache", PAUSE_ARGS["clear_cache"]))
    return {
        "mode": PauseMode(mode),
        "clear_cache": clear_cache,
        "running": int(running),
        "waiting": int(waiting),
    }


#: The pause modes by value (``call_args``' check).
_MODES = {m.value: m for m in PauseMode}


def worker_outcome(effect: str, kwargs: Mapping[str, Any]) -> tuple[RankEvent, dict[str, Any]]:
    """The event (and its arguments, from the call's ``kwargs`` or :data:`WORKER_OUTCOME`'s defaults) that a
    successful worker operation ``effect`` fires on its rank.

    Raises:
        KeyError: ``effect`` is not in :data:`WORKER_OUTCOME`.
    """
    event, defaults = WORKER_OUTCOME[effect]
    return event, {k: kwargs.get(k, d) for k, d in defaults.items()}


def front_end_answers(pause_in_front_end: bool, call: str) -> bool:
    """Whether the API front-end answers ``call`` itself (the rows' effect ``front_end_call``): pause and
    resume in a variant whose pause is held in the front-end (PR #28037, before PR #34125)."""
    return pause_in_front_end and call in (PHASE_CALL[Phase.PAUSE], PHASE_CALL[Phase.RESUME])


def call_version(phase: int, update_rounds: int) -> int:
    """The version argument the call of ``phase`` carries: a ``finish_weight_update`` the count of
    successful rounds + 1 (so a round retried after a failure carries the same version), the others 0."""
    return update_rounds + 1 if phase == Phase.FINISH else 0


__all__ = [
    "CALL_ARGS",
    "CALL_EVENT",
    "DEFERRED_REPLY",
    "PAUSE_ARGS",
    "PHASE_CALL",
    "TRAINER_COLLECTIVE",
    "WORKER_OUTCOME",
    "Phase",
    "call_args",
    "call_version",
    "front_end_answers",
    "worker_outcome",
]
