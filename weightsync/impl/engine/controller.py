"""The controller: one weight-update round over a DP engine cluster (reference section 2, "Round").

``pause(mode) -> start_weight_update -> update_weights (concurrently with the trainer's send) ->
finish_weight_update(weight_version) -> resume``. The weight calls are vLLM 0.32's
(:class:`EngineClientAPI`); the trainer is a vLLM-style trainer engine
(:class:`~weightsync.impl.transfer.trainer.TrainerEngine`, or the vLLM plugin's) whose client is the same
engine: the controller opens and closes the round and times each phase, the trainer's ``update`` moves
the weights (``client.update_weights`` concurrently with its data plane).

Failure policy (the choice the issue asks to document): **a rank never resumes serving on a partial update;
it stays paused with an error.** ``resume`` runs in a ``finally`` whenever the engines hold a complete set
of weights -- the round finished, or it failed before any weight moved (pause or start failed) -- so a
failed round never leaves healthy engines paused forever. If the round failed after ``update_weights``
began (a broadcast timed out, the trainer died, ``finish`` found missing parameters), resuming would serve
a mix of old and new weights, so the controller does not resume; the ranks involved have already stopped
(an engine rank stops on any failed effect, :mod:`weightsync.impl.engine.core`) and
:class:`UpdateFailedError` says so. Rolling back instead would need a spec row ``UPDATING --abort_update-->
VERIFIED``, which the table does not have (reported to the lead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.spec.errors import WeightSyncError


class EngineClientAPI(Protocol):
    """The engine-client methods the controller drives (ours, a CheckedEngine, or a wrapped one): vLLM
    0.32's weight calls (``v1/engine/async_llm.py:1315-1363``) plus weightsync's keyword-only ``timeout``
    and ``monotonic``."""

    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None) -> None: ...
    def resume(self, timeout: float | None = None) -> None: ...
    def start_weight_update(self, *, timeout: float | None = None) -> None: ...
    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None: ...
    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None: ...


class RoundTrainer(Protocol):
    """The trainer side :func:`update_round` drives: ``update(weights)``, the ``update_weights`` part of a
    round (:meth:`weightsync.impl.transfer.trainer.TrainerEngine.update`)."""

    def update(self, weights: Any = None) -> None: ...


class UpdateFailedError(WeightSyncError):
    """A weight-update round failed after weights started moving; the engines stay paused with an error.

    Attributes:
        phase: the call that failed (``"update_weights"``: the engines' RPC or the trainer's send, whichever
            failed first; ``"finish_weight_update"``).
        cause: the underlying exception.
    """

    def __init__(self, phase: str, cause: BaseException) -> None:
        self.phase = phase
        self.cause = cause
        super().__init__(
            f"weight update failed in {phase}: {type(cause).__name__}: {cause}; engines were NOT resumed "
            "(they would serve a partial update) and stay paused with an error"
        )


@dataclass
class RoundTimes:
    """Seconds spent in each phase of one round."""

    pause_s: float = 0.0
    start_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0
    resume_s: float = 0.0


def update_round(
    engine: EngineClientAPI,
    trainer: RoundTrainer,
    weights: Any = None,
    *,
    mode: str = "keep",
    clear_cache: bool = True,
    timeout: float | None = None,
    weight_version: str | None = None,
    monotonic: bool = False,
) -> RoundTimes:
    """Run one round: pause, start, update (the trainer's ``update``: ``update_weights`` concurrently with
    its send), finish, resume.

    Args:
        engine: the engine client (e.g. :class:`~weightsync.impl.engine.client.DPEngineClient` or a
            :class:`~weightsync.impl.checked.CheckedEngine` around it); also the trainer's client.
        trainer: the trainer engine (``trainer_init(..., client=engine)``).
        weights: this round's source (None: the trainer's own source).
        mode, clear_cache: the pause arguments (reference section 4).
        timeout: per-call timeout, seconds (None: the client's default).
        weight_version: the version ``finish_weight_update`` sets (vLLM 0.32's string; None: the version
            stays). Pass it whenever a round may be retried after a failure, so every rank ends on the
            same version.
        monotonic: the finish refuses a version older than the served one (weightsync).

    Returns:
        the seconds spent per phase.

    Raises:
        UpdateFailedError: the round failed once weights began to move (engines not resumed).
        The pause/start error itself when the round failed before any weight moved (engines resumed).
    """
    times = RoundTimes()
    moved = False
    done = False
    t = time.perf_counter()
    engine.pause(mode, clear_cache, timeout)
    times.pause_s = time.perf_counter() - t
    try:
        t = time.perf_counter()
        engine.start_weight_update(timeout=timeout)
        times.start_s = time.perf_counter() - t
        moved = True
        t = time.perf_counter()
        try:
            trainer.update(weights)
        except BaseException as exc:
            raise UpdateFailedError("update_weights", exc) from exc
        times.update_s = time.perf_counter() - t
        t = time.perf_counter()
        try:
            engine.finish_weight_update(weight_version, monotonic=monotonic, timeout=timeout)
        except BaseException as exc:
            raise UpdateFailedError("finish_weight_update", exc) from exc
        times.finish_s = time.perf_counter() - t
        done = True
    finally:
        if done or not moved:
            t = time.perf_counter()
            engine.resume(timeout)
            times.resume_s = time.perf_counter() - t
    return times
