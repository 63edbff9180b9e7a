"""Reference causal LM: exactness against transformers, name mapping, in-place loading, int8, KV-cache serving."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import pytest
import torch
import transformers

from weightsync.impl.models import (
    CausalLM,
    LMConfig,
    RequestSampler,
    SamplingParams,
    TiedWeightMismatchError,
    sample_batch,
)
from weightsync.spec.errors import WireMismatchError

torch.set_num_threads(1)


@runtime_checkable
class LoadableModel(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
    def checkpoint_weight_names(self) -> set[str]: ...
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def process_weights_after_loading(self) -> None: ...


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-untied": ("LlamaForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "llama-mha-bias": (
        "LlamaForCausalLM",
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    ),
    "qwen2-gqa-tied": ("Qwen2ForCausalLM", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def make_hf(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **kw: Any) -> Any:
    cfg_cls = transformers.LlamaConfig if arch.startswith("Llama") else transformers.Qwen2Config
    cfg = cfg_cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=101,
        rms_norm_eps=1e-5,
        **kw,
    )
    cfg.architectures = [arch]
    cfg.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    torch.manual_seed(seed)
    # _from_config(dtype=...) keeps the rotary inv_freq buffer in float32, as from_pretrained does;
    # model.to(bfloat16) would round it to bfloat16 and change HF's cos/sin.
    model = getattr(transformers, arch)._from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def engine_for(hf: Any, **kw: Any) -> CausalLM:
    cfg = LMConfig.from_hf_dict(hf.config.to_dict(), **kw)
    m = CausalLM(cfg)
    loaded = m.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    assert loaded == m.checkpoint_weight_names()
    return m


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_float32_logits_bit_exact_vs_transformers(variant: str) -> None:
    arch, kw = VARIANTS[variant]
    hf = make_hf(arch, **kw)
    m = engine_for(hf)
    ids = torch.randint(0, 101, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = m.forward_full(ids)
    assert got.dtype == torch.float32
    assert torch.equal(ref, got), (ref - got).abs().max().item()
    # prefill of one prompt on an empty cache == HF on [1, T]
    with torch.no_grad():
        ref1 = hf(ids[:1]).logits[0]
    assert torch.equal(m.prefill(ids[0].tolist(), m.new_cache()), ref1[-1])
    assert all(torch.equal(a, b) for a, b in zip(m.probe_logits([ids[0].tolist()]), [ref1], strict=True))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bfloat16_logits_bit_exact_vs_transformers(variant: str) -> None:
    arch, kw = VARIANTS[variant]
    hf = make_hf(arch, dtype=torch.bfloat16, **kw)
    m = engine_for(hf)
    assert m.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    got = m.forward_full(ids)
    assert got.dtype == torch.bfloat16
    assert torch.equal(ref, got), (ref.float() - got.float()).abs().max().item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kv_cache_decode_matches_full_forward(variant: str) -> None:
    arch, kw = VARIANTS[variant]
    m = engine_for(make_hf(arch, **kw))
    ids = torch.randint(0, 101, (3, 12), generator=torch.Generator().manual_seed(3))
    full = m.forward_full(ids)
    # three requests with different prompt lengths, decoded together
    lens = [4, 7, 10]
    caches = [m.new_cache() for _ in lens]
    for b, n in enumerate(lens):
        logits = m.prefill(ids[b, :n].tolist(), caches[b])
        torch.testing.assert_close(logits, full[b, n - 1], rtol=0, atol=1e-5)
    for step in range(2):
        out = m.decode([(int(ids[b, n + step]), caches[b]) for b, n in enumerate(lens)])
        assert out.shape == (3, 101)
        for b, n in enumerate(lens):
            torch.testing.assert_close(out[b], full[b, n + step], rtol=0, atol=1e-5)
            assert caches[b].length == n + step + 1
    # chunked continuation prefill (mask offset)
    c = m.new_cache()
    m.prefill(ids[0, :5].tolist(), c)
    torch.testing.assert_close(m.prefill(ids[0, 5:9].tolist(), c), full[0, 8], rtol=0, atol=1e-5)
    c.clear()
    assert c.length == 0 and c.capacity == 0
    torch.testing.assert_close(m.prefill(ids[0, :3].tolist(), c), full[0, 2], rtol=0, atol=1e-5)


def test_kv_cache_grows_and_limits() -> None:
    m = engine_for(make_hf("LlamaForCausalLM"))
    c = m.new_cache(max_len=70)
    m.prefill(list(range(65)), c)
    assert c.capacity == 70 and c.length == 65
    with pytest.raises(ValueError, match="max_len 70"):
        m.prefill(list(range(6)), c)
    with pytest.raises(ValueError, match="prefill first"):
        m.decode([(1, m.new_cache())])
    with pytest.raises(ValueError, match="twice"):
        m.decode([(1, c), (2, c)])
    with pytest.raises(ValueError, match="empty batch"):
        m.decode([])


def test_names_and_protocol() -> None:
    m = engine_for(make_hf("Qwen2ForCausalLM", num_key_value_heads=2, tie_word_embeddings=True))
    assert isinstance(m, LoadableModel)
    names = m.checkpoint_weight_names()
    assert "lm_head.weight" not in names
    assert "model.layers.1.self_attn.k_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    kernel = dict(m.named_parameters())
    assert "lm_head.weight" not in kernel  # tied: deduplicated
    assert kernel["model.layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    assert kernel["model.layers.0.mlp.gate_up_proj.weight"].shape == (192, 64)
    assert m.kernel_name_for("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    # a tied lm_head equal to the loaded embedding is accepted, not copied, not returned; inv_freq skipped
    emb = m.model.embed_tokens.weight.detach().clone()
    assert m.tied_checkpoint_weights() == {"lm_head.weight": "model.embed_tokens.weight"}
    got = m.load_weights(
        [
            ("lm_head.weight", emb.clone()),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)),
        ]
    )
    assert got == set()
    assert torch.equal(m.model.embed_tokens.weight, emb)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    # inv_freq is a non-persistent buffer
    assert "model.rotary_emb.inv_freq" not in m.state_dict()


def _snapshot(m: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _unchanged(m: CausalLM, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_tied_lm_head_from_hf_state_dict_accepted_when_equal_refused_otherwise() -> None:
    hf = make_hf("Qwen2ForCausalLM", num_key_value_heads=2, tie_word_embeddings=True)
    sd = {n: t.detach() for n, t in hf.state_dict().items()}
    assert "lm_head.weight" in sd  # Hugging Face's state_dict lists the tied tensor under both names
    cfg = LMConfig.from_hf_dict(hf.config.to_dict())
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits

    # accepted: lm_head.weight first in the call, so it is compared with the embedding of the same call
    # (the fresh model's own embedding is all zeros and would not match)
    m = CausalLM(cfg)
    items = [("lm_head.weight", sd["lm_head.weight"])] + [
        (n, t) for n, t in sd.items() if n != "lm_head.weight"
    ]
    assert m.load_weights(items) == m.checkpoint_weight_names()
    assert torch.equal(m.forward_full(ids), ref)
    assert m.lm_head.weight is m.model.embed_tokens.weight

    # refused: new weights whose lm_head.weight differs from their embedding in one element; the call
    # changes no parameter, including those listed before lm_head.weight
    hf2 = make_hf("Qwen2ForCausalLM", seed=1, num_key_value_heads=2, tie_word_embeddings=True)
    sd2 = {n: t.detach().clone() for n, t in hf2.state_dict().items()}
    bad = sd2["model.embed_tokens.weight"].clone()
    bad[3, 7] += 0.25
    sd2["lm_head.weight"] = bad
    want = float((bad.double() - sd2["model.embed_tokens.weight"].double()).abs().max())
    assert want > 0.2
    before = _snapshot(m)
    with pytest.raises(TiedWeightMismatchError) as ei:
        m.load_weights(sd2.items())
    msg = str(ei.value)
    assert msg == (
        "load_weights: lm_head.weight refused: tied embeddings: lm_head.weight must equal "
        "model.embed_tokens.weight (tie_word_embeddings=True; the model keeps one tensor for both), but 1 of "
        f"6464 element(s) differ bitwise, max abs difference {want:.6g} (compared with the "
        "model.embed_tokens.weight received in the same call); nothing of this load_weights call was loaded"
    )
    assert isinstance(ei.value, WireMismatchError) and isinstance(ei.value, ValueError)
    assert ei.value.max_abs_diff == want and ei.value.differing == 1
    assert _unchanged(m, before)
    assert torch.equal(m.forward_full(ids), ref)

    # alone in a call, lm_head.weight is compared with the embedding already loaded
    with pytest.raises(
        TiedWeightMismatchError,
        match=r"max abs difference .* \(compared with the "
        r"model\.embed_tokens\.weight already loaded\)",
    ) as ei2:
        m.load_weights([("lm_head.weight", sd2["model.embed_tokens.weight"])])
    assert ei2.value.differing > 6000
    assert _unchanged(m, before)
    assert m.load_weights([("lm_head.weight", sd["model.embed_tokens.weight"].clone())]) == set()
    # wrong shape or dtype of the alias: the usual input errors
    with pytest.raises(ValueError, match=r"lm_head\.weight: expected shape \(101, 64\), got \(100, 64\)"):
        m.load_weights([("lm_head.weight", torch.zeros(100, 64))])
    assert _unchanged(m, before)


def test_load_weights_checks_every_item_before_copying() -> None:
    m = engine_for(make_hf("LlamaForCausalLM", num_key_value_heads=2))
    before = _snapshot(m)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected shape \(64,\), got \(65,\)"):
        m.load_weights(
            [("model.layers.0.mlp.up_proj.weight", torch.ones(96, 64)), ("model.norm.weight", torch.ones(65))]
        )
    with pytest.raises(KeyError, match="bogus"):
        m.load_weights([("model.layers.0.mlp.up_proj.weight", torch.ones(96, 64)), ("bogus", torch.ones(1))])
    assert _unchanged(m, before)


def test_load_weights_shards_in_place_and_errors() -> None:
    m = engine_for(make_hf("LlamaForCausalLM", num_key_value_heads=2))
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    params = {n: p for n, p in m.named_parameters()}
    k = torch.arange(32 * 64, dtype=torch.float32).reshape(64, 32).t()  # non-contiguous source
    assert m.load_weights([("model.layers.1.self_attn.k_proj.weight", k)]) == {
        "model.layers.1.self_attn.k_proj.weight"
    }
    qkv = m.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    assert torch.equal(qkv[64:96], k)
    up = torch.full((96, 64), 3.0)
    m.load_weights([("model.layers.0.mlp.up_proj.weight", up)])
    assert torch.equal(m.get_parameter("model.layers.0.mlp.gate_up_proj.weight")[96:], up)
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
    assert all(p is params[n] for n, p in m.named_parameters())
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        m.load_weights([("model.layers.2.mlp.up_proj.weight", up)])
    with pytest.raises(KeyError, match="bogus"):
        m.load_weights([("bogus", up)])
    with pytest.raises(ValueError, match=r"v_proj\.weight: expected shape \(32, 64\), got \(33, 64\)"):
        m.load_weights([("model.layers.0.self_attn.v_proj.weight", torch.zeros(33, 64))])
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight: expected dtype torch\.float32, got torch\.bfloat16"
    ):
        m.load_weights([("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))])


def test_int8_quantization_in_place() -> None:
    hf = make_hf("LlamaForCausalLM", num_key_value_heads=2)
    m = engine_for(hf, quantization="int8")
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    scale_ptr = m.model.layers[0].self_attn.qkv_proj.weight_scale.data_ptr()
    m.process_weights_after_loading()
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
    assert m.model.layers[0].self_attn.qkv_proj.weight_scale.data_ptr() == scale_ptr
    for n, p in m.named_parameters():
        if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            mod = m.get_submodule(n.rsplit(".", 1)[0])
            scale = mod.weight_scale
            w0 = before[n]
            torch.testing.assert_close(scale, w0.abs().amax(dim=1) / 127.0)
            q = p.detach() / scale[:, None]
            assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127.0 + 1e-3
            assert (p.detach() - w0).abs().max() <= scale.max() / 2 + 1e-6
            assert not torch.equal(p.detach(), w0)
        else:
            assert torch.equal(p.detach(), before[n]), n
    # quantized model stays close to the float one
    ids = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (m.forward_full(ids) - ref).abs().max().item() < 0.1


def test_quantization_off_by_default_is_noop() -> None:
    m = engine_for(make_hf("LlamaForCausalLM"))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.process_weights_after_loading()
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_config_parsing(tmp_path: Any) -> None:
    hf = make_hf("Qwen2ForCausalLM", num_key_value_heads=2, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    cfg = LMConfig.from_json_file(tmp_path)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias and not cfg.o_bias
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert cfg.dtype == torch.float32 and cfg.rms_norm_eps == 1e-5
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 10,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    }
    c2 = LMConfig.from_hf_dict(legacy)
    assert c2.rope_theta == 500000.0 and c2.dtype == torch.bfloat16 and c2.num_key_value_heads == 4
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        LMConfig.from_hf_dict({**legacy, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="gpt2"):
        LMConfig.from_hf_dict({**legacy, "architectures": None, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type"):
        LMConfig.from_hf_dict({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding"):
        LMConfig.from_hf_dict({**legacy, "use_sliding_window": True})
    with pytest.raises(ValueError, match="int4"):
        LMConfig.from_hf_dict(legacy, quantization="int4")  # type: ignore[arg-type]
    (tmp_path / "bad.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="JSON object"):
        LMConfig.from_json_file(tmp_path / "bad.json")


def test_sampling_greedy_and_seeded() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    greedy = RequestSampler(SamplingParams(temperature=0.0))
    tok, lp = greedy.sample(logits[0])
    assert tok == 1
    assert lp == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())

    def draws(seed: int) -> list[int]:
        s = RequestSampler(SamplingParams(temperature=1.0, seed=seed))
        return [s.sample(logits[0])[0] for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    s = RequestSampler(SamplingParams(temperature=0.5, seed=1, stop_token_ids=(3,)))
    t, lp = s.sample(logits[1])
    assert lp == pytest.approx(torch.log_softmax(logits[1] / 0.5, -1)[t].item())
    assert s.is_stop(3) and not s.is_stop(0)
    out = sample_batch(logits, [RequestSampler(SamplingParams(temperature=0.0)) for _ in range(2)])
    assert [t for t, _ in out] == [1, 0]
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        sample_batch(logits, [greedy])
