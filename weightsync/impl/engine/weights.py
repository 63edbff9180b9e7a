"""The engine's weight-transfer worker hook, and a minimal built-in gloo broadcast backend.

The engine drives any object with the worker API of reference section 2 (:class:`WeightWorker`). It is
created in the engine process by a factory named in :attr:`EngineConfig.transfer
<weightsync.impl.engine.core.EngineConfig.transfer>`: ``"simple"`` (this file) or ``"package.module:fn"``
with ``fn(model, dp_index) -> WeightWorker`` (e.g. an adapter to :mod:`weightsync.impl.transfer`).

The ``simple`` backend is a small stand-in used by the engine tests: a stateless gloo group (trainer rank 0
hosts the TCPStore; worker rank = ``rank_offset + dp_index``; ``world_size = 1 + dp_size``), one broadcast
per tensor in the update info's order, loaded through ``model.load_weights`` (checkpoint format). Its call
order is checked by the spec's :class:`~weightsync.spec.worker.WorkerMachine` (LocalProtocolError before
any side effect); ``finish_weight_update`` raises IncompleteUpdateError when a checkpoint name is missing.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as _dist_mod

from weightsync.impl.models.causal_lm import CausalLM
from weightsync.spec.errors import IncompleteUpdateError, TransferTimeoutError
from weightsync.spec.worker import WorkerEvent, WorkerMachine

dist: Any = _dist_mod  # the c10d classes (TCPStore, ProcessGroupGloo) are not in torch's public stubs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightWorker(Protocol):
    """The worker-side weight-transfer API (vLLM names, reference section 2)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self, is_checkpoint_format: bool = True) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self) -> None: ...


def _rendezvous(host: str, port: int, rank: int, world: int, timeout_s: float, phase: str) -> tuple[Any, Any]:
    """Store, then the transports' ticket rendezvous (``control`` rule 3: a ``world_size`` disagreement
    raises WireMismatchError on every rank, a missing rank is named), then the gloo group."""
    from weightsync.impl.transfer.control import ControlPlane

    td = datetime.timedelta(seconds=timeout_s)
    t0 = time.monotonic()
    try:
        store = dist.TCPStore(host, port, None, rank == 0, timeout=td, wait_for_workers=False)
    except Exception as exc:
        raise TransferTimeoutError(phase, [], time.monotonic() - t0, f"{type(exc).__name__}: {exc}") from exc
    ControlPlane(dist.PrefixStore("ctl", store), rank, world, timeout_s, f"timeout {timeout_s:g} s").join()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("wt", store), rank, world, td)
    except Exception as exc:
        raise TransferTimeoutError(phase, [], time.monotonic() - t0, f"{type(exc).__name__}: {exc}") from exc
    return store, pg


class SimpleBroadcastWorker:
    """Built-in ``simple`` backend (engine side). See the module docstring.

    Args:
        model: the engine's model (weights loaded in place).
        dp_index: this engine's DP index.
        timeout_s: deadline of the rendezvous and of each broadcast, seconds.
    """

    def __init__(self, model: CausalLM, dp_index: int, timeout_s: float = 30.0) -> None:
        self.model = model
        self.dp_index = dp_index
        self.timeout_s = timeout_s
        self.machine = WorkerMachine(f"worker {dp_index}")
        self.pg: Any = None
        self._store: Any = None
        self._received: set[str] = set()

    @property
    def weight_version(self) -> int:
        """Completed update rounds."""
        return int(self.machine.vars.weight_version)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the transfer group (``master_address``, ``master_port``, ``rank_offset``, ``world_size``).

        Raises:
            WireMismatchError: the trainer and the workers disagree on ``world_size`` (every rank raises).
            TransferTimeoutError: the trainer or a peer did not join within ``timeout_s``.
            ValueError: this worker's rank ``rank_offset + dp_index`` is outside ``1..world_size-1``
                (before anything changes).
        """
        rank = int(init_info.get("rank_offset", 1)) + self.dp_index
        world = int(init_info["world_size"])
        if not 1 <= rank < world:
            raise ValueError(
                f"init_weight_transfer_engine: worker rank {rank} = rank_offset + dp_index {self.dp_index} is "
                f"outside 1..{world - 1} (world_size={world}: the trainer plus one worker per DP rank)"
            )
        self.machine.fire(WorkerEvent.INIT)
        self._store, self.pg = _rendezvous(
            str(init_info["master_address"]),
            int(init_info["master_port"]),
            rank,
            world,
            float(init_info.get("timeout_s", self.timeout_s)),
            "init_weight_transfer_engine",
        )

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open a round (LocalProtocolError when not initialized or already active)."""
        self.machine.fire(WorkerEvent.START, is_checkpoint_format=is_checkpoint_format)
        self._received = set()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive ``names``/``dtype_names``/``shapes`` by broadcast from rank 0 and load them.

        Raises:
            ValueError: the three lists have different lengths.
            TransferTimeoutError: a broadcast did not complete within ``timeout_s``.
        """
        names, dts, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
        if not len(names) == len(dts) == len(shapes):
            raise ValueError("update_weights: names, dtype_names and shapes must have equal lengths")
        self.machine.fire(WorkerEvent.UPDATE)
        assert self.pg is not None
        for name, dt, shape in zip(names, dts, shapes, strict=True):
            t = torch.empty(tuple(shape), dtype=_DTYPES[str(dt)])
            t0 = time.monotonic()
            try:
                self.pg.broadcast(t, 0).wait()
            except Exception as exc:
                raise TransferTimeoutError(
                    "update_weights/broadcast", [], time.monotonic() - t0, f"{name}: {exc}"
                ) from exc
            self.model.load_weights([(name, t)])
            self._received.add(name)

    def finish_weight_update(self) -> None:
        """Close the round: IncompleteUpdateError if a checkpoint weight did not arrive."""
        missing = self.model.checkpoint_weight_names() - self._received
        self.machine.fire(WorkerEvent.FINISH)
        if missing:
            raise IncompleteUpdateError(sorted(missing))
        self.model.process_weights_after_loading()


class SimpleBroadcastTrainer:
    """Trainer side of the ``simple`` backend: rank 0 of the transfer group.

    ``SimpleBroadcastTrainer(init_info)`` blocks until every worker joined (run it concurrently with the
    engines' ``init_weight_transfer_engine``). :meth:`send` broadcasts the tensors in order.

    Raises:
        TransferTimeoutError: rendezvous or a broadcast missed its deadline.
    """

    def __init__(self, init_info: dict[str, Any], timeout_s: float = 30.0) -> None:
        self._store, self.pg = _rendezvous(
            str(init_info["master_address"]),
            int(init_info["master_port"]),
            0,
            int(init_info["world_size"]),
            float(init_info.get("timeout_s", timeout_s)),
            "trainer_init",
        )

    @staticmethod
    def update_info(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """The update info (names, dtype_names, shapes) describing ``weights`` in order."""
        ws = list(weights)
        inv = {v: k for k, v in _DTYPES.items()}
        return {
            "names": [n for n, _ in ws],
            "dtype_names": [inv[t.dtype] for _, t in ws],
            "shapes": [list(t.shape) for _, t in ws],
        }

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every tensor from rank 0, in order (the engines' ``update_weights`` receive them)."""
        for name, t in weights:
            t0 = time.monotonic()
            try:
                self.pg.broadcast(t.detach().contiguous().cpu(), 0).wait()
            except Exception as exc:
                raise TransferTimeoutError(
                    "trainer_send_weights", [], time.monotonic() - t0, f"{name}: {exc}"
                ) from exc

    def close(self) -> None:
        """Drop the group."""
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def make_worker(spec: str, model: CausalLM, dp_index: int, timeout_s: float) -> WeightWorker:
    """Create the worker named by ``spec`` (``"simple"`` or ``"package.module:fn"``).

    Raises:
        ValueError: malformed spec or unknown callable.
    """
    if spec == "simple":
        return SimpleBroadcastWorker(model, dp_index, timeout_s)
    mod_name, _, fn_name = spec.partition(":")
    if not fn_name:
        raise ValueError(f"transfer {spec!r}: expected 'simple' or 'package.module:factory'")
    fn: Callable[..., WeightWorker] = getattr(importlib.import_module(mod_name), fn_name)
    return fn(model, dp_index)


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
