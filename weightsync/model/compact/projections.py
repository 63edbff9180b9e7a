"""The projections the compact engine memoises the invariant by (:meth:`CompactEngine.invariant`): for each
group of :meth:`~weightsync.model.system.Model.invariant`, the fields of a rank slice and of the rest it
reads. Two states with equal projections get the same verdict from a group; ``tests/test_model_compact.py``
checks every memoised verdict against the model's on small configurations (``verify=True``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightsync.model.system import GlobalState, Model, Rank


def slices_projection(r: Rank) -> tuple[Any, ...]:
    """The fields of a rank slice that :meth:`~weightsync.model.system.Model.invariant_slices` and
    :meth:`~weightsync.model.system.Model.invariant_modes` read: blocked, the table's collective, state,
    status, worker state, pause ghost, whether it runs requests."""
    return (
        r.blocked,
        r.vars.collective,
        r.vars.state,
        r.status,
        r.worker.state,
        r.pause_ghost,
        bool(r.running),
    )


def requests_projection(r: Rank) -> tuple[int, ...]:
    """What request_conservation (:meth:`~weightsync.model.system.Model._conserved`) reads of a rank slice:
    the ids of the requests it holds (waiting, running, ADDs queued), sorted."""
    held = [q[0] for q in r.waiting] + [q[0] for q in r.running]
    held += [m[1] for f in r.inq for m in f if m[0] == "ADD"]
    return tuple(sorted(held))


def version_projection(r: Rank) -> tuple[Any, ...]:
    """What version_agreement (:meth:`~weightsync.model.system.Model.invariant_version`) reads of a rank
    slice: its status and weight version."""
    return (r.status, r.vars.weight_version)


def coordinator_projection(r: Rank) -> tuple[Any, ...]:
    """What coordinator_belief (:meth:`~weightsync.model.system.Model._coordinator_belief_right`) reads of a
    rank slice: its wave and :meth:`~weightsync.model.system.Model.coordinator_unsettled`."""
    return (r.vars.current_wave, Model.coordinator_unsettled(r))


def front_end_projection(r: Rank) -> tuple[Any, ...]:
    """What front_end_belief (:meth:`~weightsync.model.system.Model._front_end_belief_right`) reads of a
    rank slice: :meth:`~weightsync.model.system.Model.front_end_unsettled`."""
    return (Model.front_end_unsettled(r),)


#: The rank slice projections of the invariant's groups (:meth:`CompactEngine._invariant_groups`, :func:`group_check`).
RANK_PROJECTIONS: tuple[Callable[[Rank], tuple[Any, ...]], ...] = (
    slices_projection,
    requests_projection,
    version_projection,
    coordinator_projection,
    front_end_projection,
)


def rest_projections(rest: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...]:
    """What the invariant's groups read of the state outside the ranks (``GlobalState[1:]``), in the order
    of :data:`RANK_PROJECTIONS`: the trainer's status; sent, finished, aborted and client-aborted requests;
    the controller's phase and rounds and the trainer's status; the coordinator, whether its FIFOs hold
    anything and whether the trainer is blocked; the front-end's belief that engines run, the coordinator
    and whether its FIFOs hold anything."""
    coord_q, coord, front, ctrl, trainer, done, aborted = rest
    queued = any(coord_q)
    return (
        (trainer.status,),
        (front.next_request, done, aborted, front.client_aborted),
        (ctrl.phase, ctrl.update_rounds, trainer.status),
        (coord, queued, trainer.blocked),
        (front.believed_running, coord, queued),
    )


def group_check(m: Model, g: int, s: GlobalState) -> Any:
    """Group ``g`` of ``m``'s invariant on ``s``, in the order of :data:`RANK_PROJECTIONS` (group 0 gives the
    pair ``(invariant_slices, invariant_modes)``, the first and last names of :meth:`Model.invariant`)."""
    if g == 0:
        return (m.invariant_slices(s), m.invariant_modes(s))
    if g == 1:
        return m.invariant_requests(s)
    if g == 2:
        return m.invariant_version(s)
    if g == 3:
        return [] if m._coordinator_belief_right(s) else ["coordinator_belief"]
    return [] if m._front_end_belief_right(s) else ["front_end_belief"]
