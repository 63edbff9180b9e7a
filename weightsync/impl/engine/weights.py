"""The engine's weight-transfer worker hook: the worker API, the factory lookup, and test weights.

The engine drives any object with vLLM's worker API (:class:`WeightWorker`). It is
created in the engine process by a factory named in :attr:`EngineConfig.transfer
<weightsync.impl.engine.config.EngineConfig.transfer>` as ``"package.module:fn"`` with
``fn(model, dp_index) -> WeightWorker``. The real transports of :mod:`weightsync.impl.transfer` provide
:data:`BROADCAST_WORKER` (the default: packed broadcast, gloo on CPU) and :data:`IPC_WORKER`
(shared memory); the demo wraps them (``weightsync.demo.worker:demo_broadcast_worker``). The transfer's
deadlines come from ``init_info['timeout_s']`` (the transports' default is 300 s), not from the engine
config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.transfer.base import UpdateInfo, meta_of

#: Engine transfer factory of the broadcast transport (backend ``nccl``; gloo for CPU tensors).
BROADCAST_WORKER = "weightsync.impl.transfer.worker:broadcast_worker"
#: Engine transfer factory of the IPC transport (CPU shared memory or CUDA IPC).
IPC_WORKER = "weightsync.impl.transfer.worker:ipc_worker"


class WeightWorker(Protocol):
    """The worker-side weight-transfer API (vLLM names, 0.32 ``v1/worker/gpu_worker.py:1484-1604``)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...
    def finish_weight_update(self) -> None: ...
    def fail_round(self) -> None: ...
    def fail_init(self) -> None: ...


def make_worker(spec: str, model: CausalLM, dp_index: int) -> WeightWorker:
    """Create the worker named by ``spec`` (``"package.module:fn"``, called as ``fn(model, dp_index)``).

    Raises:
        ValueError: ``spec`` has no ``:factory`` part (naming it and the expected form).
        ImportError / AttributeError: the module or the callable does not exist.
    """
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"transfer {spec!r}: expected 'package.module:factory' (e.g. {BROADCAST_WORKER!r})")
    fn: Callable[..., WeightWorker] = getattr(importlib.import_module(mod_name), fn_name)
    return fn(model, dp_index)


def update_info_for(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``update_info`` dict describing ``weights`` in order (vLLM 0.32's ``names``, ``dtype_names``,
    ``shapes``; the packing parameters are ``init_info``'s).

    Raises:
        ValueError: a tensor's dtype cannot be transferred.
    """
    return UpdateInfo.of([meta_of(n, t) for n, t in weights]).to_dict()


def random_weights(model: CausalLM, seed: int, std: float = 0.5) -> list[tuple[str, torch.Tensor]]:
    """Deterministic random checkpoint-format weights for ``model`` (norms around 1), sorted by name.

    Used as the initial weights of test engines and as "new weights" pushed by a test trainer.
    """
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    sd = {n: p for n, p in model.named_parameters()}
    for name in sorted(model.checkpoint_weight_names()):
        kernel = model.kernel_name_for(name)
        p = sd[kernel]
        rows = p.shape[0]
        if kernel != name:  # a shard of a fused parameter: same row count as the model's split
            cfg = model.config
            if ".q_proj." in name:
                rows = cfg.q_size
            elif ".k_proj." in name or ".v_proj." in name:
                rows = cfg.kv_size
            else:
                rows = cfg.intermediate_size
        shape = (rows, *p.shape[1:])
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g) / max(1.0, float(shape[-1]) ** 0.5)
        out.append((name, t.to(p.dtype)))
    return out
