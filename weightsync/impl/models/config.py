"""Configuration of the reference causal LM, read from a Hugging Face ``config.json``.

Only the decoder-only architectures whose forward pass the reference model reproduces op for op are
accepted: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (transformers ``modeling_llama.py`` and
``modeling_qwen2.py``). Anything else raises :class:`ValueError` naming the architecture, so an engine never
silently runs a model it does not implement.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""Hugging Face ``architectures`` entries the reference LM implements."""

_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

Quantization = Literal["int8"]
"""Post-load quantization schemes the reference LM applies in ``process_weights_after_loading``."""


@dataclass(frozen=True)
class LMConfig:
    """Hyper-parameters of a Llama/Qwen2 decoder, as the reference LM needs them.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: model width H.
        intermediate_size: MLP width I (gate and up projections are ``[I, H]`` each).
        num_hidden_layers: number of decoder layers L.
        num_attention_heads: query heads; ``num_attention_heads * head_dim`` is the q projection width.
        num_key_value_heads: key/value heads (grouped-query attention when smaller than the query heads).
        head_dim: per-head width (``hidden_size // num_attention_heads`` unless the config says otherwise).
        rms_norm_eps: epsilon added to the mean square in RMSNorm.
        rope_theta: rotary embedding base (only the "default" rope type is supported).
        max_position_embeddings: longest sequence the model is meant for (used as the KV-cache limit).
        tie_word_embeddings: ``lm_head`` shares ``model.embed_tokens.weight``.
        qkv_bias: q/k/v projections carry a bias (Qwen2 always; Llama when ``attention_bias``).
        o_bias: o projection carries a bias (Llama ``attention_bias``; never in Qwen2).
        mlp_bias: gate/up/down projections carry a bias (Llama ``mlp_bias``).
        hidden_act: MLP activation; only ``"silu"`` is implemented.
        dtype: parameter dtype (``torch_dtype``/``dtype`` in config.json; float32 when absent).
        bos_token_id, eos_token_id, pad_token_id: special token ids from the config (may be None).
        quantization: ``"int8"`` for weight-only int8 fake quantization at finish, or None (default).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str = "silu"
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: 'silu'")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"unsupported quantization {self.quantization!r}; supported: None, 'int8'")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        """Rows of the q shard of ``qkv_proj``: ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of the k (and of the v) shard of ``qkv_proj``: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    def with_quantization(self, quantization: Quantization | None) -> LMConfig:
        """Return a copy with ``quantization`` set (the HF config has no field for our int8 option)."""
        return replace(self, quantization=quantization)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], quantization: Quantization | None = None) -> LMConfig:
        """Build from the parsed contents of a Hugging Face ``config.json``.

        Reads both the transformers 4.x (``rope_theta``, ``torch_dtype``) and 5.x (``rope_parameters``,
        ``dtype``) spellings.

        Raises:
            ValueError: unsupported architecture/model_type, rope type other than "default", sliding-window
                attention enabled, unknown dtype, or inconsistent head counts; the message names the field.
            KeyError: a required field (e.g. ``hidden_size``) is missing.
        """
        archs = d.get("architectures") or []
        arch: str | None = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = a
                break
        if arch is None:
            if archs:
                raise ValueError(
                    f"unsupported architecture(s) {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            model_type = d.get("model_type")
            if model_type not in _MODEL_TYPE_TO_ARCH:
                raise ValueError(
                    f"unsupported model_type {model_type!r} (no architectures listed); supported: "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            arch = _MODEL_TYPE_TO_ARCH[str(model_type)]

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; only 'default' rotary embeddings are implemented"
            )
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))

        if d.get("use_sliding_window", False):
            raise ValueError(
                "unsupported: use_sliding_window=true (sliding-window attention is not implemented)"
            )

        dtype_name = d.get("dtype") or d.get("torch_dtype") or "float32"
        if str(dtype_name) not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r}; supported: {', '.join(sorted(_DTYPES))}")

        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // n_heads
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(d.get("attention_bias", False))

        def _opt_int(key: str) -> int | None:
            v = d.get(key)
            if isinstance(v, list):
                v = v[0] if v else None
            return None if v is None else int(v)

        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if is_qwen2 else bool(d.get("mlp_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            dtype=_DTYPES[str(dtype_name)],
            bos_token_id=_opt_int("bos_token_id"),
            eos_token_id=_opt_int("eos_token_id"),
            pad_token_id=_opt_int("pad_token_id"),
            quantization=quantization,
        )

    @classmethod
    def from_json_file(cls, path: str | pathlib.Path, quantization: Quantization | None = None) -> LMConfig:
        """Read ``path`` (a ``config.json``, or a directory holding one) and call :meth:`from_hf_dict`.

        Raises:
            FileNotFoundError: no config.json at ``path``.
            ValueError, KeyError: as :meth:`from_hf_dict`.
        """
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "config.json"
        with p.open(encoding="utf-8") as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a JSON object, got {type(d).__name__}")
        return cls.from_hf_dict(d, quantization=quantization)
