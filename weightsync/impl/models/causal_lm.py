"""The reference causal LM an inference engine runs: Llama/Qwen2 with vLLM's fused parameter layout.

Layout (vLLM ``model_executor/models/llama.py``): per layer one ``self_attn.qkv_proj`` (rows ``[q | k | v]``),
one ``self_attn.o_proj``, one ``mlp.gate_up_proj`` (rows ``[gate | up]``), one ``mlp.down_proj`` and two
RMSNorms; ``lm_head`` shares ``model.embed_tokens.weight`` when the config ties embeddings.

Exactness rule (the post-sync check of issue 5): in float32, :meth:`CausalLM.forward_full` returns logits
bit-identical (``torch.equal``) to ``transformers`` ``LlamaForCausalLM``/``Qwen2ForCausalLM`` with the same
weights and ``attn_implementation="sdpa"`` (the CPU default). The forward therefore mirrors
``modeling_llama.py`` op for op: q, k, v are computed by three ``F.linear`` calls on *row slices* of the fused
weight (contiguous views with the same strides as HF's separate weights) instead of one fused matmul; RMSNorm,
rotary (cos/sin from ``position_ids[..., None].float() * inv_freq``) and the SDPA call (``is_causal`` without a
mask, ``enable_gqa`` for grouped heads) use the same formulas, shapes and dtype casts. The same holds in
bfloat16 (tested) provided the HF model keeps its rotary ``inv_freq`` in float32, as ``from_pretrained(dtype=)``
and ``_from_config(dtype=)`` do; ``hf_model.to(torch.bfloat16)`` rounds that buffer and changes HF's cos/sin
(max |diff| of about 1e-3 in the logits of the test model). ``prefill`` on an empty cache equals
``forward_full`` on ``[1, T]`` exactly; KV-cached ``decode`` uses other matmul shapes and agrees to float32
rounding (about 1e-7), not bit for bit.

Serving API (continuous batching): one :class:`KVCache` per request; :meth:`CausalLM.prefill` runs a prompt
(or a continuation chunk) for one request; :meth:`CausalLM.decode` advances several requests of different
lengths by one token each in one step (projections and MLP batched, attention per request).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.impl.models.config import LMConfig
from weightsync.spec.errors import WireMismatchError

__all__ = ["TIED_LM_HEAD", "TIED_SOURCE", "CausalLM", "KVCache", "RMSNorm", "TiedWeightMismatchError"]

#: The checkpoint name a tied model accepts as an alias of :data:`TIED_SOURCE` (Hugging Face's
#: ``state_dict()`` of a tied model lists both).
TIED_LM_HEAD = "lm_head.weight"
#: The checkpoint (and kernel) name of the one tensor a tied model keeps for embedding and LM head.
TIED_SOURCE = "model.embed_tokens.weight"
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TiedWeightMismatchError(WireMismatchError, ValueError):
    """A tied-embedding model received an ``lm_head.weight`` that is not bit-equal to its embedding.

    Raised by :meth:`CausalLM.load_weights` before it copies anything of the call. It is a
    :class:`~weightsync.spec.errors.WireMismatchError` (trainer and engine disagree on what the weights
    are), detected when the payload has arrived rather than at the wire agreement, and a ``ValueError``
    like the other input errors of ``load_weights``.

    Attributes:
        max_abs_diff: ``max |lm_head.weight - model.embed_tokens.weight|`` computed in float64 (NaN when a
            NaN is involved).
        differing: number of elements whose bits differ.
        reference: ``"received in the same call"`` or ``"already loaded"``: what ``lm_head.weight`` was
            compared with.
    """

    def __init__(self, max_abs_diff: float, differing: int, numel: int, reference: str) -> None:
        self.max_abs_diff = max_abs_diff
        self.differing = differing
        self.reference = reference
        super().__init__(
            f"load_weights: {TIED_LM_HEAD} refused: tied embeddings: {TIED_LM_HEAD} must equal "
            f"{TIED_SOURCE} (tie_word_embeddings=True; the model keeps one tensor for both), but "
            f"{differing} of {numel} element(s) differ bitwise, max abs difference {max_abs_diff:.6g} "
            f"(compared with the {TIED_SOURCE} {reference}); nothing of this load_weights call was loaded"
        )


def _tie_difference(lm_head: torch.Tensor, embed: torch.Tensor) -> tuple[int, float]:
    """(bitwise-differing elements, max abs difference in float64) of two same-shape, same-dtype tensors."""
    a = lm_head.detach().reshape(-1)
    b = embed.detach().reshape(-1).to(a.device)
    iv = _INT_VIEW[a.element_size()]
    differing = int((a.contiguous().view(iv) != b.contiguous().view(iv)).sum())
    if differing == 0:
        return 0, 0.0
    return differing, float((a.double() - b.double()).abs().max())


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


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_IGNORED_SUFFIXES = ("self_attn.rotary_emb.inv_freq",)


class _Attention(nn.Module):
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


class _MLP(nn.Module):
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


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg, device)
        self.mlp = _MLP(cfg, device)
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


class _Backbone(nn.Module):
    def __init__(self, cfg: LMConfig, device: torch.device | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.layers = nn.ModuleList([_DecoderLayer(cfg, device) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)


class CausalLM(nn.Module):
    """Llama/Qwen2 decoder in an inference engine's fused layout; satisfies the ``LoadableModel`` protocol.

    Parameters are created deterministically (zeros for projections and embeddings, ones for norms) and are
    meant to be overwritten by :meth:`load_weights`; their storage is never replaced afterwards, so
    ``data_ptr()`` is stable across weight updates and post-processing.

    Kernel-format names (``named_parameters()``, the ``is_checkpoint_format=False`` copy path):
    ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.qkv_proj.weight`` (``[q+2kv, H]``, plus
    ``.bias`` when the config has q/k/v bias), ``...self_attn.o_proj.weight``, ``...mlp.gate_up_proj.weight``
    (``[2I, H]``), ``...mlp.down_proj.weight``, ``...input_layernorm.weight``,
    ``...post_attention_layernorm.weight``, ``model.norm.weight`` and, untied only, ``lm_head.weight``.

    Args:
        config: the architecture (see :class:`LMConfig`).
        device: where to allocate parameters (default CPU).
    """

    def __init__(self, config: LMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self.config = config
        self.model = _Backbone(config, dev)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype, device=dev
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                else:
                    p.zero_()
        self._quant_modules: list[nn.Linear] = []
        if config.quantization == "int8":
            for layer in self.model.layers:
                assert isinstance(layer, _DecoderLayer)
                for mod in (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                ):
                    mod.register_buffer(
                        "weight_scale",
                        torch.ones(mod.out_features, dtype=torch.float32, device=dev),
                        persistent=False,
                    )
                    self._quant_modules.append(mod)
        self._targets = self._build_checkpoint_map()

    # ------------------------------------------------------------------ weight loading

    def _build_checkpoint_map(self) -> dict[str, tuple[str, nn.Parameter, int, int]]:
        """HF checkpoint name -> (kernel name, parameter, first row, end row) of the destination shard."""
        cfg = self.config
        out: dict[str, tuple[str, nn.Parameter, int, int]] = {}

        def whole(ckpt: str, kernel: str) -> None:
            p = self.get_parameter(kernel)
            assert isinstance(p, nn.Parameter)
            out[ckpt] = (kernel, p, 0, p.shape[0])

        whole("model.embed_tokens.weight", "model.embed_tokens.weight")
        whole("model.norm.weight", "model.norm.weight")
        if not cfg.tie_word_embeddings:
            whole("lm_head.weight", "lm_head.weight")
        qkv_bounds = {
            "q_proj": (0, cfg.q_size),
            "k_proj": (cfg.q_size, cfg.q_size + cfg.kv_size),
            "v_proj": (cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size),
        }
        i_size = cfg.intermediate_size
        gu_bounds = {"gate_proj": (0, i_size), "up_proj": (i_size, 2 * i_size)}
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            whole(pre + "input_layernorm.weight", pre + "input_layernorm.weight")
            whole(pre + "post_attention_layernorm.weight", pre + "post_attention_layernorm.weight")
            suffixes = ["weight"] + (["bias"] if cfg.qkv_bias else [])
            for proj, (s, e) in qkv_bounds.items():
                for suf in suffixes:
                    kernel = f"{pre}self_attn.qkv_proj.{suf}"
                    p = self.get_parameter(kernel)
                    assert isinstance(p, nn.Parameter)
                    out[f"{pre}self_attn.{proj}.{suf}"] = (kernel, p, s, e)
            for suf in ["weight"] + (["bias"] if cfg.o_bias else []):
                whole(f"{pre}self_attn.o_proj.{suf}", f"{pre}self_attn.o_proj.{suf}")
            mlp_suffixes = ["weight"] + (["bias"] if cfg.mlp_bias else [])
            for proj, (s, e) in gu_bounds.items():
                for suf in mlp_suffixes:
                    kernel = f"{pre}mlp.gate_up_proj.{suf}"
                    p = self.get_parameter(kernel)
                    assert isinstance(p, nn.Parameter)
                    out[f"{pre}mlp.{proj}.{suf}"] = (kernel, p, s, e)
            for suf in mlp_suffixes:
                whole(f"{pre}mlp.down_proj.{suf}", f"{pre}mlp.down_proj.{suf}")
        return out

    def checkpoint_weight_names(self) -> set[str]:
        """Every Hugging Face checkpoint name :meth:`load_weights` expects exactly once per update round.

        With tied embeddings ``lm_head.weight`` is *not* expected; it may still be sent, and is then checked
        against the embedding (see :meth:`tied_checkpoint_weights`).
        """
        return set(self._targets)

    def tied_checkpoint_weights(self) -> dict[str, str]:
        """Checkpoint names accepted as aliases of another one: ``{alias: source}``.

        With ``tie_word_embeddings`` this is ``{"lm_head.weight": "model.embed_tokens.weight"}`` (Hugging
        Face's ``state_dict()`` lists both names for the one tensor): :meth:`load_weights` accepts the
        alias only when it is bit-equal to the source and never copies it. Empty when untied. The transfer
        worker uses this to accept the alias and to bring it and its source into one ``load_weights`` call.
        """
        return {TIED_LM_HEAD: TIED_SOURCE} if self.config.tie_word_embeddings else {}

    def kernel_name_for(self, checkpoint_name: str) -> str:
        """The kernel-format parameter a checkpoint name is loaded into (e.g. ``...q_proj.weight`` ->
        ``...qkv_proj.weight``). Raises KeyError for a name :meth:`checkpoint_weight_names` lacks."""
        return self._targets[checkpoint_name][0]

    def _is_skipped(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        return (
            m is not None
            and m.group(2) in _IGNORED_SUFFIXES
            and int(m.group(1)) < self.config.num_hidden_layers
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the fused parameters, in place.

        Each tensor must have exactly the destination shard's shape and dtype (no implicit casts: the wire
        agreement already fixed dtypes). ``q_proj``/``k_proj``/``v_proj`` go to row ranges ``[0, q)``,
        ``[q, q+kv)``, ``[q+kv, q+2kv)`` of ``qkv_proj``; ``gate_proj``/``up_proj`` to ``[0, I)``/``[I, 2I)`` of
        ``gate_up_proj`` (vLLM's ``stacked_params_mapping``). The ``Parameter`` objects and their storage are
        never replaced. Legacy ``self_attn.rotary_emb.inv_freq`` buffers are skipped without error.

        Tied embeddings (``tie_word_embeddings=True``): ``lm_head.weight`` is accepted, never copied and not
        returned, only when it is bit-equal (same shape, dtype and bytes) to ``model.embed_tokens.weight`` as
        given in the same call (the last one if listed twice), or, when the call has none, to the embedding
        already loaded in the model. Untied models load ``lm_head.weight`` like any other weight.

        Every item is checked before anything is copied: when this raises, no parameter changed.

        Args:
            weights: ``(checkpoint_name, tensor)`` pairs, any device, contiguous or not.

        Returns:
            The checkpoint names loaded by this call.

        Raises:
            KeyError: a name that is not a checkpoint name of this architecture (message names it).
            ValueError: shape or dtype differs from the destination (message names the name, expected, got).
            TiedWeightMismatchError: (a ``ValueError``) tied embeddings and ``lm_head.weight`` differs from
                ``model.embed_tokens.weight``; the message gives the rule, the number of differing elements
                and the max abs difference.
        """
        tied = self.config.tie_word_embeddings
        plan: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        heads: list[torch.Tensor] = []
        embed: torch.Tensor | None = None
        for name, tensor in weights:
            target = self._targets.get(name)
            if target is None and tied and name == TIED_LM_HEAD:
                target = self._targets[TIED_SOURCE]
            if target is None:
                if self._is_skipped(name):
                    continue
                raise KeyError(
                    f"load_weights: unknown checkpoint weight {name!r} for {self.config.architecture} "
                    f"with {self.config.num_hidden_layers} layers"
                )
            _, param, s, e = target
            dst = param.data if (s == 0 and e == param.shape[0]) else param.data[s:e]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(
                    f"load_weights: {name}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}"
                )
            if tensor.dtype != dst.dtype:
                raise ValueError(f"load_weights: {name}: expected dtype {dst.dtype}, got {tensor.dtype}")
            if tied and name == TIED_LM_HEAD:
                heads.append(tensor)
                continue
            if name == TIED_SOURCE:
                embed = tensor
            plan.append((name, dst, tensor))
        if heads:
            reference = "received in the same call" if embed is not None else "already loaded"
            ref = embed if embed is not None else self.model.embed_tokens.weight.data
            for head in heads:
                differing, max_diff = _tie_difference(head, ref)
                if differing:
                    raise TiedWeightMismatchError(max_diff, differing, head.numel(), reference)
        loaded: set[str] = set()
        with torch.no_grad():
            for name, dst, tensor in plan:
                dst.copy_(tensor)
                loaded.add(name)
        return loaded

    def process_weights_after_loading(self) -> None:
        """Post-processing run by ``finish_weight_update`` once every weight of the round has arrived.

        With ``config.quantization == "int8"``: symmetric weight-only int8 fake quantization of every linear
        projection (qkv, o, gate_up, down; not embeddings, norms or lm_head), per output channel:
        ``scale[r] = max|W[r, :]| / 127`` (1 where the row is all zero) in float32,
        ``W[r, :] <- clamp(round(W[r, :] / scale[r]), -127, 127) * scale[r]`` cast back to the parameter dtype.
        Written in place into the existing storage (``data_ptr()`` unchanged, so captured graphs stay valid, as
        vLLM's layerwise reload requires); the scales go to the non-persistent ``weight_scale`` buffer of each
        projection (``[out_features]`` float32, also updated in place). Idempotent up to float rounding.
        Without quantization it does nothing.
        """
        if not self._quant_modules:
            return
        with torch.no_grad():
            for mod in self._quant_modules:
                w = mod.weight.data
                wf = w.float()
                scale = wf.abs().amax(dim=1) / 127.0
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                q = torch.round(wf / scale[:, None]).clamp_(-127, 127)
                w.copy_((q * scale[:, None]).to(w.dtype))
                buf = mod.get_buffer("weight_scale")
                buf.copy_(scale)

    # ------------------------------------------------------------------ forward

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for one request on this model's device and dtype."""
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.dtype,
            self.lm_head.weight.device,
            max_len=max_len or cfg.max_position_embeddings,
        )

    def _run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[KVCache] | None
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(h, position_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, i, caches)
        return self.model.norm(h)  # type: ignore[no-any-return]

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of unpadded prompts, no cache (probes and the exactness check).

        Args:
            input_ids: ``[B, T]`` int64 token ids, all rows the same length (no padding).

        Returns:
            ``[B, T, vocab_size]`` logits in the model dtype; bit-identical in float32 to the HF model on the
            same ``input_ids`` with ``attn_implementation="sdpa"``.

        Raises:
            ValueError: ``input_ids`` is not 2-D or is empty.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"forward_full: input_ids must be [B, T] with T > 0, got {tuple(input_ids.shape)}"
            )
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self._run(input_ids, position_ids, None)
        return self.lm_head(h)  # type: ignore[no-any-return]

    def probe_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``forward_full`` on each prompt separately (shape ``[1, T_i]``): a list of ``[T_i, V]`` logits.

        The trainer side (:func:`weightsync.demo.trainer.trainer_probe_logits`) uses the same shapes, so the
        two are comparable with ``torch.equal``.
        """
        dev = self.lm_head.weight.device
        return [self.forward_full(torch.tensor([list(p)], dtype=torch.long, device=dev))[0] for p in prompts]

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Process ``tokens`` for one request, appending them to ``cache``; return next-token logits.

        If the cache is empty this is the prompt prefill (bit-identical to ``forward_full`` on the same
        tokens); if not, the tokens continue the cached sequence (a causal mask offsets the positions).

        Args:
            tokens: ``[T]`` token ids, ``T >= 1``.
            cache: the request's cache; its ``length`` advances by T.

        Returns:
            ``[vocab_size]`` logits of the last position, model dtype.

        Raises:
            ValueError: empty ``tokens`` or the cache would exceed its ``max_len``.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.lm_head.weight.device).reshape(1, -1)
        t = ids.shape[1]
        if t == 0:
            raise ValueError("prefill: tokens must be non-empty")
        cache._reserve(t)
        position_ids = torch.arange(cache.length, cache.length + t, device=ids.device).unsqueeze(0)
        h = self._run(ids, position_ids, [cache])
        cache.length += t
        return self.lm_head(h)[0, -1]  # type: ignore[no-any-return]

    @torch.no_grad()
    def decode(self, batch: Sequence[tuple[int, KVCache]]) -> torch.Tensor:
        """One decode step for several requests at once (continuous batching).

        Args:
            batch: ``(token, cache)`` per request: the last sampled token and that request's cache (lengths may
                differ). Each cache's ``length`` advances by one. Caches must be distinct objects.

        Returns:
            ``[B, vocab_size]`` next-token logits, model dtype, row b for ``batch[b]``.

        Raises:
            ValueError: empty batch, a cache used twice, an empty cache (prefill first), or a full cache.
        """
        if not batch:
            raise ValueError("decode: empty batch")
        caches = [c for _, c in batch]
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("decode: the same KVCache appears twice in one batch")
        for c in caches:
            if c.length == 0:
                raise ValueError("decode: a request's cache is empty; call prefill first")
            c._reserve(1)
        dev = self.lm_head.weight.device
        ids = torch.tensor([[tok] for tok, _ in batch], dtype=torch.long, device=dev)
        position_ids = torch.tensor([[c.length] for c in caches], dtype=torch.long, device=dev)
        h = self._run(ids, position_ids, caches)
        for c in caches:
            c.length += 1
        return self.lm_head(h[:, -1])  # type: ignore[no-any-return]

    def kernel_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Alias of ``named_parameters()`` (deduplicated, so a tied ``lm_head.weight`` is absent)."""
        return self.named_parameters()
