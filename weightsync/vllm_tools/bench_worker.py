"""``weightsync bench vllm``, the worker side (:mod:`weightsync.bench.vllm`): functions run in the engine's
worker process through ``AsyncLLM.collective_rpc(callable)``; ``worker`` is vLLM's ``WorkerWrapperBase``
(attributes forwarded to the ``CPUWorker``). Their state lives in the worker process between the RPCs.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from weightsync.bench.vllm import RAW_KEY
from weightsync.impl.transfer.base import DTYPES, InitInfo
from weightsync.impl.transfer.broadcast import BroadcastGroup, join_group
from weightsync.impl.transfer.packing import as_bytes, crc32

T = TypeVar("T")
#: the phase named in the baseline group's timeout errors
PHASE = "bench vllm/broadcast"


@dataclass
class _WorkerState:
    """The bench's state in the worker process (between its RPCs)."""

    group: BroadcastGroup | None = None
    raw: torch.Tensor | None = None
    captured: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    reload_s: float = 0.0
    load_s: float = 0.0
    depth: int = 0
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    model: torch.nn.Module | None = None


_W = _WorkerState()


def _worker_model(worker: Any) -> torch.nn.Module:
    model: torch.nn.Module = worker.model_runner.model
    return model


def _clocked(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with its wall time added to the reload clock (outermost call only)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        if _W.depth:
            return fn(*args, **kwargs)
        _W.depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _W.reload_s += time.perf_counter() - t0
            _W.depth -= 1

    return wrapper


def worker_setup(worker: Any, rinfo: dict[str, Any], raw_bytes: int) -> int:
    """Join the baseline group as rank 1, allocate (and touch) the raw receive buffer, and install the
    reload clock and the ``load_weights`` capture. Returns the worker's process id.

    Raises:
        TransferTimeoutError / ValueError: from :func:`~weightsync.impl.transfer.broadcast.join_group`.
    """
    from vllm.model_executor.model_loader import reload as reload_pkg
    from vllm.model_executor.model_loader.reload import layerwise

    worker_teardown(worker)
    model: Any = _worker_model(worker)
    _W.group = join_group(InitInfo.parse(rinfo), 1)
    _W.raw = torch.zeros(raw_bytes, dtype=torch.uint8)
    for mod, name in (
        (layerwise, "_layerwise_process"),
        (layerwise, "finalize_layerwise_processing"),
        (layerwise, "initialize_layerwise_reload"),
        (reload_pkg, "initialize_layerwise_reload"),
        (reload_pkg, "finalize_layerwise_reload"),
    ):
        orig = getattr(mod, name)
        _W.patches.append((mod, name, orig))
        setattr(mod, name, _clocked(orig))
    load = model.load_weights

    def load_weights(weights: Any) -> Any:
        batch = list(weights)
        _W.captured.extend(batch)  # references only: hashed after the round, outside the timed window
        t0 = time.perf_counter()
        try:
            return load(batch)
        finally:
            _W.load_s += time.perf_counter() - t0

    model.__dict__["load_weights"] = load_weights
    _W.model = model
    return os.getpid()


def worker_teardown(worker: Any) -> None:
    """Undo :func:`worker_setup` (idempotent): restore vLLM's functions and the model's ``load_weights``,
    close the baseline group, drop the buffers."""
    for mod, name, orig in reversed(_W.patches):
        setattr(mod, name, orig)
    _W.patches.clear()
    if _W.model is not None:
        _W.model.__dict__.pop("load_weights", None)
        _W.model = None
    if _W.group is not None:
        _W.group.close()
        _W.group = None
    _W.raw = None
    _W.captured.clear()


def _group() -> BroadcastGroup:
    if _W.group is None:
        raise RuntimeError("bench vllm: the worker is not set up (worker_setup)")
    return _W.group


def worker_raw(worker: Any) -> None:
    """Receive the raw broadcast into the preallocated buffer."""
    g = _group()
    assert _W.raw is not None
    g.wait(g.broadcast(_W.raw), PHASE)


def worker_reload_start(worker: Any) -> None:
    """``initialize_layerwise_reload`` on the model, as vLLM's NCCL engine does at ``start_weight_update``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(_worker_model(worker))


def worker_reload_finish(worker: Any) -> None:
    """``finalize_layerwise_reload``, as vLLM's NCCL engine does at ``finish_weight_update``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(_worker_model(worker), worker.model_config)


def _receive_and_load(worker: Any, metas: Sequence[tuple[str, str, Sequence[int]]]) -> None:
    from vllm.config import set_current_vllm_config

    g = _group()
    model: Any = _worker_model(worker)
    with set_current_vllm_config(worker.vllm_config):
        for name, dtype, shape in metas:
            t = torch.empty(list(shape), dtype=DTYPES[dtype])
            g.wait(g.broadcast(as_bytes(t)), PHASE)
            model.load_weights([(name, t)])


def worker_recv_one(worker: Any, name: str, dtype: str, shape: list[int]) -> None:
    """One tensor of the ``per_tensor`` method: allocate, receive, ``load_weights``."""
    _receive_and_load(worker, [(name, dtype, shape)])


def worker_recv_all(worker: Any, metas: list[tuple[str, str, list[int]]]) -> None:
    """The ``per_tensor_bare`` method: every tensor of ``metas`` in order, one RPC for all."""
    _receive_and_load(worker, metas)


def worker_report(worker: Any, raw: bool) -> dict[str, Any]:
    """What the last round delivered (then reset): CRC-32 per tensor handed to ``load_weights`` (or of the
    raw buffer), how many tensors were loaded, CRC-32 of the model's readable parameters (not for
    ``raw``), and the seconds spent inside vLLM's layerwise reload and inside ``model.load_weights``."""
    if raw:
        assert _W.raw is not None
        digests = {RAW_KEY: crc32(_W.raw)}
    else:
        digests = {n: crc32(as_bytes(t.detach().contiguous())) for n, t in _W.captured}
    engine: dict[str, int] = {}
    if not raw:
        for n, p in _worker_model(worker).named_parameters():
            if p.numel() > 0:  # oneDNN-packed linear weights are empty tensors here
                engine[n] = crc32(as_bytes(p.detach().contiguous()))
    out = {
        "digests": digests,
        "loaded": len(_W.captured),
        "engine": engine,
        "reload_s": _W.reload_s,
        "load_s": _W.load_s,
    }
    _W.captured.clear()
    _W.reload_s = _W.load_s = 0.0
    return out


__all__ = [
    "PHASE",
    "worker_raw",
    "worker_recv_all",
    "worker_recv_one",
    "worker_reload_finish",
    "worker_reload_start",
    "worker_report",
    "worker_setup",
    "worker_teardown",
]
