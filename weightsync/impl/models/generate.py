"""A minimal continuous-batching generation loop over :class:`CausalLM` (reference for the engine, and tests).

Each step prefills newly admitted requests one by one, then decodes every running request together
(``CausalLM.decode``); a request leaves the batch when it samples a stop token or reaches ``max_new_tokens``.
At most ``max_batch`` requests run at once; the rest wait in FIFO order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weightsync.impl.models.causal_lm import CausalLM, KVCache
from weightsync.impl.models.sampling import RequestSampler, SamplingParams

__all__ = ["Completion", "generate"]


@dataclass
class Completion:
    """Output of one request: sampled ``tokens`` and their float32 ``logprobs`` (same length)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Running:
    index: int
    sampler: RequestSampler
    cache: KVCache
    out: Completion
    last: int


def generate(
    model: CausalLM, requests: Sequence[tuple[Sequence[int], SamplingParams]], max_batch: int = 64
) -> list[Completion]:
    """Generate a completion for every ``(prompt_tokens, params)``; results in request order.

    Raises:
        ValueError: an empty prompt, or ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    results = [Completion() for _ in requests]
    waiting = deque(range(len(requests)))
    running: list[_Running] = []
    with torch.no_grad():
        while waiting or running:
            while waiting and len(running) < max_batch:
                i = waiting.popleft()
                prompt, params = requests[i]
                if len(prompt) == 0:
                    raise ValueError(f"generate: request {i} has an empty prompt")
                r = _Running(i, RequestSampler(params), model.new_cache(), results[i], -1)
                tok, lp = r.sampler.sample(model.prefill(list(prompt), r.cache))
                r.out.tokens.append(tok)
                r.out.logprobs.append(lp)
                r.last = tok
                if not _finished(r):
                    running.append(r)
            if not running:
                continue
            logits = model.decode([(r.last, r.cache) for r in running])
            still: list[_Running] = []
            for b, r in enumerate(running):
                tok, lp = r.sampler.sample(logits[b])
                r.out.tokens.append(tok)
                r.out.logprobs.append(lp)
                r.last = tok
                if not _finished(r):
                    still.append(r)
            running = still
    return results


def _finished(r: _Running) -> bool:
    return r.sampler.is_stop(r.last) or len(r.out.tokens) >= r.sampler.params.max_new_tokens
