"""Error hierarchy (h11/h2 style), shared by the spec, the model and the implementation.

Every message names the state, the event and what would have been legal, so a user can tell from the
exception text alone which rule was broken (as h11's and h2's errors do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class WeightSyncError(Exception):
    """Base class of every error weightsync raises on purpose."""


class LocalProtocolError(WeightSyncError):
    """This process called something that is illegal in its current protocol state.

    Raised by a state machine *before* any side effect of the call happens.
    """


class RemoteProtocolError(WeightSyncError):
    """A peer sent a message that is illegal in the receiver's current protocol state."""


class WireMismatchError(WeightSyncError):
    """Trainer and engine disagree on names, dtypes, shapes or packing parameters.

    Detected by the wire-agreement exchange at the start of every update, before any payload moves
    (huggingface/trl PR #7104, SkyRL PR #2114 hung silently instead).
    """


class TransferTimeoutError(WeightSyncError):
    """A collective or rendezvous missed its deadline.

    Attributes:
        phase: the protocol phase or collective that timed out (e.g. ``"update_weights/broadcast"``).
        missing_ranks: the ranks that had not arrived when the deadline passed (may be empty when unknown).
        seconds: how long the caller waited, in seconds.
    """

    def __init__(self, phase: str, missing_ranks: Iterable[int], seconds: float, detail: str = "") -> None:
        self.phase = phase
        self.missing_ranks: tuple[int, ...] = tuple(sorted(missing_ranks))
        self.seconds = float(seconds)
        missing = ", ".join(str(r) for r in self.missing_ranks) or "unknown"
        msg = f"{phase}: timed out after {self.seconds:.1f} s waiting for rank(s) {missing}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class IncompleteUpdateError(WeightSyncError):
    """``finish_weight_update`` was called while some parameters were not received in this round.

    Attributes:
        missing: the names of the parameters that did not arrive, sorted.
    """

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing: tuple[str, ...] = tuple(sorted(missing))
        shown = ", ".join(self.missing[:10])
        more = f" and {len(self.missing) - 10} more" if len(self.missing) > 10 else ""
        super().__init__(
            f"finish_weight_update: {len(self.missing)} parameter(s) were not received in this round: "
            f"{shown}{more}; every loadable parameter must arrive exactly once between start and finish"
        )


class StaleWeightVersionError(WeightSyncError, ValueError):
    """A round with ``monotonic=True`` would move the served ``weight_version`` backwards; refused before
    ``start_weight_update``, so no byte moves and every rank keeps serving its weights and version.

    Attributes:
        version: the version the round was to set.
        served: the newer version it was compared with.
        where: whose version that is (the engines', or the last this trainer sent).
    """

    def __init__(self, version: str, served: str, where: str) -> None:
        self.version, self.served, self.where = version, served, where
        super().__init__(
            f"send_weights(weight_version={version!r}, monotonic=True): {where} {served!r} is newer; the "
            "monotonic guard refuses a version that moves backwards (refused before start_weight_update: "
            "nothing was sent and the engines keep their weights)"
        )


class PeerFailedError(WeightSyncError):
    """A peer process died or reported a failure while this process was waiting on it.

    Attributes:
        ranks: the ranks that failed, sorted.
        phase: what this process was doing when it noticed.
    """

    def __init__(self, ranks: Iterable[int], phase: str, detail: str = "") -> None:
        self.ranks: tuple[int, ...] = tuple(sorted(ranks))
        self.phase = phase
        msg = f"{phase}: rank(s) {', '.join(map(str, self.ranks))} failed"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


__all__ = [
    "IncompleteUpdateError",
    "LocalProtocolError",
    "PeerFailedError",
    "RemoteProtocolError",
    "StaleWeightVersionError",
    "TransferTimeoutError",
    "WeightSyncError",
    "WireMismatchError",
]
