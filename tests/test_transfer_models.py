"""A real round into the reference causal LM (weightsync/impl/models): HF checkpoint names sent by the
trainer through packed broadcast and through CPU IPC land, bit-exact, in the fused qkv/gate_up parameters of
two engines, whose logits then agree exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transfer_procs import free_port, init_info, ok, run_roles, update_info_for

models = pytest.importorskip("weightsync.impl.models.causal_lm")

from weightsync.impl.models.config import LMConfig  # noqa: E402
from weightsync.impl.transfer.base import ParallelInfo  # noqa: E402
from weightsync.impl.transfer.broadcast import BroadcastTrainer  # noqa: E402
from weightsync.impl.transfer.ipc import IPCTrainer  # noqa: E402
from weightsync.impl.transfer.worker import WeightTransferWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TRAINERS: dict[str, Any] = {"nccl": BroadcastTrainer, "ipc": IPCTrainer}  # the trainer's endpoints
PACKING = {"packed": True, "packed_buffer_size_bytes": 8192, "packed_num_buffers": 2}


def _config() -> LMConfig:
    return LMConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        dtype=torch.bfloat16,
    )


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random HF-named tensors with the shapes the reference LM expects (sorted by name)."""
    lm = models.CausalLM(_config())
    shapes = {ck: (e - s, *p.shape[1:]) for ck, (_, p, s, e) in lm._build_checkpoint_map().items()}
    g = torch.Generator().manual_seed(seed)
    return [
        (n, torch.randn(shapes[n], generator=g).to(torch.bfloat16))
        for n in sorted(lm.checkpoint_weight_names())
    ]


def trainer(port: int, backend: str) -> str:
    tr = TRAINERS[backend](init_info(port, 3, **PACKING))
    try:
        for seed in (1, 2):
            tr.send(iter(_checkpoint(seed)))
    finally:
        tr.close()
    return "sent"


def engine(port: int, backend: str, dp_index: int) -> dict[str, Any]:
    lm = models.CausalLM(_config())
    kw: dict[str, Any] = {"device": "cpu"} if backend == "ipc" else {}
    w = WeightTransferWorker(lm, backend, ParallelInfo(dp_index=dp_index), **kw)
    w.init_weight_transfer_engine(init_info(port, 3, **PACKING))
    for seed in (1, 2):
        w.start_weight_update()
        w.update_weights(update_info_for(_checkpoint(seed)))
        w.finish_weight_update()
    cmap = lm._build_checkpoint_map()
    exact = all(
        torch.equal(cmap[n][1].detach()[cmap[n][2] : cmap[n][3]].view(torch.int16), t.view(torch.int16))
        for n, t in _checkpoint(2)
    )
    logits = lm.forward_full(torch.arange(8).unsqueeze(0))
    return {"exact": exact, "version": w.weight_version, "logits": logits}


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_real_round_into_reference_causal_lm(backend: str) -> None:
    port = free_port()
    res = run_roles([(trainer, (port, backend)), (engine, (port, backend, 0)), (engine, (port, backend, 1))])
    ok(res[0])
    a, b = ok(res[1]), ok(res[2])
    assert a["exact"] and b["exact"] and a["version"] == b["version"] == 2
    assert torch.equal(a["logits"], b["logits"])
