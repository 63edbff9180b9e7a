"""Scheduler of one engine rank: waiting/running queues, PauseState, continuous batching of the reference LM.

Rules (vLLM 0.32 ``v1/core/sched/scheduler.py:615-617, 900-917``, ``v1/engine/core.py:2061-2103``):

- What may be scheduled depends on :class:`~weightsync.spec.states.PauseState` through
  :func:`weightsync.spec.states.schedulable`: UNPAUSED schedules waiting and running requests, PAUSED_NEW
  only running ones, PAUSED_ALL nothing. New requests are always accepted and queue until resume.
- One step admits waiting requests (UNPAUSED only, up to ``max_batch`` running), then advances every
  running request by one token: requests whose KV cache is one token behind decode together in one
  batched forward; requests further behind (new, or whose cache was cleared) prefill the missing tokens.
- :meth:`Scheduler.clear_cache` frees the KV of every request and preempts the running ones to the front of
  the waiting queue; a frozen request then re-prefills its prompt and generated tokens under the current
  weights when it is admitted again (vLLM ``reset_prefix_cache`` including running requests, PRs
  #34382/#42117). Without it, a frozen request keeps its old-weight KV ("stale KV").
- Sampling is per request (:class:`~weightsync.impl.models.sampling.RequestSampler`), so tokens depend only
  on the request's seed and logits.
- A request that breaks a rule of :func:`~weightsync.impl.engine.messages.request_error` (a token id outside
  the vocabulary, an empty prompt, ``max_new_tokens < 1``, too long for the KV cache...) is queued like any
  other, so it is counted and finishes exactly once, but when it is admitted it ends at once with
  ``finish_reason="error"`` and the reason, without a forward pass: one bad request never raises in the
  busy loop, so the rank (and its DP peers, which would wait for it in the next collective) keep serving.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from weightsync.impl.engine.messages import Request, TokenDelta, request_error
from weightsync.impl.models.causal_lm import CausalLM, KVCache
from weightsync.impl.models.sampling import RequestSampler, SamplingParams
from weightsync.spec.states import (
    PauseState,
    admits_waiting,
    advances_running,
    schedulable,
    unfinished_for_sync,
)


@dataclass
class _Live:
    request: Request
    sampler: RequestSampler | None  # None exactly when ``error`` is set
    cache: KVCache | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # why the request is rejected (it ends with finish_reason "error")

    def sampling(self) -> RequestSampler:
        assert self.sampler is not None, "a rejected request is never stepped"
        return self.sampler

    def all_tokens(self) -> list[int]:
        return list(self.request.prompt) + self.output


class Scheduler:
    """Waiting and running queues of one rank, stepping a :class:`CausalLM`.

    Args:
        model: the reference causal LM (weights are updated in place by the weight-transfer worker).
        rank: this engine's DP rank (stamped on outputs).
        max_batch: most requests running at once.
    """

    def __init__(self, model: CausalLM, rank: int = 0, max_batch: int = 64) -> None:
        self.model = model
        self.rank = rank
        self.max_batch = max_batch
        self.pause_state = PauseState.UNPAUSED
        self.waiting: deque[_Live] = deque()
        self.running: dict[str, _Live] = {}
        self.weight_version: str = "default"  # vLLM 0.32 v1/engine/core.py:141; the engine keeps it
        self.steps = 0  # real (non-dummy) steps executed

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        """Queue ``request`` (always accepted, even while paused; never raises).

        A request breaking a rule of :func:`~weightsync.impl.engine.messages.request_error`, or whose
        ``req_id`` is already waiting or running on this rank, is queued as rejected: when admitted it ends
        with ``finish_reason="error"`` and ``error`` = ``"ValueError: <rule> (rejected by engine rank R)"``.
        """
        cfg = self.model.config
        why = request_error(request, cfg.vocab_size, cfg.max_position_embeddings)
        if why is None and (
            request.req_id in self.running or any(w.request.req_id == request.req_id for w in self.waiting)
        ):
            why = f"req_id {request.req_id!r} is already in flight on this rank; request ids must be unique"
        if why is not None:
            err = f"ValueError: {why} (rejected by engine rank {self.rank})"
            if not isinstance(request, Request):  # not even a request: keep a placeholder to end it
                rid = getattr(request, "req_id", "")
                request = Request(rid if isinstance(rid, str) else repr(rid), (), SamplingParams())
            self.waiting.append(_Live(request, None, error=err))
            return
        self.waiting.append(_Live(request, RequestSampler(request.params)))

    def _delta(
        self, live: _Live, toks: list[int], lps: list[float], reason: str | None, error: str | None = None
    ) -> TokenDelta:
        return TokenDelta(
            self.rank, live.request.req_id, tuple(toks), tuple(lps), reason, self.weight_version, error
        )

    def abort(self, req_id: str) -> list[TokenDelta]:
        """Abort one request (waiting or running); returns its final delta (finish_reason "abort")."""
        live = self.running.pop(req_id, None)
        if live is None:
            for w in list(self.waiting):
                if w.request.req_id == req_id:
                    self.waiting.remove(w)
                    live = w
                    break
        return [] if live is None else [self._delta(live, [], [], "abort")]

    def abort_all(self) -> list[TokenDelta]:
        """Abort every in-flight request (running and waiting); partial outputs end with "abort"."""
        out = [self._delta(x, [], [], "abort") for x in list(self.running.values()) + list(self.waiting)]
        self.running.clear()
        self.waiting.clear()
        return out

    def clear_cache(self) -> None:
        """Free every request's KV cache and preempt the running ones to the front of the waiting queue, in
        order (vLLM 0.32 ``_reset_caches`` -> ``reset_prefix_cache(reset_running_requests=True)``,
        ``v1/engine/core.py:898-912``, ``v1/core/sched/scheduler.py:2840-2866``); they re-prefill prompt +
        generated tokens when admitted again (the model's ``clear_cache`` effect)."""
        lives = list(self.running.values())
        self.running.clear()
        for live in lives:
            if live.cache is not None:
                live.cache.clear()
            live.cache = None
        self.waiting.extendleft(reversed(lives))

    # ------------------------------------------------------------------ predicates
    def has_work(self) -> bool:
        """Schedulable work under the current PauseState (:func:`~weightsync.spec.states.schedulable`)."""
        return schedulable(self.pause_state, len(self.waiting), len(self.running))

    def unfinished(self) -> int:
        """This rank's has-unfinished contribution (0/1) to the DP sync all-reduce."""
        return unfinished_for_sync(self.pause_state, len(self.waiting), len(self.running))

    def _admit(self, limit: int | None) -> list[TokenDelta]:
        """Move waiting requests into the running batch (up to ``limit`` running; None: all of them). A
        rejected one ends here with ``finish_reason="error"``; its delta is returned."""
        out: list[TokenDelta] = []
        while self.waiting and (limit is None or len(self.running) < limit):
            live = self.waiting.popleft()
            if live.error is not None:
                out.append(self._delta(live, [], [], "error", live.error))
                continue
            self.running[live.request.req_id] = live
        return out

    def admit_waiting(self) -> list[TokenDelta]:
        """The table's ``admit_waiting`` effect (a wait-mode pause drains the requests queued before it,
        weightsync patch 0005): every waiting request joins the running batch now, past ``max_batch`` if
        need be, so each drains with the running ones under PAUSED_NEW. Returns the deltas of rejected ones."""
        return self._admit(None)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[TokenDelta]:
        """Run one step; returns the token deltas (empty for a dummy step, e.g. under PAUSED_ALL).

        Rejected requests reaching admission end here with ``finish_reason="error"`` (no forward pass).
        """
        out: list[TokenDelta] = []
        if admits_waiting(self.pause_state):
            out = self._admit(self.max_batch)
        if not advances_running(self.pause_state) or not self.running:
            return out
        self.steps += 1
        lives = list(self.running.values())
        sampled: dict[str, tuple[int, float]] = {}
        decode: list[_Live] = []
        for live in lives:
            if live.cache is None:
                live.cache = self.model.new_cache()
            pending = live.all_tokens()[live.cache.length :]
            if len(pending) == 1 and live.cache.length > 0:  # a 1-token prompt still prefills first
                decode.append(live)
            else:
                logits = self.model.prefill(pending, live.cache)
                sampled[live.request.req_id] = live.sampling().sample(logits)
        if decode:
            batch = []
            for live in decode:
                assert live.cache is not None
                batch.append((live.all_tokens()[-1], live.cache))
            logits_b = self.model.decode(batch)
            for b, live in enumerate(decode):
                sampled[live.request.req_id] = live.sampling().sample(logits_b[b])
        for live in lives:
            tok, lp = sampled[live.request.req_id]
            live.output.append(tok)
            live.logprobs.append(lp)
            reason: str | None = None
            if live.sampling().is_stop(tok):
                reason = "stop"
            elif len(live.output) >= live.request.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                del self.running[live.request.req_id]
            out.append(self._delta(live, [tok], [lp], reason))
        return out


def reference_generate(
    model: CausalLM, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> tuple[list[int], list[float]]:
    """A fresh single-request run (no batching, fresh KV): prefill ``prompt`` then decode.

    Used to check that post-resume tokens with ``clear_cache=True`` equal a run of the new weights from
    the same prefix. Returns (tokens, logprobs).
    """
    sampler = RequestSampler(
        SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    )
    cache = model.new_cache()
    toks: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        logits = model.prefill(prompt, cache)
        for _ in range(max_new_tokens):
            t, lp = sampler.sample(logits)
            toks.append(t)
            lps.append(lp)
            if len(toks) == max_new_tokens:
                break
            logits = model.decode([(t, cache)])[0]
    return toks, lps
