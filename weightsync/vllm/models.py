"""Tiny Hugging Face checkpoints built locally (no model hub), for the real-vLLM tests and demos.

:func:`build_tiny_llama` writes a dense ``LlamaForCausalLM`` (hidden 128, 2 layers, vocabulary 512 by
default; float32 safetensors) and a ``tokenizers`` WordLevel tokenizer saved as
``PreTrainedTokenizerFast`` (tokens ``<pad> <s> </s> <unk>`` then ``w4 .. w511``), which vLLM loads
offline. Nothing here imports vLLM.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch


def tiny_llama_config(**overrides: Any) -> Any:
    """The ``transformers.LlamaConfig`` of the tiny model (keyword arguments override fields)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
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
    kw.update(overrides)
    return LlamaConfig(**kw)


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


def build_tiny_llama(out: str | pathlib.Path, seed: int = 0, **overrides: Any) -> Any:
    """Write the tiny Llama (random weights from ``seed``) and its tokenizer to ``out``; return the
    ``transformers`` model (float32, eval mode)."""
    from transformers import LlamaForCausalLM

    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_llama_config(**overrides)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model_cls: Any = LlamaForCausalLM
        model = model_cls(cfg).to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    save_word_tokenizer(path, int(cfg.vocab_size))
    return model


def perturbed_state(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """New weights for ``model``: every parameter plus ``scale`` times Gaussian noise from ``seed``
    (checkpoint names, float32, detached copies)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        out[name] = (p.detach().to(torch.float32) + scale * noise).contiguous()
    return out


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


__all__ = ["build_tiny_llama", "greedy_tokens", "perturbed_state", "save_word_tokenizer", "tiny_llama_config"]
