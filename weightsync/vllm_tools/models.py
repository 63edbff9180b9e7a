"""Tiny Hugging Face checkpoints built locally (no model hub), for the real-vLLM tests and demos.

:func:`build_tiny_llama` writes a dense ``LlamaForCausalLM`` (hidden 128, 2 layers, vocabulary 512 by
default; float32 safetensors) and a ``tokenizers`` WordLevel tokenizer saved as
``PreTrainedTokenizerFast`` (tokens ``<pad> <s> </s> <unk>`` then ``w4 .. w511``), which vLLM loads
offline. :func:`build_tiny_mixtral` writes the MoE counterpart (``MixtralForCausalLM``: hidden 128,
2 layers, 4 experts, top-2, vocabulary 512), which vLLM serves through its fused-MoE layers. Nothing
here imports vLLM.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

#: The fields both tiny models share: a 512-word vocabulary, hidden size 128, 2 layers, 4 query heads over 2
#: key/value heads (head dimension 32), 256 positions, untied embeddings, the tokenizer's special token ids
#: and float32 weights.
_TINY_FIELDS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def tiny_llama_config(**overrides: Any) -> Any:
    """The ``transformers.LlamaConfig`` of the tiny model (keyword arguments override fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TINY_FIELDS, "intermediate_size": 256, **overrides})


def tiny_mixtral_config(**overrides: Any) -> Any:
    """The ``transformers.MixtralConfig`` of the tiny MoE model (keyword arguments override fields).

    The expert intermediate size and the hidden size (128) are multiples of 32, the alignment of vLLM's
    CPU grouped-GEMM experts (``fused_moe/experts/cpu_moe.py``), so no padding is involved; the head
    dimension is 32 (vLLM's CPU attention refuses 16).
    """
    from transformers import MixtralConfig

    moe = {"intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
    return MixtralConfig(**{**_TINY_FIELDS, **moe, **overrides})


def save_word_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over ``<pad> <s> </s> <unk> w4 .. w{vocab_size-1}``, saved in ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast_cls: Any = PreTrainedTokenizerFast
    fast = fast_cls(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out))


def _build(model_cls: Any, cfg: Any, out: str | pathlib.Path, seed: int) -> Any:
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = model_cls(cfg).to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    save_word_tokenizer(path, int(cfg.vocab_size))
    return model


def build_tiny_llama(out: str | pathlib.Path, seed: int = 0, **overrides: Any) -> Any:
    """Write the tiny Llama (random weights from ``seed``) and its tokenizer to ``out``; return the
    ``transformers`` model (float32, eval mode)."""
    from transformers import LlamaForCausalLM

    return _build(LlamaForCausalLM, tiny_llama_config(**overrides), out, seed)


def build_tiny_mixtral(out: str | pathlib.Path, seed: int = 0, **overrides: Any) -> Any:
    """Write the tiny Mixtral (random weights from ``seed``) and its tokenizer to ``out``; return the
    ``transformers`` model (float32, eval mode)."""
    from transformers import MixtralForCausalLM

    return _build(MixtralForCausalLM, tiny_mixtral_config(**overrides), out, seed)


def perturbed_state(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """New weights for ``model``: every parameter plus ``scale`` times Gaussian noise from ``seed``
    (checkpoint names, float32, detached copies)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        out[name] = (p.detach().to(torch.float32) + scale * noise).contiguous()
    return out


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s weights under their checkpoint names and layouts, as ``save_pretrained`` writes them
    and vLLM's ``load_weights`` expects (detached contiguous copies).

    transformers 5 holds some models in another layout than their checkpoints: a Mixtral's experts are
    fused in memory (``mlp.experts.gate_up_proj`` / ``down_proj``) but saved per expert
    (``block_sparse_moe.experts.N.w1/w2/w3.weight``). The conversion is transformers' own
    (``core_model_loading.revert_weight_conversion``, what ``save_pretrained`` applies); a dense Llama
    comes back unchanged.
    """
    state = {n: t.detach() for n, t in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: memory layout is the checkpoint's
        reverted = state
    else:
        reverted = revert_weight_conversion(model, state)
    return {n: t.detach().contiguous().clone() for n, t in reverted.items()}


def greedy_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of a ``transformers`` causal LM after ``prompt`` (no cache, float32)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids).logits[0, -1]
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


__all__ = [
    "build_tiny_llama",
    "build_tiny_mixtral",
    "checkpoint_state",
    "greedy_tokens",
    "perturbed_state",
    "save_word_tokenizer",
    "tiny_llama_config",
    "tiny_mixtral_config",
]
