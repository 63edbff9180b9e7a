"""The protocol as data: states, events, guards, actions, variants and the sans-IO machines.

This package imports nothing else of weightsync; :mod:`weightsync.model` and :mod:`weightsync.impl` both
import it and neither imports the other.
"""

from weightsync.spec.errors import (
    IncompleteUpdateError,
    LocalProtocolError,
    PeerFailedError,
    RemoteProtocolError,
    TransferTimeoutError,
    WeightSyncError,
    WireMismatchError,
)
from weightsync.spec.rank import (
    DEFAULT_VARIANT,
    EFFECTS,
    GUARDS,
    UPDATES,
    VARIANTS,
    RankMachine,
    RankVars,
    Variant,
    get_variant,
    spec_digest,
)
from weightsync.spec.states import (
    Collective,
    PauseMode,
    PauseState,
    RankEvent,
    RankState,
    schedulable,
    unfinished_for_sync,
)
from weightsync.spec.worker import WorkerEvent, WorkerMachine, WorkerState

__all__ = [
    "DEFAULT_VARIANT",
    "EFFECTS",
    "GUARDS",
    "UPDATES",
    "VARIANTS",
    "Collective",
    "IncompleteUpdateError",
    "LocalProtocolError",
    "PauseMode",
    "PauseState",
    "PeerFailedError",
    "RankEvent",
    "RankMachine",
    "RankState",
    "RankVars",
    "RemoteProtocolError",
    "TransferTimeoutError",
    "Variant",
    "WeightSyncError",
    "WireMismatchError",
    "WorkerEvent",
    "WorkerMachine",
    "WorkerState",
    "get_variant",
    "schedulable",
    "spec_digest",
    "unfinished_for_sync",
]
