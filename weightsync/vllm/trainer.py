"""weightsync's trainer side for vLLM 0.32: subclasses of vLLM's ``TrainerWeightTransferEngine``.

``WeightsyncBroadcastTrainer`` (backend ``weightsync``) and ``WeightsyncIPCTrainer`` (``weightsync_ipc``)
are built by ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` from a
:class:`WeightsyncTrainerInitInfo` / :class:`WeightsyncIPCTrainerInitInfo` (whose class attribute
``backend`` selects them) and driven by ``send_weights()``, exactly like vLLM's own NCCL trainer
(``distributed/weight_transfer/nccl_engine.py:236-461``). Importing this module registers the plugin's
backends in this process (the trainer process loads no vLLM plugins by itself).

Rules:

1. **Handshake.** ``trainer_init`` (sender, ``rank == 0``) sends the workers an ``init_info`` with
   ``rank_offset=1`` and the trainer's wire parameters (so the two sides cannot disagree; weightsync's
   optional fields only when they differ from their defaults, so with defaults the dict also parses in
   vLLM's ``NCCLWeightTransferInitInfo``) through ``client.init_weight_transfer_engine`` while it hosts
   the rendezvous.
2. **One round per** ``send_weights()``: ``client.start_weight_update()``, then ``client.update_weights``
   concurrently with the data plane, then ``client.finish_weight_update(weight_version)``. An error on
   either side surfaces at once (the engine's RPC error, or the transport's naming ranks), never a hang:
   the transport bounds every wait by the round's deadline (``timeout_s``, or without it one sized to the
   round's bytes: ``RendezvousInitInfo.round_deadline``), and the RPC gets that deadline again after the
   data plane finished.
3. **Sources, never materialised.** A vLLM ``WeightSource`` (``ModuleSource``, or an ``nn.Module``, which
   is wrapped in one) declares its metadata up front: one ``update_weights`` carries it and the tensors
   are pulled from the source's iteration bucket by bucket while packing (``rounds`` rule 4); a tensor
   that disagrees with the declaration aborts that bucket on every rank. Any other iterable of
   ``(name, tensor)`` pairs is streamed in chunks of about ``packed_buffer_size_bytes`` (closed after the
   tensor that exceeds it, vLLM's rule), one ``update_weights`` per chunk. Either way the trainer holds
   references to at most the tensors of the buckets being packed or on the wire, never the whole model.
4. **Multi-rank trainers.** Ranks other than 0 hold no endpoint and call no RPC; ``send_weights`` only
   iterates the source, so the trainer-side collectives (FSDP ``full_tensor``) stay aligned.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from weightsync.impl.transfer.base import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    RendezvousInitInfo,
    SendArgs,
)
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.ipc import IPCTrainer
from weightsync.spec.errors import TransferTimeoutError
from weightsync.vllm.engine import INIT_EXTRAS, WeightsyncInitInfo

T = TypeVar("T")
Declared = list[tuple[str, torch.dtype, tuple[int, ...]]]


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend ``weightsync`` (vLLM's ``NCCLTrainerInitInfo`` fields plus
    weightsync's optional ones; ``rank`` is keyword-only, rank 0 is the sender).

    Attributes:
        master_address, master_port: where the trainer hosts the rendezvous TCPStore.
        world_size: trainer + every worker of every DP replica.
        packed, packed_buffer_size_bytes, packed_num_buffers: the wire parameters (trainer defaults, as
            vLLM's: packed, 1 GiB, 2).
        timeout_s, verify, layout, group_backend, moe_reload_fix: as
            :class:`~weightsync.vllm.engine.WeightsyncInitInfo` (``layout=None``: the backend's default,
            ``"vllm"`` here).

    Raises:
        ValueError: a field the workers would reject.
    """

    backend: ClassVar[str] = "weightsync"

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float | None = None
    verify: bool = False
    layout: str | None = None
    group_backend: str = "auto"
    moe_reload_fix: bool | None = None

    def __post_init__(self) -> None:
        WeightsyncInitInfo(**self.worker_payload())

    def worker_payload(self) -> dict[str, Any]:
        """The workers' ``init_info`` (rule 1): ``rank_offset=1`` and the trainer's wire parameters;
        weightsync's optional fields only where they differ from their defaults."""
        d: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }
        for key in ("timeout_s", "verify", "group_backend", "moe_reload_fix"):
            if getattr(self, key) != INIT_EXTRAS[key]:
                d[key] = getattr(self, key)
        if self.layout is not None:
            d["layout"] = self.layout
        return d

    def rendezvous(self) -> RendezvousInitInfo:
        """The trainer's (rank 0) rendezvous record."""
        return WeightsyncInitInfo(**self.worker_payload()).rendezvous()


@dataclass
class WeightsyncIPCTrainerInitInfo(WeightsyncTrainerInitInfo):
    """Trainer-side init info of backend ``weightsync_ipc`` (``layout=None``: ``"aligned"``).

    Attributes:
        device: where the shared buffers live (None: the current CUDA device if there is one, else CPU).
    """

    backend: ClassVar[str] = "weightsync_ipc"

    device: str | None = None


def _wire_dtype(dtype: torch.dtype) -> str:
    # vLLM's trainer convention (nccl_engine.py:334): the torch attribute name
    return str(dtype).removeprefix("torch.")


def update_info_of(declared: Declared) -> dict[str, Any]:
    """The ``update_info`` dict of one round over ``declared`` ``(name, dtype, shape)``: exactly vLLM's
    ``NCCLWeightTransferUpdateInfo`` fields (``names``, ``dtype_names``, ``shapes``)."""
    return {
        "names": [n for n, _, _ in declared],
        "dtype_names": [_wire_dtype(d) for _, d, _ in declared],
        "shapes": [list(s) for _, _, s in declared],
    }


def _chunks(
    pairs: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rule 3: consecutive chunks closed after the tensor that makes them exceed ``limit`` bytes."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in pairs:
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size > limit:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def concurrently(
    rpc: Callable[[], object], local: Callable[[], T], timeout_s: float, phase: str, basis: str = ""
) -> T:
    """Run the engine-side RPC and the trainer's side of the data plane together (rule 2).

    Returns ``local``'s result once both succeeded. ``local`` bounds its own waits; after it finished, the
    RPC gets ``timeout_s`` (``basis``: how it was sized, quoted in the timeout error). If the RPC fails first, ``local`` gets a few seconds to fail with its own
    (more precise, rank-naming) error, else the RPC's error is raised. Threads still blocked are left to
    their own deadlines (the endpoint is unusable afterwards).

    Raises:
        the first error of either side; TransferTimeoutError (phase ``<phase>/rpc``) if the RPC does not
        return within ``timeout_s`` after the data plane finished.
    """
    exe = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="weightsync-trainer")
    try:
        f_rpc = exe.submit(rpc)
        f_loc = exe.submit(local)
        pending: set[concurrent.futures.Future[Any]] = {f_rpc, f_loc}
        while f_loc in pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            if f_loc in done:
                exc = f_loc.exception()
                if exc is not None:
                    raise exc
            if f_rpc in done and f_rpc.exception() is not None:
                rpc_exc = f_rpc.exception()
                assert rpc_exc is not None
                try:
                    f_loc.result(timeout=min(5.0, timeout_s))
                except concurrent.futures.TimeoutError:
                    pass
                except BaseException as loc_exc:
                    raise loc_exc from rpc_exc
                raise rpc_exc
        t0 = time.monotonic()
        try:
            f_rpc.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TransferTimeoutError(
                f"{phase}/rpc",
                [],
                time.monotonic() - t0,
                "the engines' RPC did not return after the data plane" + (f" ({basis})" if basis else ""),
            ) from None
        return f_loc.result()
    finally:
        exe.shutdown(wait=False)


class _WeightsyncTrainer(TrainerWeightTransferEngine):
    """Common part of the two trainer backends (rules 1-4)."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncTrainerInitInfo
    default_layout: ClassVar[str] = "vllm"

    def __init__(
        self,
        *,
        client: Any,
        source: Any = None,
        is_sender: bool = True,
        init_info: WeightsyncTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        payload = init_info.worker_payload()
        self.args: SendArgs = WeightsyncInitInfo(**payload).send_args(self.default_layout)
        self.rendezvous: RendezvousInitInfo = init_info.rendezvous()
        self.endpoint: BroadcastTrainer | IPCTrainer | None = None
        self.broken: str | None = None
        self.rounds = 0

    def _open(self) -> BroadcastTrainer | IPCTrainer:
        raise NotImplementedError

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Self:
        """Build the engine; the sender hosts the rendezvous while the workers join (rule 1).

        Raises:
            ValueError: ``init_info`` is not this backend's; or the workers rejected it.
            TransferTimeoutError / PortInUseError: from the rendezvous; the engine's RPC error.
        """
        if not isinstance(init_info, cls.init_info_cls):
            raise ValueError(
                f"{cls.__name__}.trainer_init needs a {cls.init_info_cls.__name__}, got {type(init_info).__name__}"
            )
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        payload = init_info.worker_payload()
        rinfo = engine.rendezvous
        engine.endpoint = concurrently(
            lambda: client.init_weight_transfer_engine(payload),
            engine._open,
            rinfo.rendezvous_timeout_s,
            "init_weight_transfer_engine",
            rinfo.rendezvous_timeout_basis,
        )
        return engine

    def send_weights(self, weights: Any = None, *, weight_version: str | None = None) -> None:
        """One full round (rule 2) from ``weights`` (this round only) or the ``source`` given at init.

        Args:
            weights: a ``WeightSource``, an ``nn.Module``, a state dict or an iterable of
                ``(name, tensor)`` pairs.
            weight_version: passed to ``client.finish_weight_update`` (vLLM stores it as the version).

        Raises:
            ValueError: no source; a source that disagrees with its metadata; a rejected request.
            RuntimeError: an earlier round broke the endpoint (re-run ``trainer_init``).
            WireMismatchError / PeerFailedError / TransferTimeoutError, or the engines' RPC error.
        """
        source = self._source(weights)
        if not self.is_sender:
            for _ in source:  # rule 4: the trainer-side collectives of the source's iteration
                pass
            return
        self._require_endpoint()
        self.client.start_weight_update()
        self.update(source)
        if weight_version is None:
            self.client.finish_weight_update()
        else:
            self.client.finish_weight_update(weight_version)
        self.rounds += 1

    def update(self, weights: Any) -> None:
        """Only the ``update_weights`` part of a round (rules 2-3), for a caller that opens and closes
        the round itself (``start_weight_update`` / ``finish_weight_update`` through its own client), e.g.
        to send the rest after ``finish_weight_update`` reported missing weights. Sender only.

        Raises:
            as :meth:`send_weights`.
        """
        endpoint = self._require_endpoint()
        source = self._source(weights)
        try:
            metadata = getattr(source, "metadata", None)
            if callable(metadata):
                declared: Declared = [(m.name, m.dtype, tuple(int(d) for d in m.shape)) for m in metadata()]
                self._round(endpoint, declared, iter(source))
            else:
                for chunk in _chunks(source, self.args.packed_buffer_size_bytes):
                    self._round(endpoint, [(n, t.dtype, tuple(t.shape)) for n, t in chunk], iter(chunk))
                    del chunk  # before the next chunk is pulled: hold one chunk at a time
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def _source(self, weights: Any) -> Any:
        source = weights if weights is not None else self.source
        if source is None:
            raise ValueError("send_weights: no source; pass one to trainer_init(source=...) or send_weights")
        if isinstance(source, torch.nn.Module):
            source = ModuleSource(source)
        elif isinstance(source, Mapping):  # a state dict: its items, in its order
            source = source.items()
        return source

    def _round(
        self,
        endpoint: BroadcastTrainer | IPCTrainer,
        declared: Declared,
        stream: Iterator[tuple[str, torch.Tensor]],
    ) -> None:
        update_info = update_info_of(declared)
        sendable: Sequence[tuple[str, torch.dtype, Sequence[int]]] = declared
        nbytes = sum(math.prod(s) * d.itemsize for _, d, s in declared)
        deadline, basis = self.rendezvous.round_deadline(nbytes)  # the transport's own (rounds rule 0)
        concurrently(
            lambda: self.client.update_weights(update_info),
            lambda: endpoint.send_stream(sendable, stream, self.args),
            deadline,
            "update_weights",
            basis,
        )

    def _require_endpoint(self) -> BroadcastTrainer | IPCTrainer:
        if self.broken is not None:
            raise RuntimeError(
                f"the weight-transfer endpoint is unusable after a failed round ({self.broken}); "
                "shut it down and call trainer_init again"
            )
        if self.endpoint is None:
            raise RuntimeError("the trainer is not initialised (trainer_init)")
        return self.endpoint

    def shutdown(self) -> None:
        """Release the endpoint (idempotent)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


class WeightsyncBroadcastTrainer(_WeightsyncTrainer):
    """Trainer side of backend ``weightsync`` (packed broadcast, rank 0 hosts the TCPStore)."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncTrainerInitInfo
    default_layout: ClassVar[str] = "vllm"

    def _open(self) -> BroadcastTrainer:
        return BroadcastTrainer(self.init_info.rendezvous())


class WeightsyncIPCTrainer(_WeightsyncTrainer):
    """Trainer side of backend ``weightsync_ipc`` (the producer owns the shared buffers)."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncIPCTrainerInitInfo
    default_layout: ClassVar[str] = "aligned"

    def _open(self) -> IPCTrainer:
        info = self.init_info
        device = getattr(info, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        return IPCTrainer(info.rendezvous(), device)


def _register() -> None:
    from weightsync.vllm.plugin import register

    register()


_register()

__all__ = [
    "WeightsyncBroadcastTrainer",
    "WeightsyncIPCTrainer",
    "WeightsyncIPCTrainerInitInfo",
    "WeightsyncTrainerInitInfo",
    "concurrently",
    "update_info_of",
]
