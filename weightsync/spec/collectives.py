"""The collectives as data: what each member contributes, how the contributions reduce, which rank-table
event completes each, and the ``phase`` a failed weight-transfer operation reports.

Both the model (the joint completion, :meth:`weightsync.model.system.effects.RankEffects._complete`; trace
replay, :func:`weightsync.model.replay.collective_outcome`) and the reference engine (its DP group,
:meth:`weightsync.impl.engine.dp.DPGroup.collective`, and the outcome events its ranks fire) use these
definitions; neither re-states a reduction.

- ``dp_sync``: SUM of ``[has_unfinished, pending_pause]`` (vLLM 0.32 ``v1/engine/core.py:2410-2427``,
  ``config/parallel.py:850-875``; PR #21617), outcome ``sum_unfinished``, ``sum_pending_pause``.
- ``resume_barrier``: MAX of ``[has_unfinished, current_wave]`` (PR #39366's resume all-reduce of
  has-unfinished, ``v1/engine/core.py:2250-2273``; ``two-phase-epoch`` and ``vllm-0.32-epoch`` read the
  wave's MAX, the others ignore it), outcome ``max_unfinished``, ``max_wave``.
- ``dp_step``: the per-step forward collective; no outcome.
- ``weight_broadcast``, ``transfer_init``: the weight-transfer group with the trainer; no outcome (a
  failure is the event ``transfer_failed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple

from weightsync.spec.states import Collective, PauseState, RankEvent, unfinished_for_sync
from weightsync.spec.table import table_digest


class Reduction(StrEnum):
    """How the members' contributions combine."""

    NONE = "none"
    SUM = "sum"
    MAX = "max"


class CollectiveSpec(NamedTuple):
    """One collective kind.

    Attributes:
        done: the rank-table event its completion fires on every member.
        enter: the rank-table effect (and update) that enters it (``enter_<kind>``).
        dp: a collective of the DP group (engine ranks only); else the trainer is a member too.
        reduction: how the contributions reduce.
        contributes: what each member contributes, in order (names of :func:`contribution`'s values).
        outcome: the outcome arguments of ``done``, in the same order as ``contributes``.
    """

    done: RankEvent
    enter: str
    dp: bool
    reduction: Reduction
    contributes: tuple[str, ...]
    outcome: tuple[str, ...]


C = Collective
COLLECTIVES: dict[Collective, CollectiveSpec] = {
    C.DP_STEP: CollectiveSpec(RankEvent.DP_STEP_DONE, "enter_dp_step", True, Reduction.NONE, (), ()),
    C.DP_SYNC: CollectiveSpec(
        RankEvent.DP_SYNC_DONE,
        "enter_dp_sync",
        True,
        Reduction.SUM,
        ("has_unfinished", "pending_pause"),
        ("sum_unfinished", "sum_pending_pause"),
    ),
    C.RESUME_BARRIER: CollectiveSpec(
        RankEvent.RESUME_BARRIER_DONE,
        "enter_resume_barrier",
        True,
        Reduction.MAX,
        ("has_unfinished", "current_wave"),
        ("max_unfinished", "max_wave"),
    ),
    C.WEIGHT_BROADCAST: CollectiveSpec(
        RankEvent.WEIGHT_BROADCAST_DONE, "enter_weight_broadcast", False, Reduction.NONE, (), ()
    ),
    C.TRANSFER_INIT: CollectiveSpec(
        RankEvent.TRANSFER_INIT_DONE, "enter_transfer_init", False, Reduction.NONE, (), ()
    ),
}

#: collective kind -> its completion event
DONE_EVENT: dict[str, RankEvent] = {str(k.value): c.done for k, c in COLLECTIVES.items()}
#: completion event value -> collective kind
KIND_OF_DONE: dict[str, str] = {str(c.done.value): str(k.value) for k, c in COLLECTIVES.items()}
#: the rank-table effect that enters a collective -> its kind
ENTER_EFFECT: dict[str, str] = {c.enter: str(k.value) for k, c in COLLECTIVES.items()}
DP_KINDS: frozenset[str] = frozenset(str(k.value) for k, c in COLLECTIVES.items() if c.dp)
TRANSFER_KINDS: frozenset[str] = frozenset(str(k.value) for k, c in COLLECTIVES.items() if not c.dp)
#: the collectives whose completion carries outcome arguments
OUTCOME_KINDS: frozenset[str] = frozenset(str(k.value) for k, c in COLLECTIVES.items() if c.outcome)

#: The ``phase`` argument of ``transfer_failed`` (the rank table's guard ``failed_init`` reads it) for each
#: failing weight-transfer operation: the rank-table effect or transfer collective, and the call.
FAIL_PHASE: dict[str, str] = {
    "start_weight_update": "start",
    "finish_weight_update": "finish",
    "weight_broadcast": "update",
    "transfer_init": "init",
}
#: The transfer collectives a refusal of their call ends: once a rank answered the call with an error
#: without joining, the collective can never complete, and its members time out. The trainer's
#: ``trainer_init`` runs the engines' ``init_weight_transfer_engine`` beside its rendezvous and raises the
#: RPC's error once it fails (``weightsync/impl/transfer/trainer_calls.py`` ``concurrently``); a rank that
#: joined leaves at its rendezvous deadline.
ABANDONED_ON_REFUSAL: frozenset[str] = frozenset({str(C.TRANSFER_INIT.value)})
CALL_FAIL_PHASE: dict[RankEvent, str] = {
    RankEvent.INIT_TRANSFER: "init",
    RankEvent.START_UPDATE: "start",
    RankEvent.UPDATE_WEIGHTS: "update",
    RankEvent.FINISH_UPDATE: "finish",
}


def contribution(
    kind: str, pause_state: PauseState, waiting: int, running: int, pending_pause: bool, current_wave: int
) -> tuple[int, ...]:
    """What one member contributes to collective ``kind`` (``COLLECTIVES[kind].contributes``):
    ``has_unfinished`` is :func:`~weightsync.spec.states.unfinished_for_sync`."""
    names = COLLECTIVES[Collective(kind)].contributes
    if not names:
        return ()
    values = {
        "has_unfinished": unfinished_for_sync(pause_state, waiting, running),
        "pending_pause": int(pending_pause),
        "current_wave": current_wave,
    }
    return tuple(values[n] for n in names)


def reduce_values(kind: str, contributions: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The members' ``contributions`` to ``kind`` reduced position by position (``()`` for a kind with no
    outcome).

    Raises:
        ValueError: no members.
    """
    if not contributions:
        raise ValueError("a collective needs at least one member")
    red = COLLECTIVES[Collective(kind)].reduction
    if red is Reduction.NONE:
        return ()
    op = sum if red is Reduction.SUM else max
    return tuple(op(col) for col in zip(*contributions, strict=True))


def outcome_args(kind: str, reduced: Sequence[int]) -> tuple[tuple[str, int], ...]:
    """The outcome arguments of ``kind``'s completion event for the ``reduced`` values, sorted by name (the
    order the model's event arguments use)."""
    return tuple(sorted(zip(COLLECTIVES[Collective(kind)].outcome, reduced, strict=True)))


#: The collectives whose completion event also carries the member's ``has_work`` (its scheduler's, right
#: after the collective; the rank table's guards read it on DP_STEP_DONE and DP_SYNC_DONE, spec/rank_vars.py).
#: The resume barrier's and the transfers' completions carry none.
DONE_CARRIES_HAS_WORK: frozenset[str] = frozenset({str(C.DP_STEP.value), str(C.DP_SYNC.value)})


def done_args(kind: str, outcome: Sequence[tuple[str, Any]], has_work: bool) -> tuple[tuple[str, Any], ...]:
    """The arguments of ``kind``'s completion event on one member: its ``has_work`` where the completion
    carries it (:data:`DONE_CARRIES_HAS_WORK`), then the ``outcome`` (:func:`outcome_args`). The engines, the
    model, the repro schedule, the vLLM adapter and the vLLM trace build them here."""
    lead: tuple[tuple[str, Any], ...] = (("has_work", has_work),) if kind in DONE_CARRIES_HAS_WORK else ()
    return (*lead, *outcome)


def collectives_digest() -> str:
    """SHA-256 of the collectives' data and the failure phases (``weightsync prove --check``)."""
    lines = [
        f"{k.value}|{c.done.value}|{c.enter}|{c.dp}|{c.reduction.value}|{','.join(c.contributes)}|"
        f"{','.join(c.outcome)}"
        for k, c in COLLECTIVES.items()
    ]
    lines += [f"{k}={v}" for k, v in sorted(FAIL_PHASE.items())]
    lines += [f"{k.value}={v}" for k, v in CALL_FAIL_PHASE.items()]
    lines += [f"abandoned_on_refusal={k}" for k in sorted(ABANDONED_ON_REFUSAL)]
    return table_digest((), *lines)


__all__ = [
    "ABANDONED_ON_REFUSAL",
    "CALL_FAIL_PHASE",
    "COLLECTIVES",
    "DONE_CARRIES_HAS_WORK",
    "DONE_EVENT",
    "DP_KINDS",
    "ENTER_EFFECT",
    "FAIL_PHASE",
    "KIND_OF_DONE",
    "OUTCOME_KINDS",
    "TRANSFER_KINDS",
    "CollectiveSpec",
    "Reduction",
    "collectives_digest",
    "contribution",
    "done_args",
    "outcome_args",
    "reduce_values",
]
