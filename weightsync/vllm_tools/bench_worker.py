"""``weightsync bench vllm``, the worker side (:mod:`weightsync.bench.vllm`): functions run in the engine's
worker process through ``AsyncLLM.collective_rpc(callable)``; ``worker`` is vLLM's ``WorkerWrapperBase``
(attributes forwarded to the ``CPUWorker``). Their state lives in the worker process between the RPCs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
    #: ``side_by_side``: the second receive buffer (``raw`` holds the stash the load reads meanwhile)
    raw2: torch.Tensor | None = None
    #: ``side_by_side``: the receiving thread and the error it raised, if any
    side: tuple[threading.Thread, list[BaseException]] | None = None
    #: per name: a preallocated, touched copy of what the last round handed to ``load_weights``
    arena: dict[str, torch.Tensor] = field(default_factory=dict)
    captured: list[str] = field(default_factory=list)
    #: ``reload_only``: the weights already in the worker (views of ``raw``), in the trainer's order
    stash: list[tuple[str, torch.Tensor]] = field(default_factory=list)
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


def _dp_index(worker: Any) -> int:
    return int(worker.vllm_config.parallel_config.data_parallel_index)


def worker_setup(worker: Any, rinfo: dict[str, Any], metas: list[tuple[str, str, list[int]]]) -> int:
    """Join the baseline group as rank ``1 + data_parallel_index``, allocate (and touch) the raw receive
    buffer and the capture arena (one tensor per entry of ``metas``: name, dtype name, shape), and install
    the reload clock and the ``load_weights`` capture. Returns the worker's process id.

    Raises:
        TransferTimeoutError / ValueError: from :func:`~weightsync.impl.transfer.broadcast.join_group`.
    """
    from vllm.model_executor.model_loader import reload as reload_pkg
    from vllm.model_executor.model_loader.reload import layerwise

    worker_teardown(worker)
    model: Any = _worker_model(worker)
    _W.group = join_group(InitInfo.parse(rinfo), 1 + _dp_index(worker))
    _W.arena = {n: torch.zeros(list(shape), dtype=DTYPES[dt]) for n, dt, shape in metas}
    _W.raw = torch.zeros(sum(t.numel() * t.element_size() for t in _W.arena.values()), dtype=torch.uint8)
    _W.raw2 = torch.zeros_like(_W.raw)
    off = 0
    _W.stash = []
    for n, t in _W.arena.items():
        nb = t.numel() * t.element_size()
        _W.stash.append((n, _W.raw[off : off + nb].view(t.dtype).view(t.shape)))
        off += nb
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
        # a copy at hand-off (the buffers behind ``batch`` may be reused before the round ends), hashed
        # after the round, outside the timed window; the same copy for every loading method
        for n, t in batch:
            dst = _W.arena.get(n)
            if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype:
                dst.copy_(t)
            else:
                _W.arena[n] = t.detach().clone()
            _W.captured.append(n)
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
    _W.raw = _W.raw2 = None
    _W.side = None
    _W.captured.clear()
    _W.arena = {}
    _W.stash = []


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


def worker_side_start(worker: Any) -> None:
    """The ``side_by_side`` method's first RPC: start receiving the raw broadcast into the second buffer on a
    thread of its own (as :func:`worker_raw` receives into the first), then ``initialize_layerwise_reload``
    as :func:`worker_reload_start`. The load (:func:`worker_load_stash`) then runs in the next RPC while the
    bytes arrive: the transfer and the reload side by side, neither waiting for the other.

    Raises:
        RuntimeError: the previous side-by-side receive was never finished (:func:`worker_side_finish`).
    """
    g = _group()
    if _W.side is not None:
        raise RuntimeError("bench vllm: a side-by-side receive is still running (worker_side_finish)")
    assert _W.raw2 is not None
    buf = _W.raw2
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            g.wait(g.broadcast(buf), PHASE)
        except BaseException as exc:  # handed to worker_side_finish, raised there
            errors.append(exc)

    thread = threading.Thread(target=receive, name="bench-side-by-side-recv", daemon=True)
    thread.start()
    _W.side = (thread, errors)
    worker_reload_start(worker)


def worker_side_finish(worker: Any, timeout_s: float) -> None:
    """The ``side_by_side`` method's last RPC: ``finalize_layerwise_reload``, then wait for the receive that
    :func:`worker_side_start` started.

    Raises:
        RuntimeError: no receive was started, or it had not finished ``timeout_s`` seconds later.
        TransferTimeoutError / PeerFailedError: the receive's own error (its deadline is :data:`PHASE`'s).
    """
    worker_reload_finish(worker)
    if _W.side is None:
        raise RuntimeError("bench vllm: worker_side_finish without worker_side_start")
    thread, errors = _W.side
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError(f"bench vllm: the side-by-side receive did not finish within {timeout_s:g} s")
    _W.side = None
    if errors:
        raise errors[0]


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


def worker_load_stash(worker: Any) -> None:
    """The ``reload_only`` method: ``load_weights`` of the weights already in the worker (the last raw
    broadcast, as views), one call, as one ``update_weights`` of a round would hand them over."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    model: Any = _worker_model(worker)
    with set_current_vllm_config(worker.vllm_config), disable_mtp_completeness_check():
        model.load_weights(list(_W.stash))


class _GlooAsPyNccl:
    """The ``group`` vLLM's packed functions call (``PyNcclCommunicator.broadcast(tensor, src=...)``) over
    the baseline gloo group. NCCL's broadcast is enqueued on the current CUDA stream; on CPU there is no
    stream, so this one completes before it returns (the deadline of :data:`PHASE`)."""

    def __init__(self, group: BroadcastGroup) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if src != 0:
            raise ValueError(f"bench vllm: the baseline group broadcasts from rank 0, not {src}")
        self.group.wait(self.group.broadcast(tensor), PHASE)


class _NoStream:
    def synchronize(self) -> None:
        return None


class _CpuTorch:
    """``torch`` as vLLM's ``packed_tensor`` module sees it on CPU: its CUDA stream calls are no-ops
    (``torch.cuda.stream(s)``, ``torch.accelerator.current_device_index()``); everything else is torch."""

    class cuda:  # stands for the torch.cuda namespace
        Stream = _NoStream

        @staticmethod
        def stream(_s: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    class accelerator:  # stands for the torch.accelerator namespace
        @staticmethod
        def current_device_index() -> int:
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def vllm_packed_on_cpu() -> Iterator[Any]:
    """vLLM 0.32's ``distributed/weight_transfer/packed_tensor.py`` with its CUDA stream calls replaced by
    no-ops (the only change: ``_get_streams`` returns streams whose ``synchronize`` does nothing, and the
    module's ``torch.cuda.stream`` / ``torch.accelerator.current_device_index`` are no-ops); yields the
    module. Restored on exit."""
    from vllm.distributed.weight_transfer import packed_tensor

    saved = (packed_tensor.torch, packed_tensor._get_streams)
    packed_tensor.torch = _CpuTorch()
    packed_tensor._get_streams = lambda _idx, n: tuple(_NoStream() for _ in range(n))
    try:
        yield packed_tensor
    finally:
        packed_tensor.torch, packed_tensor._get_streams = saved


def gloo_as_pynccl(group: BroadcastGroup) -> Any:
    """The baseline group as the ``group`` argument of vLLM's packed functions."""
    return _GlooAsPyNccl(group)


def worker_vllm_packed(
    worker: Any, metas: list[tuple[str, str, list[int]]], buffer_size_bytes: int, num_buffers: int
) -> None:
    """The ``vllm_packed`` method, worker side: vLLM 0.32's ``packed_nccl_broadcast_consumer`` called as
    its NCCL engine calls it (``nccl_engine.py:200-215``: the metadata iterator, ``src=0``,
    ``post_unpack_func=model.load_weights``, the packing geometry, the worker's device), inside
    ``disable_mtp_completeness_check``, over the baseline gloo group (:func:`vllm_packed_on_cpu`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    model: Any = _worker_model(worker)

    def state_dict_info_iterator() -> Iterator[tuple[str, tuple[list[int], torch.dtype]]]:
        for name, dtype_name, shape in metas:
            yield name, (list(shape), getattr(torch, dtype_name))

    with (
        vllm_packed_on_cpu() as pt,
        set_current_vllm_config(worker.vllm_config),
        disable_mtp_completeness_check(),
    ):
        pt.packed_nccl_broadcast_consumer(
            iterator=state_dict_info_iterator(),
            group=gloo_as_pynccl(_group()),
            src=0,
            post_unpack_func=model.load_weights,
            buffer_size_bytes=buffer_size_bytes,
            num_buffers=num_buffers,
            device=torch.device("cpu"),
        )


def worker_report(worker: Any, raw: bool, side: bool = False) -> dict[str, Any]:
    """What the last round delivered (then reset): CRC-32 per tensor handed to ``load_weights`` (or of the
    raw buffer), how many tensors were loaded, CRC-32 of the model's readable parameters (not for
    ``raw``), and the seconds spent inside vLLM's layerwise reload and inside ``model.load_weights``;
    ``side``: also ``side_digest``, the CRC-32 of the second buffer (``side_by_side``'s transfer)."""
    if raw:
        assert _W.raw is not None
        digests = {RAW_KEY: crc32(_W.raw)}
    else:
        digests = {n: crc32(as_bytes(_W.arena[n].contiguous())) for n in _W.captured}
    engine: dict[str, int] = {}
    if not raw:
        for n, p in _worker_model(worker).named_parameters():
            if p.numel() > 0:  # oneDNN-packed linear weights are empty tensors here
                engine[n] = crc32(as_bytes(p.detach().contiguous()))
    eng = getattr(worker, "weight_transfer_engine", None)
    transport = getattr(eng, "transport", None)
    timings = transport.timings.take() if transport is not None else {}
    out = {
        "digests": digests,
        "loaded": len(_W.captured),
        "engine": engine,
        "reload_s": _W.reload_s,
        "load_s": _W.load_s,
        "timings": timings,
    }
    if side:
        assert _W.raw2 is not None
        out["side_digest"] = crc32(_W.raw2)
    _W.captured.clear()
    _W.reload_s = _W.load_s = 0.0
    return out


__all__ = [
    "PHASE",
    "gloo_as_pynccl",
    "vllm_packed_on_cpu",
    "worker_load_stash",
    "worker_raw",
    "worker_recv_all",
    "worker_recv_one",
    "worker_reload_finish",
    "worker_reload_start",
    "worker_report",
    "worker_setup",
    "worker_side_finish",
    "worker_side_start",
    "worker_teardown",
    "worker_vllm_packed",
]
