"""Messages between the front-end client, the controller, the DP coordinator and the engine ranks.

Every channel is one FIFO per (source, destination, socket) as in vLLM (reference section 5): the engine
polls its front-end input, controller input and coordinator wave queues without an order between them.
All messages are small picklable dataclasses (no tensors), so they travel on ``multiprocessing`` queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.impl.models.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        req_id: unique id chosen by the client.
        prompt: prompt token ids (non-empty).
        params: sampling parameters (temperature, max_new_tokens, per-request seed, stop tokens).
    """

    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


# ----------------------------------------------------------------------------- front-end -> engine


@dataclass(frozen=True)
class AddMsg:
    """ADD(request, wave): the front-end stamps its ``current_wave`` (reference s5)."""

    request: Request
    wave: int


@dataclass(frozen=True)
class AbortMsg:
    """ABORT(req_id) from the front-end."""

    req_id: str


# ----------------------------------------------------------------------------- controller -> engine


@dataclass(frozen=True)
class UtilityCall:
    """A utility call (pause, resume, weight-transfer calls, queries) run between steps on the busy loop.

    Attributes:
        call_id: unique per client; the reply carries it back.
        method: the method name (e.g. ``"pause"``, ``"update_weights"``, ``"get_weight_version"``).
        kwargs: its keyword arguments.
    """

    call_id: int
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    """Stop the busy loop and exit the process."""


# ----------------------------------------------------------------------------- coordinator <-> engine


@dataclass(frozen=True)
class StartDPWave:
    """START_DP_WAVE(wave, exclude) from the coordinator to every engine (exclude = -1 for none)."""

    wave: int
    exclude: int


@dataclass(frozen=True)
class WaveComplete:
    """wave_complete=wave from engine rank 0 to the coordinator."""

    wave: int


@dataclass(frozen=True)
class StartWave:
    """start_wave=wave from an engine (``sender``) to the coordinator."""

    wave: int
    sender: int


@dataclass(frozen=True)
class FirstReq:
    """FIRST_REQ(exclude, wave) from the front-end to the coordinator."""

    exclude: int
    wave: int


@dataclass(frozen=True)
class Stats:
    """Coordinator -> front-end: its (current_wave, engines_running)."""

    current_wave: int
    engines_running: bool


# ----------------------------------------------------------------------------- engine -> front-end


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request produced by one step (or its end).

    Attributes:
        rank: engine rank that serves the request.
        req_id: the request.
        tokens: token ids appended by this step (may be empty when only ``finish_reason`` is new).
        logprobs: float32 log-probability of each token under its sampling distribution.
        finish_reason: None while running; ``"length"``, ``"stop"`` or ``"abort"`` at the end.
        weight_version: the engine's weight version when the tokens were produced.
    """

    rank: int
    req_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    weight_version: int | str


@dataclass(frozen=True)
class StepOutputs:
    """All token deltas of one engine step."""

    rank: int
    deltas: tuple[TokenDelta, ...]


@dataclass(frozen=True)
class UtilityReply:
    """The answer to a :class:`UtilityCall`.

    Attributes:
        rank: the answering rank.
        call_id: the call's id.
        result: the return value (None for protocol calls).
        error: ``"ExceptionType: message"`` when the call failed, else None.
        error_type: the exception's class name (``"LocalProtocolError"``...), or None.
    """

    rank: int
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True)
class TransitionRecord:
    """One fired transition of a rank machine, reported before its effects run (log before send).

    Attributes:
        rank: DP rank.
        rank_seq: 0-based index of this transition on this rank.
        event: :class:`~weightsync.spec.states.RankEvent` value.
        args: the event's arguments (JSON-able).
        before, after: the rank's :class:`~weightsync.spec.rank.RankVars` as dicts.
        guard: the guard of the transition taken.
        effects: its effect names.
        collective: the DP collective (kind) entered by this transition's effects, or "".
        coll_seq: the DP collective sequence number this rank enters next (equal on every rank in lockstep).
        t: ``time.time()`` when it fired, seconds.
        waiting, running: the rank's scheduler queue lengths when it fired, before the effects (-1 unknown);
            for a collective's completion, the lengths at entry (the rank is blocked in between).
    """

    rank: int
    rank_seq: int
    event: str
    args: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    guard: str
    effects: tuple[str, ...]
    collective: str
    coll_seq: int
    t: float
    waiting: int = -1
    running: int = -1


@dataclass(frozen=True)
class EngineFailure:
    """A rank stopped serving because an effect failed (a collective timed out or mismatched).

    Attributes:
        rank: the failed rank.
        phase: what it was doing (e.g. ``"dp_step#12"``, ``"update_weights"``).
        error: ``"ExceptionType: message"``.
        error_type: the exception's class name.
        collective: the collective kind it was blocked in ("" if none).
        coll_seq: that collective's sequence number (-1 if none).
        missing_ranks: ranks that had not joined, as far as the rank could tell.
        peers: what every rank had posted as its current collective (``{rank: "kind#seq"}``).
        state: the rank's protocol state when it failed.
    """

    rank: int
    phase: str
    error: str
    error_type: str
    collective: str
    coll_seq: int
    missing_ranks: tuple[int, ...]
    peers: dict[int, str]
    state: str
