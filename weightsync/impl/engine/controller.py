"""The controller: one weight-update round over a DP engine cluster.

``pause(mode) -> start_weight_update -> update_weights (concurrently with the trainer's send) ->
finish_weight_update(weight_version) -> resume``. The weight calls are vLLM 0.32's
(:class:`EngineClientAPI`); the trainer is a vLLM-style trainer engine
(:class:`~weightsync.impl.transfer.trainer.TrainerEngine`, or the vLLM plugin's) whose client is the same
engine: the controller opens and closes the round and times each phase, the trainer's ``update`` moves
the weights (``client.update_weights`` concurrently with its data plane).

The order of the calls and the failure policy are rows of the spec's controller table
(:mod:`weightsync.spec.controller`, policy ``one_round``), which the model explores too; this module only
makes the calls, times them and turns each outcome into the table's event. The policy: **a rank never
resumes serving on a partial update.** ``resume`` runs whenever the engines hold a complete set of
weights -- the round finished, or ``start_weight_update`` failed before any weight moved -- and then the
start's error is raised. If the round failed after ``update_weights`` began (a broadcast timed out, the
trainer died, ``finish`` found missing parameters), resuming would serve a mix of old and new weights, so
the controller does not resume; the ranks involved are ``failed`` (the rank table's state: they refuse
pause and resume and serve nothing until a new round completes) and :class:`UpdateFailedError` says so.
A failed pause is raised without a resume (the ranks may stand in different states; a resume would send
the verified ones alone into the resume barrier). The model's controller (policy ``recover``) carries a
failed round through and runs a new one instead; the table names both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.spec.calls import PHASE_CALL, Phase
from weightsync.spec.controller import ONE_ROUND_ARGS, CtrlEvent, CtrlVars, controller_next, controller_table
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
    its send), finish, resume -- the rows the controller table (:mod:`weightsync.spec.controller`) takes
    under policy ``one_round``, first row whose guard holds (one cycle, the transfer engine initialised).

    Args:
        engine: the engine client (e.g. :class:`~weightsync.impl.engine.client.DPEngineClient` or a
            :class:`~weightsync.impl.checked.CheckedEngine` around it); also the trainer's client.
        trainer: the trainer engine (``trainer_init(..., client=engine)``).
        weights: this round's source (None: the trainer's own source).
        mode, clear_cache: the pause arguments (vLLM 0.32 ``pause_generation``, ``v1/engine/async_llm.py:952``).
        timeout: per-call timeout, seconds (None: the client's default).
        weight_version: the version ``finish_weight_update`` sets (vLLM 0.32's string; None: the version
            stays). Pass it whenever a round may be retried after a failure, so every rank ends on the
            same version.
        monotonic: the finish refuses a version older than the served one (weightsync).

    Returns:
        the seconds spent per phase.

    Raises:
        UpdateFailedError: the round failed once weights began to move (engines not resumed).
        The start's error itself when it failed before any weight moved (engines resumed first); the
        pause's error when the pause failed (not resumed); the resume's when the resume failed.
    """
    times = RoundTimes()
    table = controller_table()  # this client's pause and resume are its own calls, whatever the variant
    args = dict(ONE_ROUND_ARGS)
    calls: dict[Phase, Callable[[], None]] = {
        Phase.PAUSE: lambda: engine.pause(mode, clear_cache, timeout),
        Phase.START: lambda: engine.start_weight_update(timeout=timeout),
        Phase.UPDATE: lambda: trainer.update(weights),
        Phase.FINISH: lambda: engine.finish_weight_update(
            weight_version, monotonic=monotonic, timeout=timeout
        ),
        Phase.RESUME: lambda: engine.resume(timeout),
    }
    v = CtrlVars()
    error: BaseException | None = None
    failed_phase = Phase.IDLE
    event = CtrlEvent.DONE
    while True:
        nxt = controller_next(table, v, event, args)
        if nxt is None:  # pragma: no cover - every reachable (phase, event) of one_round has a row
            raise AssertionError(f"controller table: no row for {v.phase.name} {event.value}")
        tr, v = nxt
        (effect,) = tr.effects
        if effect == "end_round":
            return times
        if effect == "raise_failure":
            assert error is not None
            raise error
        if effect == "raise_update_failed":
            assert error is not None
            raise UpdateFailedError(PHASE_CALL[failed_phase], error) from error
        t = time.perf_counter()
        try:
            calls[v.phase]()
        except BaseException as exc:
            if error is not None:
                exc.__context__ = error
            error, failed_phase, event = exc, v.phase, CtrlEvent.FAILED
        else:
            event = CtrlEvent.DONE
        setattr(times, _TIME_FIELD[v.phase], time.perf_counter() - t)


#: The :class:`RoundTimes` field of each phase.
_TIME_FIELD = {
    Phase.PAUSE: "pause_s",
    Phase.START: "start_s",
    Phase.UPDATE: "update_s",
    Phase.FINISH: "finish_s",
    Phase.RESUME: "resume_s",
}
