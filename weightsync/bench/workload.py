"""The workload of ``weightsync bench transfer``: the synthetic model (a Llama-like list of shapes, optionally
in one arena), its bucket defaults, and how often each figure is repeated."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from weightsync.impl.transfer.packing import flat_layout, flat_views
from weightsync.impl.transfer.tensors import TensorMeta


def _metas(spec: list[tuple[str, tuple[int, ...]]]) -> list[TensorMeta]:
    return [TensorMeta(n, "bfloat16", s) for n, s in spec]


REPEATS = 5


SYNCS_FOR_RSS = 20


#: Bucket size and buffer count of the full bench (CPU defaults; see the module docstring).
DEFAULT_BUCKET_BYTES = 64 << 20


DEFAULT_NUM_BUFFERS = 2


def synthetic_spec(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like bf16 model: ~512 MiB in ~300 tensors (quick: ~32 MiB, ~150)."""
    hidden, inter, layers, vocab = (1024, 2048, 20, 32768) if not quick else (256, 512, 10, 8192)
    spec: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (hidden // 2, hidden)),
            (p + "self_attn.k_proj.bias", (hidden // 2,)),
            (p + "self_attn.v_proj.weight", (hidden // 2, hidden)),
            (p + "self_attn.v_proj.bias", (hidden // 2,)),
            (p + "self_attn.q_norm.weight", (64,)),
            (p + "self_attn.k_norm.weight", (64,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    spec += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return spec


class BenchModel(nn.Module):
    """A LoadableModel holding one bf16 parameter per checkpoint name (copies on load).

    Parameter ``i`` is named ``p{i}`` (its kernel-format name). With ``arena=True`` every parameter is a
    view of one flat buffer in spec order at ``packing.flat_layout``'s offsets (an engine that keeps its
    weights in one allocation), so kernel-format updates can be received in place (broadcast rule 5).
    """

    def __init__(self, spec: list[tuple[str, tuple[int, ...]]], arena: bool = False) -> None:
        super().__init__()
        self._by_name: dict[str, nn.Parameter] = {}
        if arena:
            metas = _metas(spec)
            self.arena = torch.zeros(flat_layout(metas)[0], dtype=torch.uint8)
            datas = flat_views(self.arena, metas)
        else:
            datas = [torch.zeros(shape, dtype=torch.bfloat16) for _, shape in spec]
        for i, ((name, _), data) in enumerate(zip(spec, datas, strict=True)):
            p = nn.Parameter(data, requires_grad=False)
            self.register_parameter(f"p{i}", p)
            self._by_name[name] = p

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            self._by_name[name].data.copy_(t)
            done.add(name)
        return done

    def checkpoint_weight_names(self) -> set[str]:
        return set(self._by_name)

    def process_weights_after_loading(self) -> None:
        return None

    def param(self, name: str) -> nn.Parameter:
        return self._by_name[name]


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_NUM_BUFFERS",
    "REPEATS",
    "SYNCS_FOR_RSS",
    "BenchModel",
    "synthetic_spec",
]
