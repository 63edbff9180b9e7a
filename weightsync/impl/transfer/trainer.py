"""The trainer side of vLLM 0.32's weight-transfer API, engine-agnostic (no vLLM import).

vLLM 0.32 (``distributed/weight_transfer/base.py:535-640``, ``nccl_engine.py:236-461``): a trainer engine is
built by the classmethod ``trainer_init(init_info, *, client, source=None)`` and moves one round per
``send_weights()``, driving the engines through a client with four methods (:class:`WeightSyncClient`,
vLLM's ``VLLMWeightSyncClient``). :class:`BroadcastTrainerEngine` (backend ``nccl``: packed broadcast,
gloo for CPU tensors) and :class:`IPCTrainerEngine` (backend ``ipc``: shared memory / CUDA IPC) implement
it over weightsync's transports; any client works: weightsync's reference engine client
(:class:`~weightsync.impl.engine.client.DPEngineClient`), a
:class:`~weightsync.impl.checked.CheckedEngine`, or vLLM's own HTTP / Ray clients and an ``AsyncLLM``. The
vLLM plugin's trainers (:mod:`weightsync.vllm.trainer`) are these classes, also subclassing vLLM's
``TrainerWeightTransferEngine``.

Rules:

1. **Handshake.** ``trainer_init`` (sender, ``rank == 0``) sends the workers an ``init_info`` with
   ``rank_offset=1`` and the trainer's wire parameters (so the two sides cannot disagree; weightsync's
   optional fields only when they differ from their defaults, so with defaults the dict also parses in
   vLLM's ``NCCLWeightTransferInitInfo``) through ``client.init_weight_transfer_engine`` while it hosts
   the rendezvous (vLLM's ``nccl_engine.py:271-316``).
2. **One round per** ``send_weights()``: ``client.start_weight_update()``, then ``client.update_weights``
   concurrently with the data plane, then ``client.finish_weight_update(weight_version)``
   (``nccl_engine.py:318-361``). An error on either side surfaces at once (the engine's RPC error, or the
   transport's naming ranks), never a hang: the transport bounds every wait by the round's deadline
   (``timeout_s``, or without it one sized to the round's bytes: ``InitInfo.round_deadline``), and the
   RPC gets that deadline again after the data plane finished.
3. **Sources, never materialised.** A source with ``metadata()`` (vLLM's ``WeightSource`` and
   ``ModuleSource``, passed as they are, or an ``nn.Module``, wrapped in :attr:`TrainerEngine.module_source`)
   declares its tensors up front: one ``update_weights`` carries the declaration and the tensors are
   pulled from the source's iteration bucket by bucket while packing (``rounds`` rule 4); a tensor that
   disagrees with the declaration aborts that bucket on every rank. A state dict is its ``items()``. Any
   other iterable of ``(name, tensor)`` pairs is streamed in chunks of about ``packed_buffer_size_bytes``
   (closed after the tensor that exceeds it, vLLM's rule), one ``update_weights`` per chunk. Either way the
   trainer holds references to at most the tensors of the buckets being packed or on the wire (one chunk
   for a plain iterator), never the whole model.
4. **Multi-rank trainers.** Ranks other than 0 hold no endpoint and call no RPC; ``send_weights`` only
   iterates the source, so the trainer-side collectives (FSDP ``full_tensor``) stay aligned.
5. **Bad input** (no source, a ``weight_version`` that is not a str, an init info of another backend, an
   item that is not a ``(str, Tensor)`` pair) raises ``ValueError`` naming the value before any RPC or
   byte moves (a bad item of a declared source aborts its bucket on every rank, ``rounds`` rule 4).
6. **After a failed round.** A round that every rank aborted together (a veto, a wire mismatch, a failed
   bucket, the source's own exception, or an engine error after the data plane finished) leaves the
   group usable: the next ``send_weights`` is a new round (the engines recover a ``failed`` rank with
   one). A round whose data plane or RPC timed out, or whose data plane was still blocked when the
   engines' error was raised, leaves the endpoint unusable (:attr:`TrainerEngine.broken`): every later round raises
   ``RuntimeError`` until ``shutdown`` and a new ``trainer_init``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, Self, runtime_checkable

import torch

from weightsync.impl.transfer import trainer_calls
from weightsync.impl.transfer.auth import Session
from weightsync.impl.transfer.base import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    InitExtras,
    InitInfo,
    WireArgs,
)
from weightsync.impl.transfer.fields import field_bool, field_int
from weightsync.impl.transfer.trainer_calls import Declared, chunks, concurrently, recorded, update_info_of
from weightsync.spec.errors import StaleWeightVersionError, TransferTimeoutError
from weightsync.spec.rank_vars import version_older, version_order


@runtime_checkable
class WeightSyncClient(Protocol):
    """vLLM 0.32's ``VLLMWeightSyncClient`` (``distributed/weight_transfer/base.py:505-533``): the
    engines' weight-sync control plane as the trainer drives it. weightsync's
    :class:`~weightsync.impl.engine.client.DPEngineClient` and
    :class:`~weightsync.impl.checked.CheckedEngine` satisfy it, and so do vLLM's HTTP and Ray clients."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class ParamMeta(NamedTuple):
    """One tensor a source declares (vLLM's ``ParamMeta``, ``base.py:121-127``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class ModuleWeights:
    """A source over ``module.named_parameters()`` with vLLM's ``ModuleSource`` semantics
    (``distributed/weight_transfer/base.py:283-305``): ``metadata()`` reads the global shapes and dtypes
    without gathering; iteration materialises each tensor (``full_tensor()`` for an FSDP ``DTensor``, a
    collective) one at a time."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        """``(name, dtype, shape)`` of every parameter, in ``named_parameters()`` order."""
        return [
            ParamMeta(n, p.dtype, tuple(int(d) for d in p.shape)) for n, p in self.module.named_parameters()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.module.named_parameters():
            full = getattr(p, "full_tensor", None)
            yield name, (full() if callable(full) else p)


@dataclass(kw_only=True)
class TrainerInitInfo(InitExtras):
    """Trainer-side init info (vLLM's ``NCCLTrainerInitInfo`` fields, ``nccl_engine.py:52-80``, plus
    weightsync's :class:`~weightsync.impl.transfer.base.InitExtras`; ``rank`` 0 is the sender).

    Attributes:
        master_address, master_port: where the trainer hosts the rendezvous TCPStore (as the engines reach
            it).
        world_size: trainer + every worker of every DP replica.
        packed, packed_buffer_size_bytes, packed_num_buffers: the wire parameters (trainer defaults, as
            vLLM's: packed, 1 GiB, 2); sent to the workers at init.
        rank: this trainer process's rank (keyword-only, as vLLM's ``TrainerInitInfo``); 0 sends.
        check_finite: the default of :meth:`TrainerEngine.send_weights`' ``check_finite`` (weightsync;
            trainer-side only: it goes into each round's ``update_info``, not to the workers at init).

    Class attributes:
        backend: the backend this info selects (vLLM's factory dispatches on it).
        worker_info_cls: the workers' init-info class, built by :meth:`worker_init_info`.

    Raises:
        ValueError: (at construction) a field the workers would reject, or a negative ``rank``.
    """

    backend: ClassVar[str] = "nccl"
    worker_info_cls: ClassVar[type[InitInfo]] = InitInfo

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    rank: int
    check_finite: bool = False

    def __post_init__(self) -> None:
        field_int(self.__dict__, "rank", "trainer init_info", 0)
        field_bool(self.__dict__, "check_finite", "trainer init_info")
        self.worker_init_info()

    @property
    def is_sender(self) -> bool:
        """Rank 0 sends (vLLM's ``TrainerInitInfo.is_sender``)."""
        return self.rank == 0

    def worker_init_info(self) -> InitInfo:
        """The workers' init info (rule 1): ``rank_offset=1`` (vLLM's trainer always sends 1), the
        trainer's wire parameters and every other field the workers' class has.

        Raises:
            ValueError: as the workers' class.
        """
        cls = self.worker_info_cls
        d: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
        }
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        for f in dataclasses.fields(self):
            if f.name in names and f.name not in d:
                d[f.name] = getattr(self, f.name)
        return cls(**d)

    def worker_payload(self) -> dict[str, Any]:
        """The ``init_info`` dict the sender gives ``client.init_weight_transfer_engine`` (rule 1)."""
        return self.worker_init_info().to_dict()


@dataclass(kw_only=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the IPC transport.

    Attributes:
        device: where the shared buffers live (None: the current CUDA device if there is one, else CPU).
    """

    backend: ClassVar[str] = "ipc"

    device: str | None = None


class Endpoint(Protocol):
    """The trainer's transport endpoint (:class:`~weightsync.impl.transfer.broadcast.BroadcastTrainer`,
    :class:`~weightsync.impl.transfer.ipc.IPCTrainer`)."""

    session: Session | None

    def send_stream(
        self,
        declared: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        stream: Iterable[tuple[str, torch.Tensor]],
        wire: WireArgs | None = None,
    ) -> None: ...

    def close(self) -> None: ...


class TrainerEngine(ABC):
    """vLLM 0.32's ``TrainerWeightTransferEngine`` over a weightsync transport (rules 1-5). Build it with
    :meth:`trainer_init`.

    Class attributes:
        init_info_cls: the init-info class this backend accepts.
        default_layout: the bucket layout when the init info names none (the engines' backend's).
        module_source: wraps an ``nn.Module`` source (vLLM's plugin: vLLM's own ``ModuleSource``).

    Attributes:
        client, source, is_sender: as vLLM's.
        init_info: the trainer's init info; wire: the wire arguments it fixes.
        endpoint: the transport endpoint (sender only, after :meth:`trainer_init`).
        broken: why the endpoint is unusable (rule 6), or None.
        send_error: the data plane's own exception of the last failed round, or None: set when the
            trainer's send raised, even after the engines' RPC error was raised to the caller first (the
            send may fail later, at its own deadline).
        rounds: rounds completed by :meth:`send_weights`.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]] = TrainerInitInfo
    default_layout: ClassVar[str] = "aligned"
    module_source: ClassVar[type[Any]] = ModuleWeights

    def __init__(
        self,
        *,
        client: Any,
        source: Any = None,
        is_sender: bool = True,
        init_info: TrainerInitInfo,
    ) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.init_info = init_info
        self.worker_info: InitInfo = init_info.worker_init_info()
        self.wire: WireArgs = self.worker_info.wire(self.default_layout)
        self.endpoint: Endpoint | None = None
        self.broken: str | None = None
        self.send_error: BaseException | None = None
        self._sending = False  # the data plane of the current round is running
        self.rounds = 0
        self.sent_version: str | None = None  # the weight_version of the last round this trainer finished

    @abstractmethod
    def _open(self) -> Endpoint:
        """Open the transport endpoint as rank 0 (blocks until every worker joined)."""

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Self:
        """Build the engine; the sender hosts the rendezvous while the workers join (rule 1).

        Raises:
            ValueError: ``init_info`` is not this backend's; or the workers rejected it.
            TransferTimeoutError / PortInUseError: from the rendezvous (noted: hint_rendezvous); the RPC's.
        """
        if not isinstance(init_info, cls.init_info_cls):
            raise ValueError(
                f"{cls.__name__}.trainer_init needs a {cls.init_info_cls.__name__}, got {type(init_info).__name__}"
            )
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        payload, rinfo = engine.worker_info.to_dict(), engine.worker_info
        engine.endpoint = concurrently(
            lambda: client.init_weight_transfer_engine(payload),
            trainer_calls.hint_rendezvous(engine._open),
            rinfo.rendezvous_timeout_s,
            "init_weight_transfer_engine",
            rinfo.rendezvous_timeout_basis,
            abandon_local=True,
        )
        return engine

    def send_weights(
        self,
        weights: Any = None,
        *,
        weight_version: str | None = None,
        monotonic: bool = False,
        check_finite: bool | None = None,
    ) -> None:
        """One full round (rule 2) from ``weights`` (this round only) or the ``source`` given at init.

        Args:
            weights: a source with ``metadata()`` (vLLM's ``WeightSource``), an ``nn.Module``, a state
                dict or an iterable of ``(name, tensor)`` pairs (rule 3).
            weight_version: passed to ``client.finish_weight_update``: the engines' version afterwards
                (None: unchanged, vLLM's ``async_llm.py:1351-1355``).
            monotonic: refuse, before ``start_weight_update``, a ``weight_version`` older
                (:func:`~weightsync.spec.rank_vars.version_older`) than the last one this trainer set or
                the engines' own (``client.get_weight_version()``, where the client has it).
            check_finite: every engine refuses NaN / +-Inf in the received floating-point weights before
                they are loaded (``update_info['check_finite']``, :mod:`weightsync.impl.transfer.worker`
                rule 7); None: the init info's ``check_finite``.

        Raises:
            ValueError: no source, a ``weight_version`` that is not a str, ``monotonic`` without a
                ``weight_version`` or with one the guard cannot order (before any RPC); a source that
                disagrees with its metadata; a rejected request.
            StaleWeightVersionError: ``monotonic`` and an older ``weight_version`` (before any RPC but
                the version query).
            RuntimeError: an earlier round broke the endpoint (rule 6: re-run ``trainer_init``).
            WireMismatchError / PeerFailedError / TransferTimeoutError, or the engines' RPC error.
        """
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(
                f"send_weights: weight_version must be a str or None (vLLM 0.32's string versions), got "
                f"{type(weight_version).__name__} {weight_version!r}"
            )
        source = self._source(weights)
        if not self.is_sender:
            for _ in source:  # rule 4: the trainer-side collectives of the source's iteration
                pass
            return
        self._require_endpoint()
        if monotonic:
            self._refuse_stale(weight_version)
        self.client.start_weight_update()
        self.update(source, check_finite=check_finite)
        if weight_version is None:
            self.client.finish_weight_update()
        else:
            self.client.finish_weight_update(weight_version)
            self.sent_version = weight_version
        self.rounds += 1

    def _refuse_stale(self, weight_version: str | None) -> None:
        """The monotonic guard on the trainer's side (see :meth:`send_weights`)."""
        if weight_version is None:
            raise ValueError("send_weights(monotonic=True) needs a weight_version to compare")
        version_order(weight_version)  # a version the guard cannot order is refused before any RPC
        get = getattr(self.client, "get_weight_version", None)
        served = [("the engines' weight_version", str(get()))] if callable(get) else []
        if self.sent_version is not None:
            served.append(("the last weight_version this trainer set", self.sent_version))
        for where, version in served:
            if version_older(weight_version, version):
                raise StaleWeightVersionError(weight_version, version, where)

    def update(self, weights: Any = None, *, check_finite: bool | None = None) -> None:
        """Only the ``update_weights`` part of a round (rules 2-3), for a caller that opens and closes
        the round itself (``start_weight_update`` / ``finish_weight_update`` through its own client: a
        controller that times the phases, or one that sends a round in several parts). Sender only.

        ``check_finite``: as :meth:`send_weights`.

        Raises:
            as :meth:`send_weights`.
        """
        endpoint = self._require_endpoint()
        source = self._source(weights)
        check_finite = self.init_info.check_finite if check_finite is None else check_finite
        self.send_error = None
        self._sending = False
        try:
            metadata = getattr(source, "metadata", None)
            if callable(metadata):
                declared: Declared = [(m.name, m.dtype, tuple(int(d) for d in m.shape)) for m in metadata()]
                self._round(endpoint, declared, iter(source), check_finite)
            else:
                for chunk in chunks(source, self.wire.packed_buffer_size_bytes):
                    declared = [(n, t.dtype, tuple(t.shape)) for n, t in chunk]
                    self._round(endpoint, declared, iter(chunk), check_finite)
                    del chunk  # before the next chunk is pulled: hold one chunk at a time
        except BaseException as exc:
            # rule 6: the group survives a round every rank aborted together; not one whose data plane is
            # still blocked (the engines' RPC failed first) or timed out
            timed_out = isinstance(exc, TransferTimeoutError) or isinstance(
                self.send_error, TransferTimeoutError
            )
            if self._sending or timed_out:
                self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def _source(self, weights: Any) -> Any:
        source = weights if weights is not None else self.source
        if source is None:
            raise ValueError("send_weights: no source; pass one to trainer_init(source=...) or send_weights")
        if isinstance(source, torch.nn.Module):
            return self.module_source(source)
        if isinstance(source, Mapping):  # a state dict: its items, in its order
            return source.items()
        if not callable(getattr(source, "metadata", None)) and not isinstance(source, Iterable):
            raise ValueError(
                f"send_weights: the source must be a WeightSource (metadata() and iteration), an nn.Module, "
                f"a state dict or an iterable of (name, tensor) pairs, got {type(source).__name__}"
            )
        return source

    def _round(
        self,
        endpoint: Endpoint,
        declared: Declared,
        stream: Iterator[tuple[str, torch.Tensor]],
        check_finite: bool = False,
    ) -> None:
        update_info = update_info_of(declared)
        if (
            check_finite
        ):  # weightsync's optional field, sent only when set (vLLM's dataclasses parse the rest)
            update_info["check_finite"] = True
        sendable: Sequence[tuple[str, torch.dtype, Sequence[int]]] = declared
        nbytes = sum(math.prod(s) * d.itemsize for _, d, s in declared)
        deadline, basis = self.worker_info.round_deadline(nbytes)  # the transport's own (rounds rule 0)

        source_errors: list[BaseException] = []  # the trainer's source raised: every rank aborts the bucket

        def send() -> None:
            self._sending = True
            try:
                endpoint.send_stream(sendable, recorded(stream, source_errors), self.wire)
            except BaseException as exc:
                self.send_error = exc  # also when the engines' RPC error is the one raised
                raise
            finally:
                self._sending = False

        rpc = lambda: self.client.update_weights(update_info)  # noqa: E731
        concurrently(rpc, send, deadline, "update_weights", basis, engines_told=lambda _: bool(source_errors))

    def _require_endpoint(self) -> Endpoint:
        if self.broken is not None:
            raise RuntimeError(
                f"the weight-transfer endpoint is unusable after a failed round ({self.broken}); "
                "shut it down and call trainer_init again"
            )
        if self.endpoint is None:
            raise RuntimeError("the trainer is not initialised (trainer_init), or is not the sender (rank 0)")
        return self.endpoint

    @property
    def authenticated(self) -> bool:
        """Whether the engines were admitted by the authenticated rendezvous (the deployment's secret on
        both sides; :mod:`weightsync.impl.transfer.auth`). False before :meth:`trainer_init` or on a
        non-sender."""
        return self.endpoint is not None and self.endpoint.session is not None

    def shutdown(self) -> None:
        """Release the endpoint (idempotent)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


class BroadcastTrainerEngine(TrainerEngine):
    """Trainer side of the broadcast transport (backend ``nccl``; rank 0 hosts the TCPStore)."""

    init_info_cls: ClassVar[type[TrainerInitInfo]] = TrainerInitInfo

    def _open(self) -> Endpoint:
        from weightsync.impl.transfer.broadcast import BroadcastTrainer

        return BroadcastTrainer(self.worker_info, self.default_layout)


class IPCTrainerEngine(TrainerEngine):
    """Trainer side of the IPC transport (backend ``ipc``; the producer owns the shared buffers)."""

    init_info_cls: ClassVar[type[TrainerInitInfo]] = IPCTrainerInitInfo

    def _open(self) -> Endpoint:
        from weightsync.impl.transfer.ipc import IPCTrainer

        device = getattr(self.init_info, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        return IPCTrainer(self.worker_info, device, self.default_layout)


__all__ = [
    "BroadcastTrainerEngine",
    "Declared",
    "Endpoint",
    "IPCTrainerEngine",
    "IPCTrainerInitInfo",
    "ModuleWeights",
    "ParamMeta",
    "TrainerEngine",
    "TrainerInitInfo",
    "WeightSyncClient",
    "chunks",
    "concurrently",
    "update_info_of",
]
