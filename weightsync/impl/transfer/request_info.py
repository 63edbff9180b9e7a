"""Typed request records of the weight-transfer engines: ``init_info``, ``update_info``, the wire agreement.

Mirrors the request shapes of vLLM 0.32's ``vllm/distributed/weight_transfer/base.py`` (``base.py:332-518``):
``init_weight_transfer_engine`` (:class:`InitInfo`: vLLM's NCCL fields with the packing parameters, plus
weightsync's optional :class:`InitExtras`) and ``update_weights`` (:class:`UpdateInfo`: ``names``,
``dtype_names``, ``shapes``), built like vLLM's with ``cls(**dict)`` (``TypeError`` becomes ``ValueError``);
:class:`WireArgs`, what the trainer and every worker must agree on besides the tensors; and
:class:`ParallelInfo`, a worker's place in its engine (the transfer-rank formula). Every name here is also
importable from :mod:`weightsync.impl.transfer.base`, where the engine base class lives.

Every parse error is a ``ValueError`` whose message names the offending field, the value and the rule, and
is raised before any byte moves or any state changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

from weightsync.impl.transfer.fields import (
    field_bool,
    field_int,
    field_list,
    field_seconds,
    field_str,
    parse_request,
    request_dict,
)
from weightsync.impl.transfer.tensors import DTYPES, TensorMeta

#: vLLM's defaults for the packed format (0.32 packed_tensor.py:15-16): 1 GiB buffers, two of them.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2
#: Default deadline of the rendezvous when ``init_info`` has no ``timeout_s``, in seconds (vLLM's TCPStore
#: uses 300 s: engines may take minutes to start).
DEFAULT_TIMEOUT_S = 300.0
#: Without ``timeout_s``, every wait of one update round is sized to the round: this floor, seconds (it
#: covers the trainer and the engines reaching the round at different times) ...
DEFAULT_ROUND_FLOOR_S = 60.0
#: ... plus the round's payload bytes at this conservative bandwidth, bytes per second (50 MB/s: below a
#: 1 Gbit/s link; gloo on loopback, NCCL and shared memory are 10-1000x faster).
DEFAULT_ROUND_BANDWIDTH_BPS = 50e6
#: vLLM 0.32's NCCL worker ``init_info`` fields (``distributed/weight_transfer/nccl_common.py:96-103``). A
#: dict of only these parses in vLLM's ``NCCLWeightTransferInitInfo(**d)``; weightsync's producers always
#: send them (the rendezvous pair only when set) and every other field only when it is not at its default.
VLLM_INIT_FIELDS = (
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "nccl_unique_id_b64",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
)
#: vLLM 0.32's NCCL ``update_info`` fields (``distributed/weight_transfer/nccl_engine.py:93-95``).
VLLM_UPDATE_FIELDS = ("names", "dtype_names", "shapes")
#: Bucket layouts: weightsync's 16-byte aligned one and vLLM's NCCL packer's (``packed_tensor.py:69-140``);
#: see :mod:`weightsync.impl.transfer.packing`.
LAYOUTS = ("aligned", "vllm")
#: ``group_backend`` values: NCCL when the data lives on CUDA, else gloo; or forced.
GROUP_BACKENDS = ("auto", "gloo", "nccl")


def field_verify(d: dict[str, Any], what: str) -> None:
    """Raises ValueError unless ``d['verify']`` is False, True or ``"hmac"`` (:class:`WireArgs`)."""
    v = d["verify"]
    if not (isinstance(v, bool) or v == "hmac"):
        raise ValueError(
            f"{what}['verify']={v!r} must be False, True (a CRC-32 per bucket) or 'hmac' (an HMAC-SHA256 per "
            "bucket under the authenticated session's key)"
        )


@dataclass(frozen=True)
class WireArgs:
    """What the trainer and every worker must agree on besides the tensors (part of the wire agreement):
    the packing parameters of ``init_info`` (vLLM 0.32 fixes them at init, from the trainer's), ``verify``
    and the bucket layout.

    Attributes:
        packed: pack tensors into uint8 buckets (True) or send each tensor on its own (False).
        packed_buffer_size_bytes: bucket capacity B in bytes (> 0).
        packed_num_buffers: number of pipelined bucket buffers (1..64).
        verify: False; True (a CRC-32 per bucket, compared on every rank: corruption); or ``"hmac"`` (an
            HMAC-SHA256 per bucket under the authenticated rendezvous's session key, checked before
            ``load_weights``: a bucket changed on the path; needs the deployment's secret).
        layout: ``"aligned"`` (weightsync's, packing rules 2-4) or ``"vllm"`` (vLLM's packer byte for byte,
            packing rule 8).
    """

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    verify: bool | str = False
    layout: str = "aligned"

    def for_round(self, update_info: UpdateInfo) -> WireArgs:
        """These arguments with ``update_info.verify`` when the update names it (None: init's)."""
        if update_info.verify is None or update_info.verify == self.verify:
            return self
        return dataclasses.replace(self, verify=update_info.verify)


@dataclass(kw_only=True)
class InitExtras:
    """weightsync's optional ``init_info`` fields, shared by the workers' :class:`InitInfo` and the
    trainer's :class:`~weightsync.impl.transfer.trainer.TrainerInitInfo`. vLLM's own classes reject them
    (``TypeError`` in ``cls(**d)``), so weightsync's producers send each one only when it is not at its
    default.

    Attributes:
        timeout_s: deadline of every rendezvous and collective, seconds (> 0). None (the default): the
            rendezvous waits :data:`DEFAULT_TIMEOUT_S` and each update round's waits are sized to the round
            (:meth:`InitInfo.round_deadline`).
        verify: per-bucket check (:class:`WireArgs`): False (the default), True (CRC-32) or ``"hmac"``.
        layout: ``"aligned"`` or ``"vllm"`` (:class:`WireArgs`); None (the default): the backend's own
            (``"aligned"`` for the reference transports and ``weightsync_ipc``, ``"vllm"`` for vLLM backend
            ``weightsync``). Both sides resolve it alike; a disagreement fails the wire agreement.
        group_backend: ``"auto"`` (NCCL when the data lives on CUDA, else gloo), ``"gloo"`` or ``"nccl"``
            (the broadcast transport's process group; ignored by IPC).
        is_checkpoint_format: True (the default, vLLM's only format: checkpoint names through
            ``model.load_weights`` and vLLM's layerwise reload, ``model_loader/reload/inplace.py``); False:
            kernel format, ``named_parameters()`` names copied by exact name (weightsync's reference engine
            only). vLLM 0.32's ``start_weight_update()`` takes no argument, so the format is fixed here.
        allow_unauthenticated: accept a rendezvous without the deployment's secret on a non-loopback
            ``master_address`` (default False: refused; :mod:`weightsync.impl.transfer.rendezvous` rule 2).
            A warning is logged once. Ignored where a secret is configured: it is then required.
    """

    timeout_s: float | None = None
    verify: bool | str = False
    layout: str | None = None
    group_backend: str = "auto"
    is_checkpoint_format: bool = True
    allow_unauthenticated: bool = False

    def _check_extras(self, what: str) -> None:
        """Raises ValueError naming the first extra field with a wrong type or value."""
        d = self.__dict__
        if self.timeout_s is not None:
            field_seconds(d, "timeout_s", what)
        field_verify(d, what)
        field_bool(d, "is_checkpoint_format", what)
        field_bool(d, "allow_unauthenticated", what)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(
                f"{what}['layout']={self.layout!r} must be 'aligned' (weightsync's), 'vllm' (vLLM's packer) "
                "or absent (the backend's default)"
            )
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(
                f"{what}['group_backend']={self.group_backend!r} must be one of 'auto', 'gloo', 'nccl'"
            )


@dataclass(kw_only=True)
class InitInfo(InitExtras):
    """A worker's ``init_info``: vLLM 0.32's NCCL fields (``NCCLWeightTransferInitInfo``,
    ``distributed/weight_transfer/nccl_common.py:71-103``, packing at init) plus :class:`InitExtras`.
    The reference transports and the vLLM plugin's backends (a subclass that is also vLLM's
    ``WeightTransferInitInfo``) parse it alike.

    Attributes:
        master_address, master_port: the trainer's TCPStore (the trainer is rank 0 and hosts it); port
            1..65535.
        rank_offset: transfer rank of this engine's first worker (>= 1; vLLM's trainer always sends 1).
        world_size: trainer + every worker of every DP replica (>= 2); every rank must pass the same value
            (checked at the rendezvous: ``WireMismatchError``).
        nccl_unique_id_b64: vLLM's torch-free rendezvous; accepted in the shape and refused (weightsync's
            wire agreement and per-bucket status run over the TCPStore).
        packed, packed_buffer_size_bytes, packed_num_buffers: the wire parameters, vLLM's worker defaults
            (unpacked, 1 GiB, 2); the trainer sends its own (``packed=True`` by default).

    Raises:
        ValueError: (at construction) a unique id, a missing rendezvous pair, a wrong type, a port outside
            1..65535, ``rank_offset < 1``, ``world_size < 2``, a buffer size < 1, ``packed_num_buffers``
            outside 1..64, or a bad extra field; the message names the field and the value.
    """

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = field(default=None, repr=False)
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        what = "init_info"
        if self.nccl_unique_id_b64 is not None:
            raise ValueError(
                "init_info['nccl_unique_id_b64']: weightsync rendezvous on the trainer's TCPStore (it carries "
                "the wire agreement and the per-bucket status); pass master_address and master_port instead"
            )
        if self.master_address is None or self.master_port is None:
            raise ValueError(
                "init_info needs both master_address and master_port (got "
                f"master_address={self.master_address!r}, master_port={self.master_port!r})"
            )
        d = self.__dict__
        field_str(d, "master_address", what)
        field_int(d, "master_port", what, 1, 65535)
        field_int(d, "rank_offset", what, 1)
        field_int(d, "world_size", what, 2)
        field_bool(d, "packed", what)
        field_int(d, "packed_buffer_size_bytes", what, 1)
        field_int(d, "packed_num_buffers", what, 1, 64)
        self._check_extras(what)

    @classmethod
    def parse(cls, obj: object) -> Self:
        """The typed ``init_info`` of dict ``obj`` (a dict vLLM's trainer, HTTP client or router produces
        parses unchanged).

        Raises:
            ValueError: not a dict with str keys, a missing or unknown field, or any rule of the class.
        """
        return parse_request(cls, obj, "init_info")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able request dict (inverse of :meth:`parse`): vLLM's fields, the others only when not at
        their defaults (so with defaults it also parses in vLLM's ``NCCLWeightTransferInitInfo``)."""
        return request_dict(self, VLLM_INIT_FIELDS)

    @property
    def address(self) -> str:
        """``master_address`` (never None after construction)."""
        assert self.master_address is not None
        return self.master_address

    @property
    def port(self) -> int:
        """``master_port`` (never None after construction)."""
        assert self.master_port is not None
        return self.master_port

    def wire(self, default_layout: str) -> WireArgs:
        """The wire arguments (``layout`` None resolves to ``default_layout``, the backend's)."""
        return WireArgs(
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            verify=self.verify,
            layout=self.layout if self.layout is not None else default_layout,
        )

    @property
    def rendezvous_timeout_s(self) -> float:
        """Deadline of the rendezvous (and of the process-group setup), seconds."""
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    @property
    def rendezvous_timeout_basis(self) -> str:
        """How :attr:`rendezvous_timeout_s` was chosen (quoted in timeout errors)."""
        if self.timeout_s is None:
            return f"timeout {DEFAULT_TIMEOUT_S:g} s: the default, init_info has no timeout_s"
        return f"timeout {self.timeout_s:g} s: init_info['timeout_s']"

    def round_deadline(self, nbytes: int | None) -> tuple[float, str]:
        """Deadline of every wait of one update round moving ``nbytes`` payload bytes (None: unknown, e.g.
        a malformed request), and how it was sized (quoted in timeout errors).

        ``init_info['timeout_s']`` when given; else :data:`DEFAULT_ROUND_FLOOR_S` + ``nbytes`` /
        :data:`DEFAULT_ROUND_BANDWIDTH_BPS`, so a small model fails fast and a large one is not cut off.
        """
        if self.timeout_s is not None:
            return float(self.timeout_s), f"timeout {self.timeout_s:g} s: init_info['timeout_s']"
        n = max(0, nbytes or 0)
        t = DEFAULT_ROUND_FLOOR_S + n / DEFAULT_ROUND_BANDWIDTH_BPS
        return t, (
            f"timeout {t:.1f} s sized to the round: {DEFAULT_ROUND_FLOOR_S:g} s floor + {n} bytes at a "
            f"conservative {DEFAULT_ROUND_BANDWIDTH_BPS / 1e6:g} MB/s (init_info has no timeout_s; set it to "
            "fix every deadline)"
        )


@dataclass
class UpdateInfo:
    """``update_info`` of one ``update_weights`` call: vLLM 0.32's NCCL fields
    (``NCCLWeightTransferUpdateInfo``, ``distributed/weight_transfer/nccl_engine.py:83-110``) plus
    weightsync's optional ``verify`` and ``check_finite``. The packing parameters are ``init_info``'s.

    Attributes:
        names: ordered tensor names; the order must equal the trainer's.
        dtype_names: one wire dtype name per tensor (keys of :data:`DTYPES`: the torch attribute names,
            as vLLM's trainer writes them, ``nccl_engine.py:334``).
        shapes: one shape per tensor (a list of ints, every dimension >= 0).
        verify: override ``init_info``'s ``verify`` for this call (None: init's; else False, True or
            ``"hmac"``); the trainer must agree.
        check_finite: the engine worker refuses NaN / +-Inf in received floating-point weights before
            loading them (default False; local to each worker, so not part of the wire description: the
            trainer never sees it). See the worker's rule 7.

    Raises:
        ValueError: (at construction) ``names`` / ``dtype_names`` / ``shapes`` not lists of equal length
            (vLLM's rule); a name that is not a non-empty str or appears twice; an unknown dtype name; a
            shape that is not a list of ints or has a negative dimension; ``verify`` not a bool, ``"hmac"`` or
            None;
            ``check_finite`` not a bool.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    verify: bool | str | None = None
    check_finite: bool = False

    def __post_init__(self) -> None:
        what = "update_info"
        d = self.__dict__
        names, dtypes, shapes = (field_list(d, k, what) for k in VLLM_UPDATE_FIELDS)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"update_info length mismatch: names has {len(names)}, dtype_names has {len(dtypes)}, "
                f"shapes has {len(shapes)}; the three lists must be parallel"
            )
        seen: dict[str, int] = {}
        for i, n in enumerate(names):
            if not isinstance(n, str) or not n:
                raise ValueError(f"update_info['names'][{i}] must be a non-empty str, got {n!r}")
            if n in seen:
                raise ValueError(
                    f"update_info['names'] lists {n!r} twice (positions {seen[n]} and {i}); "
                    "each weight arrives exactly once per round"
                )
            seen[n] = i
        for i, t in enumerate(dtypes):
            if not isinstance(t, str) or t not in DTYPES:
                raise ValueError(
                    f"update_info['dtype_names'][{i}]={t!r} (for {names[i]!r}) is not a known dtype name; "
                    f"known: {', '.join(sorted(DTYPES))}"
                )
        for i, s in enumerate(shapes):
            if not isinstance(s, list | tuple):
                raise ValueError(f"update_info['shapes'][{i}] must be a list of ints, got {s!r}")
            for dim in s:
                if isinstance(dim, bool) or not isinstance(dim, int):
                    raise ValueError(f"update_info['shapes'][{i}]={list(s)!r} must contain only ints")
                if dim < 0:
                    raise ValueError(
                        f"update_info['shapes'][{i}]={list(s)!r} (for {names[i]!r}) has negative dimension "
                        f"{dim}; every dimension must be >= 0"
                    )
        if self.verify is not None:
            field_verify(d, what)
        field_bool(d, "check_finite", what)
        self.names, self.dtype_names = list(names), list(dtypes)
        self.shapes = [list(s) for s in shapes]

    @classmethod
    def parse(cls, obj: object) -> Self:
        """The typed ``update_info`` of dict ``obj`` (vLLM's ``NCCLWeightTransferUpdateInfo`` dicts parse
        unchanged).

        Raises:
            ValueError: not a dict with str keys, a missing or unknown field, or any rule of the class.
        """
        return parse_request(cls, obj, "update_info")

    def metas(self) -> list[TensorMeta]:
        """One :class:`TensorMeta` per tensor, in order."""
        return [
            TensorMeta(n, t, tuple(s))
            for n, t, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]

    @property
    def nbytes(self) -> int:
        """Payload bytes of the update."""
        return sum(m.nbytes for m in self.metas())

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able request dict (inverse of :meth:`parse`; the optional fields only when set)."""
        out = request_dict(self, VLLM_UPDATE_FIELDS)
        out["names"], out["dtype_names"] = list(self.names), list(self.dtype_names)
        out["shapes"] = [list(s) for s in self.shapes]
        return out

    @classmethod
    def of(cls, metas: Sequence[TensorMeta]) -> Self:
        """The update info describing ``metas`` in order (vLLM's three fields only)."""
        return cls(
            names=[m.name for m in metas],
            dtype_names=[m.dtype_name for m in metas],
            shapes=[list(m.shape) for m in metas],
        )


class ParallelInfo(NamedTuple):
    """Where a worker sits in its engine: the inputs of the transfer-rank formula (vLLM 0.32
    ``distributed/weight_transfer/nccl_common.py:193-201``).

    Attributes:
        dp_index: the engine's data-parallel *index* (not its DP rank, which dense models force to 0:
            vLLM issue #36932 / PR #36940, scenario B1).
        tp_size, pp_size: tensor- and pipeline-parallel sizes of the engine.
        local_rank: this worker's rank within the engine, ``0 <= local_rank < tp_size * pp_size``.
    """

    dp_index: int = 0
    tp_size: int = 1
    pp_size: int = 1
    local_rank: int = 0

    def worker_index(self) -> int:
        """This worker's global rank among the workers of every replica, without the trainer:
        ``dp_index * (tp_size * pp_size) + local_rank`` (vLLM's index into a list ``update_info``,
        ``v1/worker/gpu_worker.py:1570-1578``)."""
        return self.dp_index * self.tp_size * self.pp_size + self.local_rank

    def local_update_info(self, update_info: object) -> object:
        """vLLM's worker rule (``v1/worker/gpu_worker.py:1570-1578``): a list ``update_info`` holds one entry
        per worker of every replica, indexed by :meth:`worker_index`; anything else is this worker's own.

        Raises:
            ValueError: a list without an entry for this worker (naming its length and the index).
        """
        if not isinstance(update_info, list):
            return update_info
        i = self.worker_index()
        if not 0 <= i < len(update_info):
            raise ValueError(
                f"update_info is a list of {len(update_info)} per-worker entries but this worker's index is "
                f"{i} (dp_index {self.dp_index} * {self.tp_size * self.pp_size} + local_rank "
                f"{self.local_rank}; vLLM v1/worker/gpu_worker.py:1570-1578): one entry per worker of every "
                "replica"
            )
        return update_info[i]

    def transfer_rank(self, rank_offset: int, world_size: int) -> int:
        """``rank_offset + dp_index * (tp_size * pp_size) + local_rank``, validated.

        Raises:
            ValueError: a negative index, ``local_rank`` outside its engine, or a rank outside
                ``1 .. world_size - 1`` (rank 0 is the trainer).
        """
        if self.dp_index < 0 or self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"invalid parallel layout {self}: dp_index >= 0, tp_size >= 1, pp_size >= 1")
        per_engine = self.tp_size * self.pp_size
        if not 0 <= self.local_rank < per_engine:
            raise ValueError(f"local_rank={self.local_rank} outside 0..{per_engine - 1} (tp_size*pp_size)")
        rank = rank_offset + self.dp_index * per_engine + self.local_rank
        if not 1 <= rank < world_size:
            raise ValueError(
                f"transfer rank {rank} = rank_offset {rank_offset} + dp_index {self.dp_index} * "
                f"{per_engine} + local_rank {self.local_rank} is outside 1..{world_size - 1} "
                f"(world_size={world_size}; vLLM PR #36940)"
            )
        return rank


__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_ROUND_BANDWIDTH_BPS",
    "DEFAULT_ROUND_FLOOR_S",
    "DEFAULT_TIMEOUT_S",
    "GROUP_BACKENDS",
    "LAYOUTS",
    "VLLM_INIT_FIELDS",
    "VLLM_UPDATE_FIELDS",
    "InitExtras",
    "InitInfo",
    "ParallelInfo",
    "UpdateInfo",
    "WireArgs",
]
