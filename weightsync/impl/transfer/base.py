"""Weight-transfer engine base class and the loadable-model protocol.

Mirrors vLLM 0.32's ``vllm/distributed/weight_transfer/base.py`` (``base.py:332-518``): a small abstract
transport base class with ``init_transfer_engine``, ``receive_weights``, ``shutdown``. The typed request
records it parses (``init_info``: :class:`InitInfo`, ``update_info``: :class:`UpdateInfo`, the wire
agreement's :class:`WireArgs`, a worker's :class:`ParallelInfo`) live in
:mod:`weightsync.impl.transfer.request_info` and are re-exported here, as are the tensor metadata helpers
of :mod:`weightsync.impl.transfer.tensors`. The vLLM plugin's request classes are subclasses of these that
are also vLLM's (:mod:`weightsync.vllm.engine`); the trainer side is :mod:`weightsync.impl.transfer.trainer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol, runtime_checkable

import torch

from weightsync.impl.transfer.request_info import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_ROUND_BANDWIDTH_BPS,
    DEFAULT_ROUND_FLOOR_S,
    DEFAULT_TIMEOUT_S,
    GROUP_BACKENDS,
    LAYOUTS,
    VLLM_INIT_FIELDS,
    VLLM_UPDATE_FIELDS,
    InitExtras,
    InitInfo,
    ParallelInfo,
    UpdateInfo,
    WireArgs,
)
from weightsync.impl.transfer.tensors import (
    DTYPES,
    NonFiniteWeightError,
    TensorMeta,
    dtype_name,
    meta_of,
    non_finite_counts,
)
from weightsync.spec.errors import WeightSyncError


class PortInUseError(WeightSyncError, OSError):
    """The trainer could not host the rendezvous store: ``master_port`` is already in use (EADDRINUSE)."""


class AuthenticationError(WeightSyncError):
    """The rendezvous refused to admit a rank, or a rank refused the store it reached: the two sides do not
    hold the same deployment secret, one side holds none, or the trainer rejected this rank's claim
    (:mod:`weightsync.impl.transfer.auth`). Raised at once, not at a deadline."""


class ChecksumMismatchError(WeightSyncError):
    """With ``verify=True``, a bucket's checksum on some rank differs from the trainer's (corruption)."""


# ------------------------------------------------------------------------------------------------ model


@runtime_checkable
class LoadableModel(Protocol):
    """What a weight-transfer worker loads into (implemented by the reference LM in impl/models).

    Contract: ``load_weights`` *copies* every tensor into the model's own storage and keeps no reference
    to it: the transports hand out views of reused buffers (packed broadcast) or of shared memory (IPC),
    which are overwritten as soon as ``load_weights`` returns.

    Optional: ``checkpoint_weight_dtypes() -> {name: dtype}`` (exact dtype checks, worker rule 4) and
    ``tied_checkpoint_weights() -> {alias: source}`` (names accepted without being expected, e.g. a tied
    ``lm_head.weight``; ``load_weights`` checks each alias against its source, worker rule 3).
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(checkpoint name, tensor)`` pairs; return the checkpoint (HF) names loaded.

        Raises:
            KeyError: naming a checkpoint name the model does not have.
        """
        ...

    def checkpoint_weight_names(self) -> set[str]:
        """Every checkpoint name the model expects exactly once per round (buffers excluded)."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``nn.Module.named_parameters``; the kernel format copies into these by exact name."""
        ...

    def process_weights_after_loading(self) -> None:
        """Post-processing run once at ``finish_weight_update`` (e.g. int8 weight-only quantization)."""
        ...


#: ``load_weights`` as the engine sees it: called incrementally with lists of ``(name, tensor)``.
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
#: A local check run on the parsed update before the wire agreement; raises ValueError to veto.
LocalCheck = Callable[["UpdateInfo"], None]
#: Where a weight will end up unchanged (kernel format: the parameter itself), or None when loading
#: transforms it (fusing, casting, sharding). A transport may receive straight into it.
Destination = Callable[["TensorMeta"], "torch.Tensor | None"]


@dataclass
class RoundTimings:
    """Where a worker's rounds spend their time (seconds of ``time.perf_counter``, summed over every
    ``receive_weights`` since the last :meth:`take`), as the worker's receiving thread sees it.

    Attributes:
        agree_s: the wire agreement (a store all-gather, ``rounds`` rule 1).
        control_s: the per-bucket control (the status exchanges, or the in-band headers) and the end
            status exchange.
        transfer_wait_s: blocked in ``Work.wait`` on a payload broadcast (the wire is behind the loader).
        unpack_s: slicing the received buckets into typed views (and copying out unaligned members).
        load_s: inside the ``load_weights`` callback (the model's loaders, vLLM's layerwise processing of
            completed layers, and the copies the callback makes, :attr:`copy_s`).
        copy_s: the part of :attr:`load_s` spent copying received tensors out of reused buffers.
        total_s: the whole of ``receive_weights``.
        buckets: buckets received.
    """

    agree_s: float = 0.0
    control_s: float = 0.0
    transfer_wait_s: float = 0.0
    unpack_s: float = 0.0
    load_s: float = 0.0
    copy_s: float = 0.0
    total_s: float = 0.0
    buckets: int = 0

    def take(self) -> dict[str, float]:
        """The sums so far as a dict, and reset them to zero."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return out


class WeightTransferEngine(ABC):
    """Base class of a transport backend (the transport part of vLLM's ``WeightTransferEngine``).

    One instance lives in each engine worker. The packing parameters are fixed by
    :meth:`init_transfer_engine` (vLLM 0.32: packing in ``init_info``); the trainer side is
    :mod:`weightsync.impl.transfer.trainer`.

    Args:
        parallel: this worker's place in its engine (transfer-rank formula).
        default_layout: the bucket layout when ``init_info`` names none (default: the class's
            :attr:`default_layout`; the vLLM plugin's backend ``weightsync`` passes ``"vllm"``).

    Attributes:
        init_info_cls, update_info_cls: the typed request records.
        rank: this worker's transfer rank (set by :meth:`init_transfer_engine`).
        wire: the wire arguments of the group (set by :meth:`init_transfer_engine`).
    """

    init_info_cls: ClassVar[type[InitInfo]] = InitInfo
    update_info_cls: ClassVar[type[UpdateInfo]] = UpdateInfo
    default_layout: ClassVar[str] = "aligned"

    def __init__(self, parallel: ParallelInfo | None = None, default_layout: str | None = None) -> None:
        self.parallel = parallel if parallel is not None else ParallelInfo()
        self.layout_default = default_layout if default_layout is not None else type(self).default_layout
        self.rank: int | None = None
        self.wire: WireArgs | None = None
        #: where this worker's rounds spent their time (:class:`RoundTimings`)
        self.timings = RoundTimings()

    def parse_init_info(self, init_info: object) -> InitInfo:
        """Typed ``init_info`` (see :meth:`InitInfo.parse`).

        Raises:
            ValueError: naming the field and the rule.
        """
        return self.init_info_cls.parse(init_info)

    def parse_update_info(self, update_info: object) -> UpdateInfo:
        """Typed ``update_info`` (see :meth:`UpdateInfo.parse`).

        Raises:
            ValueError: naming the field and the rule.
        """
        return self.update_info_cls.parse(update_info)

    def round_wire(self, update_info: UpdateInfo) -> WireArgs:
        """The wire arguments of one update (``init_info``'s, with the update's ``verify`` override).

        Raises:
            RuntimeError: not initialised.
        """
        if self.wire is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised (init_weight_transfer_engine)")
        return self.wire.for_round(update_info)

    @abstractmethod
    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join the transfer group (blocks until the trainer and every worker joined or the timeout); sets
        :attr:`wire` from ``init_info`` (``layout`` None: :attr:`layout_default`)."""

    @abstractmethod
    def receive_weights(
        self,
        update_info: UpdateInfo,
        load_weights: LoadFn,
        local_check: LocalCheck | None = None,
        destination: Destination | None = None,
    ) -> None:
        """Receive one update and call ``load_weights`` incrementally with ``(name, tensor)`` lists.

        ``local_check`` runs on this rank before the wire agreement; if it raises ``ValueError`` this rank
        vetoes the update, every rank raises before any payload moves and the exception propagates here.
        ``destination`` (optional) names the tensor each weight is copied into unchanged; a transport may
        receive into it directly (``load_weights`` is still called, with views of that same memory, so its
        copy is a no-op and its bookkeeping runs). Transports that cannot use it ignore it.
        """

    @abstractmethod
    def reject_update(self, error: BaseException) -> None:
        """Take part in this update's wire agreement as a veto (the local request was malformed), then
        raise ``error``. Peers raise :class:`~weightsync.spec.errors.WireMismatchError` naming this rank."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the group, buffers and shared memory; idempotent."""


__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_ROUND_BANDWIDTH_BPS",
    "DEFAULT_ROUND_FLOOR_S",
    "DEFAULT_TIMEOUT_S",
    "DTYPES",
    "GROUP_BACKENDS",
    "LAYOUTS",
    "VLLM_INIT_FIELDS",
    "VLLM_UPDATE_FIELDS",
    "AuthenticationError",
    "ChecksumMismatchError",
    "Destination",
    "InitExtras",
    "InitInfo",
    "LoadFn",
    "LoadableModel",
    "LocalCheck",
    "NonFiniteWeightError",
    "ParallelInfo",
    "PortInUseError",
    "RoundTimings",
    "TensorMeta",
    "UpdateInfo",
    "WeightTransferEngine",
    "WireArgs",
    "dtype_name",
    "meta_of",
    "non_finite_counts",
]
