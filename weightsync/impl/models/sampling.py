"""Token sampling for the engine: greedy or temperature sampling with a per-request seed.

Every request owns a :class:`RequestSampler` (one ``torch.Generator`` seeded from the request's seed), so a
request's samples depend only on its seed and its logits, never on which other requests share the batch or on
the order in which the engine serves them (vLLM's per-request ``SamplingParams.seed`` does the same).

Log-probabilities are those of the distribution the token was drawn from, in float32:
``log_softmax(logits.float() / temperature)`` for temperature sampling and ``log_softmax(logits.float())`` for
greedy (temperature 0). The RL loss needs exactly this behaviour-policy log-probability for its importance ratio
(trainer recomputes ``log_softmax(trainer_logits / temperature)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RequestSampler", "SamplingParams", "sample_batch"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    Attributes:
        temperature: 0 for greedy (argmax, ties to the lowest id); > 0 divides the logits before softmax.
        max_new_tokens: completion length limit in tokens (>= 1).
        seed: seed of the request's generator (any int; reduced modulo 2**63).
        stop_token_ids: sampling one of these ends the request (the token is kept in the output).
    """

    temperature: float = 1.0
    max_new_tokens: int = 8
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class RequestSampler:
    """Per-request sampler: a CPU ``torch.Generator`` seeded once, advanced by every draw."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed % (2**63))

    def sample(self, logits: torch.Tensor) -> tuple[int, float]:
        """Draw one token from ``logits`` (``[V]``, any float dtype, any device).

        Returns:
            ``(token_id, logprob)``: the token and its float32 log-probability under the sampling distribution
            (see the module docstring), as Python scalars.

        Raises:
            ValueError: ``logits`` is not 1-D.
        """
        if logits.dim() != 1:
            raise ValueError(f"sample: logits must be [V], got {tuple(logits.shape)}")
        lf = logits.detach().to(device="cpu", dtype=torch.float32)
        t = self.params.temperature
        if t == 0.0:
            logp = torch.log_softmax(lf, dim=-1)
            tok = int(torch.argmax(lf).item())
        else:
            logp = torch.log_softmax(lf / t, dim=-1)
            probs = logp.exp()
            tok = int(torch.multinomial(probs, 1, generator=self.generator).item())
        return tok, float(logp[tok].item())

    def is_stop(self, token: int) -> bool:
        """Whether ``token`` ends the request (one of ``stop_token_ids``)."""
        return token in self.params.stop_token_ids


def sample_batch(logits: torch.Tensor, samplers: list[RequestSampler]) -> list[tuple[int, float]]:
    """Sample row b of ``logits`` (``[B, V]``) with ``samplers[b]``; returns ``(token, logprob)`` per row.

    Raises:
        ValueError: ``logits`` is not 2-D or its batch size differs from ``len(samplers)``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"sample_batch: logits {tuple(logits.shape)} do not match {len(samplers)} samplers")
    return [s.sample(logits[b]) for b, s in enumerate(samplers)]
