"""The demo's tokenizer, verifiable-reward task and rollout sample record (issue 5).

* :class:`ByteTokenizer`: UTF-8 bytes are token ids 0..255; specials BOS=256, EOS=257, PAD=258 (vocab 259), so
  no tokenizer files are needed.
* :class:`DigitPatternTask`: prompts are arithmetic digit sequences modulo 10 (``"3,4,5,6,"``); the completion
  must continue the pattern (``"7,8,"``). Reward in [0, 1] with partial credit per character, so a tiny model
  gets a learning signal from its first steps.
* :class:`Sample`: one completion as an engine reports it (tokens and the engine's log-probabilities).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DigitPatternTask",
    "Prompt",
    "Sample",
]

BOS_ID = 256
"""Beginning-of-sequence token id."""
EOS_ID = 257
"""End-of-sequence token id (a stop token for sampling)."""
PAD_ID = 258
"""Padding token id (never attended to: completions are right-padded and masked out of the loss)."""
VOCAB_SIZE = 259
"""256 byte ids + BOS + EOS + PAD."""


class ByteTokenizer:
    """Byte-level tokenizer: ``encode`` maps UTF-8 bytes to ids 0..255; specials are 256..258."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes), prefixed by BOS when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str:
        """Text of ``ids``: specials are dropped, decoding stops at the first EOS when ``stop_at_eos``,
        and invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        out = bytearray()
        for t in ids:
            if not 0 <= t < VOCAB_SIZE:
                raise ValueError(f"decode: token id {t} outside [0, {VOCAB_SIZE})")
            if t == EOS_ID and stop_at_eos:
                break
            if t < 256:
                out.append(t)
        return out.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Prompt:
    """One task instance.

    Attributes:
        index: position in the task's fixed prompt list (groups samples of the same prompt).
        text: the prompt text, e.g. ``"3,4,5,6,"``.
        tokens: BOS + the prompt bytes.
        target: the completion that earns reward 1, e.g. ``"7,8,"``.
    """

    index: int
    text: str
    tokens: tuple[int, ...]
    target: str


@dataclass
class Sample:
    """One sampled completion of a prompt, as the engine reports it.

    Attributes:
        prompt: the prompt it answers.
        completion_tokens: the sampled ids (at most ``max_new_tokens``; may end with EOS).
        logprobs: the engine's float32 log-probability of each completion token under its sampling
            distribution (same length as ``completion_tokens``).
        reward: filled by :meth:`DigitPatternTask.reward` (or the trainer) in [0, 1].
        weight_version: the engine weight version that produced the *first* token (informational).
    """

    prompt: Prompt
    completion_tokens: list[int]
    logprobs: list[float]
    reward: float = 0.0
    weight_version: str = "default"
    meta: dict[str, object] = field(default_factory=dict)


class DigitPatternTask:
    """Continue an arithmetic digit pattern modulo 10.

    A prompt lists ``num_terms`` terms ``(a + k*d) mod 10`` separated and terminated by commas (``"3,4,5,6,"``
    for a=3, d=1); the target is the next ``answer_terms`` terms in the same format (``"7,8,"``). All prompts
    have the same token length (``1 + 2*num_terms``), so batches need no padding.

    Reward (in [0, 1]): the mean over the target's characters of a per-character score: 1 for the right
    character, ``digit_credit`` for a wrong digit where a digit is due, 0 otherwise. The completion is decoded up
    to the first EOS; missing characters score 0, extra characters are ignored.

    Args:
        seed: seeds the prompt list order and :meth:`batch` draws.
        num_terms: terms shown in the prompt (>= 2).
        answer_terms: terms expected in the completion (>= 1); ``max_new_tokens`` should be ``2*answer_terms``.
        steps: allowed differences d.
        digit_credit: partial credit for a wrong digit in a digit slot.
    """

    def __init__(
        self,
        seed: int = 0,
        num_terms: int = 4,
        answer_terms: int = 2,
        steps: Sequence[int] = (1,),
        digit_credit: float = 0.25,
    ) -> None:
        if num_terms < 2 or answer_terms < 1:
            raise ValueError(f"need num_terms >= 2 and answer_terms >= 1, got {num_terms}, {answer_terms}")
        if not 0.0 <= digit_credit <= 1.0:
            raise ValueError(f"digit_credit must be in [0, 1], got {digit_credit}")
        self.tokenizer = ByteTokenizer()
        self.num_terms = num_terms
        self.answer_terms = answer_terms
        self.digit_credit = digit_credit
        self._rng = random.Random(seed)
        prompts: list[tuple[str, str]] = []
        for d in steps:
            for a in range(10):
                terms = [(a + k * d) % 10 for k in range(num_terms + answer_terms)]
                text = "".join(f"{t}," for t in terms[:num_terms])
                target = "".join(f"{t}," for t in terms[num_terms:])
                prompts.append((text, target))
        self._rng.shuffle(prompts)
        self.prompts: list[Prompt] = [
            Prompt(i, text, tuple(self.tokenizer.encode(text)), target)
            for i, (text, target) in enumerate(prompts)
        ]

    @property
    def max_new_tokens(self) -> int:
        """Completion length that covers the target: ``2 * answer_terms``."""
        return 2 * self.answer_terms

    def batch(self, n: int) -> list[Prompt]:
        """``n`` prompts drawn without replacement while possible (then with), from the task's own RNG."""
        if n <= len(self.prompts):
            return self._rng.sample(self.prompts, n)
        return [self._rng.choice(self.prompts) for _ in range(n)]

    def reward(self, prompt: Prompt, completion_tokens: Sequence[int]) -> float:
        """Score a completion against ``prompt.target`` (see the class docstring); in [0, 1]."""
        text = self.tokenizer.decode(completion_tokens)
        target = prompt.target
        score = 0.0
        for i, want in enumerate(target):
            if i >= len(text):
                break
            got = text[i]
            if got == want:
                score += 1.0
            elif want.isdigit() and got in "0123456789":
                score += self.digit_credit
        return score / len(target)
