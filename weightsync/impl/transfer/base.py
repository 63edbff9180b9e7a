"""Weight-transfer engine base class, typed request parsing and the loadable-model protocol.

Mirrors vLLM's ``vllm/distributed/weight_transfer/base.py`` (reference section 2): a small abstract base
class with ``init_transfer_engine``, ``receive_weights``, ``shutdown`` and a static trainer-side
``trainer_send_weights``; ``parse_init_info`` / ``parse_update_info`` turn the request dicts into typed
records and map ``TypeError`` to ``ValueError`` naming the field.

Every parse error is a ``ValueError`` whose message names the offending field, the value and the rule, and
is raised before any byte moves or any state changes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from weightsync.spec.errors import WeightSyncError

#: vLLM's defaults for the packed format (reference section 3): 1 GiB buffers, two of them.
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

#: Wire names of the dtypes weightsync can move (vLLM's ``dtype_names`` use the torch attribute names).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_FINITE_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PortInUseError(WeightSyncError, OSError):
    """The trainer could not host the rendezvous store: ``master_port`` is already in use (EADDRINUSE)."""


class ChecksumMismatchError(WeightSyncError):
    """With ``verify=True``, a bucket's checksum on some rank differs from the trainer's (corruption)."""


class NonFiniteWeightError(WeightSyncError, ValueError):
    """With ``update_info['check_finite']=True``, received floating-point weights hold NaN or +/-Inf.

    Raised by the engine worker on the received bytes, before ``load_weights`` copies any weight of the
    batch (see :class:`~weightsync.impl.transfer.worker.WeightTransferWorker`, rule 7).

    Attributes:
        counts: weight name -> number of non-finite elements, in arrival order.
    """

    def __init__(self, counts: Mapping[str, int], numels: Mapping[str, int]) -> None:
        self.counts: dict[str, int] = dict(counts)
        shown = "; ".join(
            f"{n!r} has {c} non-finite element(s) of {numels[n]}" for n, c in list(self.counts.items())[:10]
        )
        more = f"; and {len(self.counts) - 10} more weight(s)" if len(self.counts) > 10 else ""
        super().__init__(
            f"update_weights: check_finite=True: every floating-point weight must be finite (no NaN, +Inf or "
            f"-Inf) before it is loaded, but {len(self.counts)} weight(s) are not: {shown}{more}; nothing of "
            "this batch was loaded, and this round cannot finish"
        )


def non_finite_counts(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Number of NaN / +Inf / -Inf elements per floating-point tensor of ``weights`` (only nonzero counts).

    Integer and bool tensors are always finite. float8 tensors are widened to float32 for the test.
    """
    out: dict[str, int] = {}
    for name, t in weights:
        if not t.dtype.is_floating_point or t.numel() == 0:
            continue
        x = t if t.dtype in _FINITE_NATIVE else t.float()
        bad = t.numel() - int(torch.isfinite(x).sum())
        if bad:
            out[name] = bad
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (e.g. ``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: ``dtype`` is not one of :data:`DTYPES`.
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be transferred; supported: {', '.join(sorted(DTYPES))}"
        ) from None


class TensorMeta(NamedTuple):
    """What both sides must agree on for one tensor: checkpoint (or kernel) name, dtype name and shape."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`dtype_name`."""
        return DTYPES[self.dtype_name]

    @property
    def numel(self) -> int:
        """Number of elements (``prod(shape)``; 1 for a 0-dim tensor)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: ``prod(shape) * itemsize`` (reference section 3)."""
        return self.numel * self.dtype.itemsize


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of a real tensor (the trainer side derives its metadata this way)."""
    return TensorMeta(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))


# ---------------------------------------------------------------------------------------------- parsing


def _require_mapping(obj: object, what: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(obj).__name__}")
    for k in obj:
        if not isinstance(k, str):
            raise ValueError(f"{what} keys must be str, got {k!r}")
    return obj


def _check_fields(d: Mapping[str, Any], what: str, required: Sequence[str], optional: Sequence[str]) -> None:
    for f in required:
        if f not in d:
            raise ValueError(f"{what} is missing required field {f!r} (required: {', '.join(required)})")
    allowed = set(required) | set(optional)
    for k in d:
        if k not in allowed:
            raise ValueError(f"{what} has unknown field {k!r}; allowed fields: {', '.join(sorted(allowed))}")


def _int(
    d: Mapping[str, Any], key: str, what: str, minimum: int | None = None, maximum: int | None = None
) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what}[{key!r}] must be an int, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{what}[{key!r}]={v} must be >= {minimum}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{what}[{key!r}]={v} must be <= {maximum}")
    return v


def _bool(d: Mapping[str, Any], key: str, what: str) -> bool:
    v = d[key]
    if not isinstance(v, bool):
        raise ValueError(f"{what}[{key!r}] must be a bool, got {type(v).__name__} {v!r}")
    return v


def _float(d: Mapping[str, Any], key: str, what: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what}[{key!r}] must be a positive finite number of seconds, got {v!r}")
    return float(v)


def _str(d: Mapping[str, Any], key: str, what: str) -> str:
    v = d[key]
    if not isinstance(v, str) or not v:
        raise ValueError(f"{what}[{key!r}] must be a non-empty str, got {type(v).__name__} {v!r}")
    return v


def _list(d: Mapping[str, Any], key: str, what: str) -> Sequence[Any]:
    v = d[key]
    if not isinstance(v, list | tuple):
        raise ValueError(f"{what}[{key!r}] must be a list, got {type(v).__name__}")
    return v


@dataclass(frozen=True)
class RendezvousInitInfo:
    """``init_info`` of the ``nccl`` (broadcast) and ``ipc`` backends (vLLM's NCCL init-info fields).

    Attributes:
        master_address: host of the trainer's TCPStore (the trainer is rank 0 and hosts it).
        master_port: its TCP port, 1..65535.
        rank_offset: transfer rank of this engine's first worker (>= 1; rank 0 is the trainer).
        world_size: trainer + every engine worker of every replica (>= 2; ``1 + tp*pp*dp`` for one replica);
            every rank must pass the same value (checked at the rendezvous: ``WireMismatchError``).
        timeout_s: deadline of every rendezvous and collective, seconds (weightsync extension). None (the
            field absent): the rendezvous waits :data:`DEFAULT_TIMEOUT_S` and each update round's waits are
            sized to the round (:meth:`round_deadline`).
        backend: ``"auto"`` (NCCL when CUDA is available, else gloo), ``"gloo"`` or ``"nccl"``
            (weightsync extension; ignored by ``ipc``).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float | None = None
    backend: str = "auto"

    REQUIRED: ClassVar[tuple[str, ...]] = ("master_address", "master_port", "rank_offset", "world_size")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("timeout_s", "backend")

    @classmethod
    def parse(cls, obj: object) -> RendezvousInitInfo:
        """Validate an ``init_info`` dict.

        Raises:
            ValueError: not a dict, a missing or unknown field, a wrong type, a port outside 1..65535,
                ``rank_offset < 1``, ``world_size < 2``, a non-positive timeout or an unknown backend.
        """
        what = "init_info"
        d = _require_mapping(obj, what)
        _check_fields(d, what, cls.REQUIRED, cls.OPTIONAL)
        backend = _str(d, "backend", what) if "backend" in d else "auto"
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"init_info['backend']={backend!r} must be one of 'auto', 'gloo', 'nccl'")
        return cls(
            master_address=_str(d, "master_address", what),
            master_port=_int(d, "master_port", what, 1, 65535),
            rank_offset=_int(d, "rank_offset", what, 1),
            world_size=_int(d, "world_size", what, 2),
            timeout_s=_float(d, "timeout_s", what) if "timeout_s" in d else None,
            backend=backend,
        )

    @property
    def rendezvous_timeout_s(self) -> float:
        """Deadline of the rendezvous (and of the process-group setup), seconds."""
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else self.timeout_s

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
            return self.timeout_s, f"timeout {self.timeout_s:g} s: init_info['timeout_s']"
        n = max(0, nbytes or 0)
        t = DEFAULT_ROUND_FLOOR_S + n / DEFAULT_ROUND_BANDWIDTH_BPS
        return t, (
            f"timeout {t:.1f} s sized to the round: {DEFAULT_ROUND_FLOOR_S:g} s floor + {n} bytes at a "
            f"conservative {DEFAULT_ROUND_BANDWIDTH_BPS / 1e6:g} MB/s (init_info has no timeout_s; set it to "
            "fix every deadline)"
        )


@dataclass(frozen=True)
class UpdateInfo:
    """``update_info`` of one ``update_weights`` call (vLLM's NCCL update-info fields plus ``verify``).

    Attributes:
        names: ordered tensor names; the order must equal the trainer's (reference section 2).
        dtype_names: one wire dtype name per tensor (keys of :data:`DTYPES`).
        shapes: one shape per tensor, every dimension >= 0.
        packed: pack tensors into uint8 buckets (True) or send each tensor on its own (False).
        packed_buffer_size_bytes: bucket capacity B in bytes (> 0); default 1 GiB.
        packed_num_buffers: number of pipelined bucket buffers (>= 1); default 2.
        verify: carry a CRC32 per bucket and compare it on every rank (weightsync extension).
        layout: bucket layout, ``"aligned"`` (weightsync's, packing rules 2-4) or ``"vllm"`` (vLLM's NCCL
            packer byte for byte, packing rule 8); weightsync extension.
        check_finite: the engine worker refuses NaN / +-Inf in received floating-point weights before
            loading them (weightsync extension, default False; local to each worker, so not part of the
            wire description: the trainer never sees it). See the worker's rule 7.
    """

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    verify: bool = False
    layout: str = "aligned"
    check_finite: bool = False

    REQUIRED: ClassVar[tuple[str, ...]] = ("names", "dtype_names", "shapes")
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
        "verify",
        "layout",
        "check_finite",
    )

    @classmethod
    def parse(cls, obj: object) -> UpdateInfo:
        """Validate an ``update_info`` dict.

        Raises:
            ValueError: not a dict; a missing or unknown field; ``names``/``dtype_names``/``shapes`` not
                lists of equal length (reference section 2: "unequal lengths -> ValueError"); a name that is
                not a non-empty str or appears twice; an unknown dtype name; a shape that is not a list of
                ints or has a negative dimension; ``packed_buffer_size_bytes < 1``; ``packed_num_buffers < 1``;
                ``verify`` / ``packed`` / ``check_finite`` not a bool.
        """
        what = "update_info"
        d = _require_mapping(obj, what)
        _check_fields(d, what, cls.REQUIRED, cls.OPTIONAL)
        names = _list(d, "names", what)
        dtypes = _list(d, "dtype_names", what)
        shapes = _list(d, "shapes", what)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"update_info length mismatch: names has {len(names)}, dtype_names has {len(dtypes)}, "
                f"shapes has {len(shapes)}; the three lists must be parallel (reference section 2)"
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
        parsed_shapes: list[tuple[int, ...]] = []
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
            parsed_shapes.append(tuple(s))
        return cls(
            names=tuple(names),
            dtype_names=tuple(dtypes),
            shapes=tuple(parsed_shapes),
            packed=_bool(d, "packed", what) if "packed" in d else False,
            packed_buffer_size_bytes=(
                _int(d, "packed_buffer_size_bytes", what, 1)
                if "packed_buffer_size_bytes" in d
                else DEFAULT_PACKED_BUFFER_SIZE_BYTES
            ),
            packed_num_buffers=(
                _int(d, "packed_num_buffers", what, 1, 64)
                if "packed_num_buffers" in d
                else DEFAULT_PACKED_NUM_BUFFERS
            ),
            verify=_bool(d, "verify", what) if "verify" in d else False,
            layout=_layout(d, what),
            check_finite=_bool(d, "check_finite", what) if "check_finite" in d else False,
        )

    def metas(self) -> list[TensorMeta]:
        """One :class:`TensorMeta` per tensor, in order."""
        return [
            TensorMeta(n, t, s) for n, t, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able request dict (inverse of :meth:`parse`)."""
        return {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
            "verify": self.verify,
            "layout": self.layout,
            "check_finite": self.check_finite,
        }


def _layout(d: Mapping[str, Any], what: str) -> str:
    if "layout" not in d:
        return "aligned"
    v = d["layout"]
    if v not in ("aligned", "vllm"):
        raise ValueError(f"{what}['layout']={v!r} must be 'aligned' (weightsync's) or 'vllm' (vLLM's packer)")
    return str(v)


@dataclass(frozen=True)
class SendArgs:
    """Trainer-side packing arguments (vLLM's ``trainer_args`` less the group); must equal the engines'.

    Attributes mirror :class:`UpdateInfo`'s ``packed``, ``packed_buffer_size_bytes``,
    ``packed_num_buffers``, ``verify`` and ``layout``.
    """

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    verify: bool = False
    layout: str = "aligned"

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
        "verify",
        "layout",
    )

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> SendArgs:
        """Validate the packing part of ``trainer_args`` (keys other than these five are ignored here).

        Raises:
            ValueError: a wrong type or out-of-range value, as for :meth:`UpdateInfo.parse`.
        """
        what = "trainer_args"
        return cls(
            packed=_bool(d, "packed", what) if "packed" in d else False,
            packed_buffer_size_bytes=(
                _int(d, "packed_buffer_size_bytes", what, 1)
                if "packed_buffer_size_bytes" in d
                else DEFAULT_PACKED_BUFFER_SIZE_BYTES
            ),
            packed_num_buffers=(
                _int(d, "packed_num_buffers", what, 1, 64)
                if "packed_num_buffers" in d
                else DEFAULT_PACKED_NUM_BUFFERS
            ),
            verify=_bool(d, "verify", what) if "verify" in d else False,
            layout=_layout(d, what),
        )

    def update_info(self, metas: Sequence[TensorMeta]) -> UpdateInfo:
        """The :class:`UpdateInfo` an engine should receive for ``metas`` sent with these arguments."""
        return UpdateInfo(
            names=tuple(m.name for m in metas),
            dtype_names=tuple(m.dtype_name for m in metas),
            shapes=tuple(m.shape for m in metas),
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            verify=self.verify,
            layout=self.layout,
        )


class ParallelInfo(NamedTuple):
    """Where a worker sits in its engine: the inputs of the transfer-rank formula (reference section 2).

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


class WeightTransferEngine(ABC):
    """Base class of a transport backend (vLLM's ``WeightTransferEngine``).

    One instance lives in each engine worker; the trainer side is the static
    :meth:`trainer_send_weights` plus a backend-specific ``trainer_init``.

    Attributes:
        init_info_cls, update_info_cls: the typed request records.
        rank: this worker's transfer rank (set by :meth:`init_transfer_engine`).
    """

    init_info_cls: ClassVar[type[RendezvousInitInfo]] = RendezvousInitInfo
    update_info_cls: ClassVar[type[UpdateInfo]] = UpdateInfo

    def __init__(self, parallel: ParallelInfo | None = None) -> None:
        self.parallel = parallel if parallel is not None else ParallelInfo()
        self.rank: int | None = None

    def parse_init_info(self, init_info: object) -> RendezvousInitInfo:
        """Typed ``init_info``; ``TypeError`` from construction becomes ``ValueError`` (vLLM's rule).

        Raises:
            ValueError: see :meth:`RendezvousInitInfo.parse`.
        """
        try:
            return self.init_info_cls.parse(init_info)
        except TypeError as exc:
            raise ValueError(f"init_info: {exc}") from exc

    def parse_update_info(self, update_info: object) -> UpdateInfo:
        """Typed ``update_info``; ``TypeError`` becomes ``ValueError``.

        Raises:
            ValueError: see :meth:`UpdateInfo.parse`.
        """
        try:
            return self.update_info_cls.parse(update_info)
        except TypeError as exc:
            raise ValueError(f"update_info: {exc}") from exc

    @abstractmethod
    def init_transfer_engine(self, init_info: RendezvousInitInfo) -> None:
        """Join the transfer group (blocks until the trainer and every worker joined or the timeout)."""

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

    @staticmethod
    @abstractmethod
    def trainer_send_weights(
        iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: Mapping[str, Any]
    ) -> None:
        """Trainer side of one update: send every ``(name, tensor)`` of ``iterator`` in order."""


__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_ROUND_BANDWIDTH_BPS",
    "DEFAULT_ROUND_FLOOR_S",
    "DEFAULT_TIMEOUT_S",
    "DTYPES",
    "ChecksumMismatchError",
    "Destination",
    "LoadFn",
    "LoadableModel",
    "LocalCheck",
    "NonFiniteWeightError",
    "ParallelInfo",
    "PortInUseError",
    "RendezvousInitInfo",
    "SendArgs",
    "TensorMeta",
    "UpdateInfo",
    "WeightTransferEngine",
    "dtype_name",
    "meta_of",
    "non_finite_counts",
]
