"""Trainer side of the demo (issue 5): a Hugging Face causal LM updated by a GRPO-style policy gradient.

* :func:`build_default_model` builds the default policy locally (no download): a small ``LlamaForCausalLM``
  over the byte vocabulary of :mod:`weightsync.demo.rl_task`, float32, fixed seed. :func:`load_hf_model` loads a
  local checkpoint directory (config.json + ``*.safetensors``) of a supported architecture.
* :func:`save_config` writes the ``config.json`` the engines build :class:`~weightsync.impl.models.CausalLM`
  from; engines never read weights from disk, they receive them through the transfer engines from
  :func:`iter_checkpoint_weights`.
* :class:`Trainer` holds the model and an Adam optimizer; :meth:`Trainer.trainer_step` applies one update from
  engine-reported :class:`~weightsync.demo.rl_task.Sample` s.
* :func:`trainer_probe_logits` is the trainer half of the post-sync exactness check.
* :func:`local_rollouts` / :func:`run_local_loop` sample with the HF model itself (no engines), to show the
  reward rises.

Loss (GRPO, Shao et al. 2024, with the PPO clipped surrogate, Schulman et al. 2017): samples are grouped by
prompt; advantage ``A = r - mean_group(r)``, divided by ``std_group(r) + 1e-6`` when ``normalize_advantages``;
per completion token ``ratio = exp(logp_trainer - logp_engine)`` where both are log-probabilities under
``softmax(logits / temperature)``; ``loss = -mean_tokens(min(ratio * A, clip(ratio, 1-eps, 1+eps) * A))``
(token-level mean over all completion tokens of the batch).
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from weightsync.demo.config import DemoConfig, DemoUsageError
from weightsync.demo.rl_task import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, DigitPatternTask, Prompt, Sample
from weightsync.impl.models.config import SUPPORTED_ARCHITECTURES, LMConfig
from weightsync.impl.models.sampling import RequestSampler, SamplingParams


def load_trainer_model(cfg: DemoConfig) -> Any:
    """The trainer's model: the built-in policy, or ``cfg.model_dir``'s checkpoint."""
    if cfg.model_dir is None:
        return build_default_model(cfg.seed)
    try:
        return load_hf_model(cfg.model_dir)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DemoUsageError(f"--model {cfg.model_dir}: {exc}") from None


__all__ = [
    "DEFAULT_MODEL_KWARGS",
    "PROBE_PROMPTS",
    "Trainer",
    "TrainerConfig",
    "build_default_model",
    "iter_checkpoint_weights",
    "load_hf_model",
    "load_trainer_model",
    "local_rollouts",
    "probe_prompt_tokens",
    "run_local_loop",
    "save_config",
    "trainer_probe_logits",
]

DEFAULT_MODEL_KWARGS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
"""Hyper-parameters of the default policy (a LlamaForCausalLM of about 3.1M parameters)."""

PROBE_PROMPTS: tuple[str, ...] = ("0,1,2,3,", "7,8,9,0,", "hello weightsync", "5,")
"""Fixed probe texts; their logits must match between trainer and engines after every sync."""


def probe_prompt_tokens() -> list[list[int]]:
    """Token ids (BOS + bytes) of :data:`PROBE_PROMPTS`."""
    return [[BOS_ID, *p.encode("utf-8")] for p in PROBE_PROMPTS]


def build_default_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The default policy: a fresh ``LlamaForCausalLM`` (:data:`DEFAULT_MODEL_KWARGS`), initialised under
    ``torch.manual_seed(seed)`` (HF init: normal(0, 0.02) weights, unit norms), SDPA attention, eval mode.

    Deterministic for a given seed and torch version. No download, no files.
    """
    import transformers

    cfg = transformers.LlamaConfig(**DEFAULT_MODEL_KWARGS)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg._attn_implementation = "sdpa"
    g_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(g_state)
    return model.eval()


def load_hf_model(path: str | pathlib.Path) -> Any:
    """Load a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``), offline.

    The architecture must be one the engines implement (:data:`SUPPORTED_ARCHITECTURES`); the dtype is the
    config's; attention is SDPA (what the exactness check assumes).

    Raises:
        FileNotFoundError: ``path`` has no config.json or no ``*.safetensors`` file.
        ValueError: unsupported architecture (names it), or a vocabulary smaller than the byte tokenizer's 259.
    """
    import transformers

    p = pathlib.Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p}: no config.json")
    if not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"{p}: no *.safetensors weights (only safetensors checkpoints are supported)")
    cfg = LMConfig.from_json_file(p)  # raises ValueError for unsupported architectures
    if cfg.vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"{p}: vocab_size {cfg.vocab_size} < {VOCAB_SIZE} needed by the byte-level demo task"
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p), dtype=cfg.dtype, attn_implementation="sdpa", use_safetensors=True, local_files_only=True
    )
    if type(model).__name__ not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{p}: loaded {type(model).__name__}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model.eval()  # type: ignore[no-untyped-call]


def save_config(model: Any, directory: str | pathlib.Path) -> pathlib.Path:
    """Write ``model.config`` as ``directory/config.json`` (architectures and dtype filled in); return the path.

    The engines build their reference LM with ``LMConfig.from_json_file`` on this file.
    """
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg_dict = model.config.to_dict()
    cfg_dict["architectures"] = [type(model).__name__]
    cfg_dict["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    out = d / "config.json"
    out.write_text(json.dumps(cfg_dict, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return out


def iter_checkpoint_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face checkpoint names and tensors to send, in ``named_parameters()`` order.

    Tensors are detached views of the live parameters (no copy; the caller must not step the optimizer while
    sending). Tied parameters appear once (``lm_head.weight`` is omitted when tied to the embedding), which
    matches ``CausalLM.checkpoint_weight_names()``.
    """
    for name, p in model.named_parameters():
        yield name, p.detach()


@torch.no_grad()
def trainer_probe_logits(model: Any, prompts: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Trainer logits on probe prompts: one ``[T_i, V]`` tensor per prompt, each from a ``[1, T_i]`` forward.

    Same shapes as ``CausalLM.probe_logits``, so in float32 the two are comparable with ``torch.equal``.
    Default prompts: :func:`probe_prompt_tokens`. Runs in eval mode and restores the previous mode.
    """
    toks = probe_prompt_tokens() if prompts is None else [list(p) for p in prompts]
    was_training = model.training
    model.eval()
    try:
        dev = next(model.parameters()).device
        return [model(torch.tensor([t], dtype=torch.long, device=dev)).logits[0] for t in toks]
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation settings.

    Attributes:
        lr: Adam learning rate.
        clip_eps: PPO clip range for the importance ratio.
        temperature: sampling temperature the engines use (log-probs are taken under ``logits / temperature``).
        normalize_advantages: divide group advantages by the group's standard deviation.
        max_grad_norm: global gradient-norm clip (0 disables).
        betas: Adam betas.
    """

    lr: float = 2e-3
    clip_eps: float = 0.2
    temperature: float = 1.0
    normalize_advantages: bool = True
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)


class Trainer:
    """Policy-gradient trainer around a Hugging Face causal LM.

    Args:
        model: a ``LlamaForCausalLM``/``Qwen2ForCausalLM`` (e.g. :func:`build_default_model`).
        task: scores samples whose ``reward`` is not yet set (None: rewards are taken from the samples).
        config: optimisation settings.
    """

    def __init__(
        self, model: Any, task: DigitPatternTask | None = None, config: TrainerConfig | None = None
    ) -> None:
        self.model = model
        self.task = task
        self.config = config or TrainerConfig()
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.config.lr, betas=self.config.betas)
        self.steps = 0

    def _batch_tensors(
        self, samples: Sequence[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """input ids ``[N, P+C]`` (completions right-padded with PAD), completion mask ``[N, C]``, engine
        log-probs ``[N, C]`` (0 where masked), and the prompt length P."""
        plen = {len(s.prompt.tokens) for s in samples}
        if len(plen) != 1:
            raise ValueError(
                f"trainer_step: prompts of different token lengths {sorted(plen)} are not supported"
            )
        p = plen.pop()
        c = max(len(s.completion_tokens) for s in samples)
        n = len(samples)
        ids = torch.full((n, p + c), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, c), dtype=torch.bool)
        old = torch.zeros((n, c), dtype=torch.float32)
        for i, s in enumerate(samples):
            if len(s.logprobs) != len(s.completion_tokens):
                raise ValueError(
                    f"trainer_step: sample {i} has {len(s.completion_tokens)} tokens but {len(s.logprobs)} logprobs"
                )
            k = len(s.completion_tokens)
            ids[i, :p] = torch.tensor(s.prompt.tokens)
            ids[i, p : p + k] = torch.tensor(s.completion_tokens, dtype=torch.long)
            mask[i, :k] = True
            old[i, :k] = torch.tensor(s.logprobs, dtype=torch.float32)
        return ids, mask, old, p

    def advantages(self, samples: Sequence[Sample]) -> torch.Tensor:
        """Group-relative advantages ``[N]`` (groups = samples sharing ``prompt.index``); see module docstring."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = torch.zeros_like(rewards)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.prompt.index, []).append(i)
        for idx in groups.values():
            r = rewards[idx]
            a = r - r.mean()
            if self.config.normalize_advantages and len(idx) > 1:
                a = a / (r.std(unbiased=False) + 1e-6)
            adv[idx] = a
        return adv

    def trainer_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step from engine samples.

        Rewards that are unset (0.0) are recomputed with ``task`` when the trainer has one. Samples with empty
        completions are skipped.

        Returns:
            metrics: ``loss``, ``reward_mean``, ``reward_std``, ``adv_abs_mean``, ``ratio_mean``, ``clip_frac``,
            ``approx_kl`` (mean engine-minus-trainer log-prob over completion tokens), ``grad_norm`` (before
            clipping), ``num_samples``, ``num_tokens``, ``lr``, ``seconds``, ``step``.

        Raises:
            ValueError: no usable samples, mismatched token/log-prob lengths, or mixed prompt lengths.
        """
        t0 = time.perf_counter()
        usable = [s for s in samples if s.completion_tokens]
        if not usable:
            raise ValueError("trainer_step: no samples with a non-empty completion")
        if self.task is not None:
            for s in usable:
                s.reward = self.task.reward(s.prompt, s.completion_tokens)
        ids, mask, old, p = self._batch_tensors(usable)
        adv = self.advantages(usable)
        dev = next(self.model.parameters()).device
        ids, mask, old, adv = ids.to(dev), mask.to(dev), old.to(dev), adv.to(dev)

        self.model.train()
        logits = self.model(ids).logits[:, p - 1 : -1].float()  # predicts completion tokens
        logp_all = F.log_softmax(logits / self.config.temperature, dim=-1)
        new = logp_all.gather(-1, ids[:, p:, None]).squeeze(-1)
        ratio = torch.exp(new - old)
        eps = self.config.clip_eps
        a = adv[:, None]
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
        ntok = mask.sum()
        loss = -(surrogate * mask).sum() / ntok
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.config.max_grad_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        else:
            gn = torch.sqrt(
                sum((q.grad.float() ** 2).sum() for q in self.model.parameters() if q.grad is not None)
            )
        self.optimizer.step()
        self.model.eval()
        self.steps += 1
        with torch.no_grad():
            m = mask.float()
            rewards = torch.tensor([s.reward for s in usable])
            clipped = ((ratio < 1 - eps) | (ratio > 1 + eps)).float()
            return {
                "loss": float(loss.item()),
                "reward_mean": float(rewards.mean().item()),
                "reward_std": float(rewards.std(unbiased=False).item()),
                "adv_abs_mean": float(adv.abs().mean().item()),
                "ratio_mean": float(((ratio * m).sum() / m.sum()).item()),
                "clip_frac": float(((clipped * m).sum() / m.sum()).item()),
                "approx_kl": float((((old - new) * m).sum() / m.sum()).item()),
                "grad_norm": float(gn.item()) if isinstance(gn, torch.Tensor) else float(gn),
                "num_samples": float(len(usable)),
                "num_tokens": float(ntok.item()),
                "lr": float(self.optimizer.param_groups[0]["lr"]),
                "seconds": time.perf_counter() - t0,
                "step": float(self.steps),
            }


@torch.no_grad()
def local_rollouts(
    model: Any,
    prompts: Sequence[Prompt],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[Sample]:
    """Sample ``group_size`` completions per prompt with the HF model itself (no engines, no KV cache).

    Each completion has its own :class:`RequestSampler` seeded ``seed * 1_000_003 + k`` so results do not depend
    on batching. Stops at EOS (kept) or after ``max_new_tokens``. Log-probs as the engines report them.
    """
    if not prompts:
        return []
    plen = {len(p.tokens) for p in prompts}
    if len(plen) != 1:
        raise ValueError(f"local_rollouts: prompts of different token lengths {sorted(plen)}")
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    jobs = [p for p in prompts for _ in range(group_size)]
    samplers = [
        RequestSampler(
            SamplingParams(
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                seed=seed * 1_000_003 + k,
                stop_token_ids=(EOS_ID,),
            )
        )
        for k in range(len(jobs))
    ]
    ids = torch.tensor([list(p.tokens) for p in jobs], dtype=torch.long, device=dev)
    outs: list[list[int]] = [[] for _ in jobs]
    lps: list[list[float]] = [[] for _ in jobs]
    done = [False] * len(jobs)
    for _ in range(max_new_tokens):
        logits = model(ids).logits[:, -1]
        nxt = []
        for i, s in enumerate(samplers):
            if done[i]:
                nxt.append(PAD_ID)
                continue
            tok, lp = s.sample(logits[i])
            outs[i].append(tok)
            lps[i].append(lp)
            done[i] = s.is_stop(tok)
            nxt.append(tok)
        if all(done):
            break
        ids = torch.cat([ids, torch.tensor(nxt, dtype=torch.long, device=dev)[:, None]], dim=1)
    model.train(was_training)
    return [
        Sample(prompt=p, completion_tokens=o, logprobs=lp) for p, o, lp in zip(jobs, outs, lps, strict=True)
    ]


def run_local_loop(
    steps: int = 20,
    seed: int = 0,
    prompts_per_step: int = 8,
    group_size: int = 8,
    config: TrainerConfig | None = None,
    model: Any = None,
    task: DigitPatternTask | None = None,
) -> list[dict[str, float]]:
    """Engine-free RL loop: sample with the HF model, then :meth:`Trainer.trainer_step`; metrics per step.

    Seeds python's ``random`` (task draws), torch (model init) and the samplers from ``seed``.
    """
    random.seed(seed)
    task = task or DigitPatternTask(seed=seed)
    model = model if model is not None else build_default_model(seed)
    trainer = Trainer(model, task, config)
    history: list[dict[str, float]] = []
    for step in range(steps):
        prompts = task.batch(prompts_per_step)
        samples = local_rollouts(
            model,
            prompts,
            group_size,
            task.max_new_tokens,
            trainer.config.temperature,
            seed=seed * 7919 + step,
        )
        metrics = trainer.trainer_step(samples)
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(f"run_local_loop: non-finite loss at step {step}: {metrics}")
        history.append(metrics)
    return history
