"""The reference causal LM's building blocks (vLLM ``model_executor/models/llama.py`` layout): RMSNorm,
rotary embedding, the per-request KV cache, attention with one fused ``qkv_proj``, the MLP with one fused
``gate_up_proj``, the decoder layer and the backbone. The exactness rule they keep (bit-identical to
``transformers`` in float32) is stated in :mod:`weightsync.impl.models.causal_lm`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.impl.models.config import LMConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, identical to HF ``LlamaRMSNorm``/``Qwen2RMSNorm``.

    ``y = weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``; input ``[..., H]``.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Default rotary embedding; ``inv_freq`` is a non-persistent buffer (never transferred).

    ``forward(x, position_ids[B, T]) -> (cos, sin)`` each ``[B, T, head_dim]`` in ``x.dtype`` (HF formula).
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, base: float, device: torch.device | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


class KVCache:
    """Key/value cache of one request: per layer ``[1, num_kv_heads, capacity, head_dim]`` in the model dtype.

    ``length`` is the number of positions already processed (the position of the next token). Storage grows by
    doubling up to ``max_len``; :meth:`clear` drops the contents (``length = 0``) and frees the storage, e.g.
    when a paused engine clears its cache and the request re-prefills under new weights.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        max_len: int = 2048,
        initial_capacity: int = 64,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_len = max_len
        self.initial_capacity = initial_capacity
        self.length = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        """Positions the current storage can hold without growing."""
        return self._k[0].shape[2] if self._k else 0

    def clear(self) -> None:
        """Forget every cached position (``length = 0``) and release the storage."""
        self.length = 0
        self._k = []
        self._v = []

    def _reserve(self, n_new: int) -> None:
        need = self.length + n_new
        if need > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length} + {n_new} positions exceed max_len {self.max_len}"
            )
        cap = self.capacity
        if need <= cap:
            return
        new_cap = max(self.initial_capacity, cap)
        while new_cap < need:
            new_cap *= 2
        new_cap = min(new_cap, self.max_len)
        shape = (1, self.num_kv_heads, new_cap, self.head_dim)
        ks, vs = [], []
        for i in range(self.num_layers):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if cap:
                k[:, :, : self.length].copy_(self._k[i][:, :, : self.length])
                v[:, :, : self.length].copy_(self._v[i][:, :, : self.length])
            ks.append(k)
            vs.append(v)
        self._k, self._v = ks, vs

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``[1, kvh, n, hd]`` at ``[length, length+n)``; return views of ``[0, length+n)``."""
        n = k.shape[2]
        end = self.length + n
        self._k[layer][:, :, self.length : end].copy_(k)
        self._v[layer][:, :, self.length : end].copy_(v)
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        h, dt = cfg.hidden_size, cfg.dtype
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, dtype=dt, device=device)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.o_bias, dtype=dt, device=device)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Three F.linear calls on contiguous row views of the fused weight: same op as HF's separate projections.
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        q_end = self.cfg.q_size
        k_end = q_end + self.cfg.kv_size
        bounds = ((0, q_end), (q_end, k_end), (k_end, k_end + self.cfg.kv_size))
        out = [F.linear(x, w[s:e], None if b is None else b[s:e]) for s, e in bounds]
        return out[0], out[1], out[2]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_idx: int,
        caches: Sequence[KVCache] | None,
    ) -> torch.Tensor:
        """``x [B, T, H]``; ``caches`` one per batch row or None (no cache, causal over T)."""
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q_, k_, v_ = self._qkv(x)
        q = q_.view(hidden_shape).transpose(1, 2)
        k = k_.view(hidden_shape).transpose(1, 2)
        v = v_.view(hidden_shape).transpose(1, 2)
        q, k = _apply_rotary(q, k, cos, sin)
        gqa = self.num_key_value_groups > 1
        if caches is None:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=0.0,
                scale=self.scaling,
                is_causal=q.shape[2] > 1,
                enable_gqa=gqa,
            )
        else:
            outs = []
            t = q.shape[2]
            for b, cache in enumerate(caches):
                past = cache.length
                kk, vv = cache._write(layer_idx, k[b : b + 1], v[b : b + 1])
                mask: torch.Tensor | None = None
                causal = False
                if t > 1:
                    if past == 0:
                        causal = True
                    else:
                        pos_q = torch.arange(past, past + t, device=q.device)[:, None]
                        mask = pos_q >= torch.arange(past + t, device=q.device)[None, :]
                outs.append(
                    F.scaled_dot_product_attention(
                        q[b : b + 1],
                        kk,
                        vv,
                        attn_mask=mask,
                        dropout_p=0.0,
                        scale=self.scaling,
                        is_causal=causal,
                        enable_gqa=gqa,
                    )
                )
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        out = out.transpose(1, 2).contiguous()
        out = out.reshape(*input_shape, -1).contiguous()
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=cfg.dtype, device=device
        )
        self.down_proj = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=cfg.dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
        i = self.intermediate_size
        gate = F.linear(x, w[:i], None if b is None else b[:i])
        up = F.linear(x, w[i:], None if b is None else b[i:])
        return F.linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, device)
        self.mlp = MLP(cfg, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_idx: int,
        caches: Sequence[KVCache] | None,
    ) -> torch.Tensor:
        residual = h
        h = self.input_layernorm(h)
        h = self.self_attn(h, cos, sin, layer_idx, caches)
        h = residual + h
        residual = h
        h = self.post_attention_layernorm(h)
        h = self.mlp(h)
        return residual + h


class Backbone(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.layers = nn.ModuleList([DecoderLayer(cfg, device) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)


__all__ = ["MLP", "Attention", "Backbone", "DecoderLayer", "KVCache", "RMSNorm", "RotaryEmbedding"]
