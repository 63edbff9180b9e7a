"""The worker-side weight-update machine: NoEngine -> Ready <-> Active (vLLM 0.32
``v1/worker/gpu_worker.py:1477-1604``).

Every worker of an engine runs every weight-transfer call. vLLM raises ``RuntimeError`` for illegal calls;
weightsync raises :class:`~weightsync.spec.errors.LocalProtocolError` *before* any side effect, and the
worker then stays in ``error`` until ``shutdown``.

Deliberate differences from vLLM (each noted in the row's ``rule``):

- ``init_weight_transfer_engine`` while ``active`` is rejected (vLLM leaves it unguarded and replaces the
  communicator mid-round).
- ``finish_weight_update`` bumps ``weight_version`` (vLLM has no version counter; RFC #31848).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, NamedTuple

from weightsync.spec.table import ALWAYS, TableMachine, Transition, registry_digest, table_digest


class WorkerState(StrEnum):
    """States of one worker's weight-transfer engine."""

    NO_ENGINE = "no_engine"
    READY = "ready"
    ACTIVE = "active"
    ERROR = "error"
    CLOSED = "closed"


class WorkerEvent(StrEnum):
    """Calls a worker receives (all local calls, routed by collective_rpc)."""

    CONFIGURE = "configure"  # WeightTransferConfig(backend) chosen: the engine object exists
    INIT = "init_weight_transfer_engine"
    START = "start_weight_update"
    UPDATE = "update_weights"
    FINISH = "finish_weight_update"
    FAIL = "fail_round"  # the round failed (update or finish raised, or the rank refused the version)
    FAIL_INIT = "fail_init"  # init_weight_transfer_engine raised or timed out
    SHUTDOWN = "shutdown"


class WorkerVars(NamedTuple):
    """Local variables of the worker machine.

    Attributes:
        state: current :class:`WorkerState`.
        initialized: whether ``init_weight_transfer_engine`` has completed at least once.
        is_checkpoint_format: format of the active round (True: HF names via ``load_weights``).
        weight_version: number of completed rounds (bumped by finish).
        updates_in_round: number of ``update_weights`` calls in the current round.
        partial: the weights were (possibly) changed by a round that failed and no round has completed
            since: they must not be served (weightsync).
    """

    state: WorkerState
    initialized: bool = False
    is_checkpoint_format: bool = True
    weight_version: int = 0
    updates_in_round: int = 0
    partial: bool = False


def _initialized(v: WorkerVars, a: Mapping[str, Any]) -> bool:
    return v.initialized


WORKER_GUARDS = {"initialized": _initialized}

WORKER_UPDATES = {
    "mark_initialized": lambda v, a: v._replace(initialized=True),
    "begin_round": lambda v, a: v._replace(
        is_checkpoint_format=bool(a.get("is_checkpoint_format", True)), updates_in_round=0
    ),
    "count_update": lambda v, a: v._replace(updates_in_round=v.updates_in_round + 1),
    "end_round": lambda v, a: v._replace(
        weight_version=v.weight_version + 1, is_checkpoint_format=True, updates_in_round=0, partial=False
    ),
    "abandon_round": lambda v, a: v._replace(is_checkpoint_format=True, updates_in_round=0, partial=True),
    "drop_init": lambda v, a: v._replace(initialized=False),
}

_W = WorkerState
_E = WorkerEvent


def _t(
    guard: str, target: WorkerState, updates: tuple[str, ...], effects: tuple[str, ...], rule: str
) -> Transition:
    return Transition(guard, target, updates, effects, rule)


_V = "vLLM 0.32 v1/worker/gpu_worker.py:"
R_START = _V + "1524-1548, distributed/weight_transfer/nccl_engine.py:159-165"
R_UPDATE = _V + "1550-1585, distributed/weight_transfer/base.py:491-503"
R_FINISH = _V + "1587-1604, distributed/weight_transfer/nccl_engine.py:167-173"
R_SHUTDOWN = _V + "1617-1618"

WORKER_TABLE: dict[tuple[WorkerState, WorkerEvent], tuple[Transition, ...]] = {
    (_W.NO_ENGINE, _E.CONFIGURE): (
        _t(ALWAYS, _W.READY, (), ("create_engine",), "vLLM WeightTransferConfig"),
    ),
    (_W.READY, _E.INIT): (
        _t(
            ALWAYS,
            _W.READY,
            ("mark_initialized",),
            ("init_transfer_engine",),
            _V + "1484-1496: unguarded re-init",
        ),
    ),
    (_W.READY, _E.START): (
        _t("initialized", _W.ACTIVE, ("begin_round",), ("initialize_layerwise_reload",), R_START),
    ),
    (_W.ACTIVE, _E.UPDATE): (
        _t(ALWAYS, _W.ACTIVE, ("count_update",), ("receive_weights", "synchronize"), R_UPDATE),
    ),
    (_W.ACTIVE, _E.FINISH): (
        _t(
            ALWAYS,
            _W.READY,
            ("end_round",),
            ("check_complete", "finalize_layerwise_reload", "bump_weight_version"),
            R_FINISH + "; version counter: weightsync (RFC #31848)",
        ),
    ),
    # Failures (weightsync): a failed round leaves the worker ready for a new round, its weights marked
    # partial until a round completes; a failed init leaves it uninitialised (init again before start).
    (_W.ACTIVE, _E.FAIL): (
        _t(ALWAYS, _W.READY, ("abandon_round",), ("abort_round",), "weightsync: failure is a table event"),
    ),
    (_W.READY, _E.FAIL): (
        _t(ALWAYS, _W.READY, ("abandon_round",), (), "weightsync: finish refused after the workers' finish"),
    ),
    (_W.READY, _E.FAIL_INIT): (
        _t(ALWAYS, _W.READY, ("drop_init",), ("close_transfer_group",), "weightsync: init failed"),
    ),
    (_W.NO_ENGINE, _E.SHUTDOWN): (_t(ALWAYS, _W.CLOSED, (), (), "weightsync"),),
    (_W.READY, _E.SHUTDOWN): (_t(ALWAYS, _W.CLOSED, (), ("shutdown_engine",), R_SHUTDOWN),),
    (_W.ACTIVE, _E.SHUTDOWN): (_t(ALWAYS, _W.CLOSED, (), ("shutdown_engine",), R_SHUTDOWN),),
    (_W.ERROR, _E.SHUTDOWN): (
        _t(ALWAYS, _W.CLOSED, (), ("shutdown_engine",), "weightsync: sticky until shutdown (h11-style)"),
    ),
}


#: The rank table's effects that call into the worker machine, and the worker event each one fires
#: (the engine runs them as the worker API calls of the same names; the model fires the event).
WORKER_EVENT_OF_EFFECT: dict[str, WorkerEvent] = {
    "start_weight_update": WorkerEvent.START,
    "enter_weight_broadcast": WorkerEvent.UPDATE,
    "finish_weight_update": WorkerEvent.FINISH,
    "enter_transfer_init": WorkerEvent.INIT,
    "fail_round": WorkerEvent.FAIL,
    "fail_init": WorkerEvent.FAIL_INIT,
}


def worker_table_digest() -> str:
    """SHA-256 of the worker table (part of the digest ``prove --check`` compares)."""
    rows = sorted(
        ((s, e, tr) for (s, e), trs in WORKER_TABLE.items() for tr in trs),
        key=lambda r: (r[0].value, r[1].value),
    )
    return table_digest(rows, registry_digest(__name__, "WORKER_GUARDS", "WORKER_UPDATES"))


class WorkerMachine(TableMachine[WorkerState, WorkerEvent]):
    """Sans-IO worker weight-update machine.

    Use: ``m = WorkerMachine(); m.fire(WorkerEvent.CONFIGURE); m.fire(WorkerEvent.INIT); ...``.
    ``fire`` returns a :class:`~weightsync.spec.table.Fired` whose ``transition.effects`` the caller runs
    *after* ``fire`` returned (so an illegal call raises before any side effect).

    Raises:
        LocalProtocolError: a call out of order (update before start, start twice, anything after an
            error except shutdown, anything after shutdown).
    """

    def __init__(self, name: str = "worker", configured: bool = True) -> None:
        super().__init__(
            name,
            WORKER_TABLE,
            WORKER_GUARDS,
            WORKER_UPDATES,
            WorkerVars(WorkerState.READY if configured else WorkerState.NO_ENGINE),
            frozenset(WorkerEvent),
            WorkerState.ERROR,
        )
