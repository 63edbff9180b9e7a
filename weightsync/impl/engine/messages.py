"""Messages between the front-end client, the controller, the DP coordinator and the engine ranks.

Every channel is one FIFO per (source, destination, socket) as in vLLM (0.32
``v1/engine/core.py:1831-1931``): the engine polls its front-end input, controller input and coordinator
wave queues without an order between them.
All messages are small picklable dataclasses (no tensors), so they travel on ``multiprocessing`` queues.
"""

from __future__ import annotations

import math
import operator
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


def _token_error(t: object, what: str, i: int, vocab_size: int) -> str | None:
    if isinstance(t, bool):
        return f"{what} {t!r} at position {i} is not an int token id"
    try:
        v = operator.index(t)  # type: ignore[arg-type]
    except TypeError:
        return f"{what} {t!r} at position {i} is not an int token id (got {type(t).__name__})"
    if not 0 <= v < vocab_size:
        return f"{what} {v} at position {i} is outside the vocabulary [0, {vocab_size})"
    return None


def request_error(request: object, vocab_size: int, max_positions: int) -> str | None:
    """The first rule ``request`` breaks for a model of ``vocab_size`` token ids and ``max_positions``
    positions, as a message naming the offending value and the rule; None when it is valid.

    Rules (checked by the front-end before sending, and again by every engine's scheduler, so a request that
    bypassed the front-end still cannot crash a rank):

    - ``request`` is a :class:`Request` with a non-empty ``str`` ``req_id``;
    - ``prompt`` is a non-empty sequence of int token ids, each in ``[0, vocab_size)``;
    - ``params`` is a :class:`SamplingParams` with a finite ``temperature >= 0``, an int
      ``max_new_tokens >= 1``, an int ``seed`` and int ``stop_token_ids`` in ``[0, vocab_size)``;
    - ``len(prompt) + max_new_tokens - 1 <= max_positions``: every position the request can feed to the
      model fits its KV cache (the last sampled token is never fed back).
    """
    if not isinstance(request, Request):
        return f"expected a Request, got {type(request).__name__}"
    if not isinstance(request.req_id, str) or not request.req_id:
        return f"req_id must be a non-empty str, got {request.req_id!r}"
    prompt = request.prompt
    if isinstance(prompt, str | bytes) or not hasattr(prompt, "__len__") or not hasattr(prompt, "__iter__"):
        return f"prompt must be a sequence of int token ids, got {type(prompt).__name__}"
    if len(prompt) == 0:
        return "prompt must be non-empty (got 0 token ids); every request needs at least one prompt token"
    for i, t in enumerate(prompt):
        err = _token_error(t, "prompt token id", i, vocab_size)
        if err is not None:
            return err
    p = request.params
    if not isinstance(p, SamplingParams):
        return f"params must be a SamplingParams, got {type(p).__name__}"
    if (
        isinstance(p.temperature, bool)
        or not isinstance(p.temperature, int | float)
        or not math.isfinite(p.temperature)
        or p.temperature < 0
    ):
        return f"temperature must be a finite number >= 0, got {p.temperature!r}"
    if isinstance(p.max_new_tokens, bool) or not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
        return f"max_new_tokens must be an int >= 1, got {p.max_new_tokens!r}"
    if isinstance(p.seed, bool) or not isinstance(p.seed, int):
        return f"seed must be an int, got {p.seed!r}"
    if not isinstance(p.stop_token_ids, tuple | list):
        return f"stop_token_ids must be a tuple of int token ids, got {type(p.stop_token_ids).__name__}"
    for i, t in enumerate(p.stop_token_ids):
        err = _token_error(t, "stop token id", i, vocab_size)
        if err is not None:
            return err
    need = len(prompt) + p.max_new_tokens - 1
    if need > max_positions:
        return (
            f"prompt of {len(prompt)} tokens with max_new_tokens {p.max_new_tokens} needs {need} positions, "
            f"more than the model's max_position_embeddings {max_positions} "
            "(rule: len(prompt) + max_new_tokens - 1 <= max_position_embeddings)"
        )
    return None


# ----------------------------------------------------------------------------- front-end -> engine


@dataclass(frozen=True)
class AddMsg:
    """ADD(request, wave): the front-end stamps its ``current_wave`` (vLLM 0.32 ``core_client.py:1585``)."""

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
        finish_reason: None while running; ``"length"``, ``"stop"`` or ``"abort"`` at the end; ``"error"``
            when the engine rejected the request (see :func:`request_error`; no token was generated).
        weight_version: the engine's weight version when the tokens were produced.
        error: with ``finish_reason="error"``, why the request was rejected; else None.
    """

    rank: int
    req_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    weight_version: str
    error: str | None = None


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
        rank_seq: 0-based index of this record on this rank (transitions and relabels).
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
class RelabelRecord:
    """A rank's weight version relabelled by ``update_weight_version`` (vLLM 0.32, any state; not a
    transition: :func:`weightsync.spec.rank.relabel_weight_version`), reported like a transition.

    Attributes:
        rank: DP rank.
        rank_seq: 0-based index of this record among the rank's records (transitions and relabels).
        weight_version: the new label.
        before, after: the rank's :class:`~weightsync.spec.rank.RankVars` as dicts.
        t: ``time.time()`` when it was applied, seconds.
    """

    rank: int
    rank_seq: int
    weight_version: str
    before: dict[str, Any]
    after: dict[str, Any]
    t: float


#: What an engine reports to the client's transition listeners, in the order it applied them.
RankRecord = TransitionRecord | RelabelRecord


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
