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
from torch import nn

from weightsync.impl.models.config import LMConfig
from weightsync.impl.models.layers import Backbone, DecoderLayer, KVCache, RMSNorm
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


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_IGNORED_SUFFIXES = ("self_attn.rotary_emb.inv_freq",)


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
        self.model = Backbone(config, dev)
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
                assert isinstance(layer, DecoderLayer)
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

        def param(kernel: str) -> nn.Parameter:
            p = self.get_parameter(kernel)
            assert isinstance(p, nn.Parameter)
            return p

        def whole(ckpt: str, kernel: str) -> None:
            p = param(kernel)
            out[ckpt] = (kernel, p, 0, p.shape[0])

        def sliced(pre: str, fused: str, bounds: dict[str, tuple[int, int]], suffixes: list[str]) -> None:
            # each checkpoint projection ``pre + proj`` is rows [s, e) of the fused kernel ``pre + fused``
            for proj, (s, e) in bounds.items():
                for suf in suffixes:
                    kernel = f"{pre}{fused}.{suf}"
                    out[f"{pre}{proj}.{suf}"] = (kernel, param(kernel), s, e)

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
            sliced(
                f"{pre}self_attn.", "qkv_proj", qkv_bounds, ["weight"] + (["bias"] if cfg.qkv_bias else [])
            )
            for suf in ["weight"] + (["bias"] if cfg.o_bias else []):
                whole(f"{pre}self_attn.o_proj.{suf}", f"{pre}self_attn.o_proj.{suf}")
            mlp_suffixes = ["weight"] + (["bias"] if cfg.mlp_bias else [])
            sliced(f"{pre}mlp.", "gate_up_proj", gu_bounds, mlp_suffixes)
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
