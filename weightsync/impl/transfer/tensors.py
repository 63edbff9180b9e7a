"""What one tensor is on the wire: the dtypes weightsync moves (by wire name), a tensor's metadata, and the
opt-in finiteness check of received weights."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from weightsync.spec.errors import WeightSyncError

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
        """Payload size in bytes: ``prod(shape) * itemsize`` (vLLM 0.32
        ``distributed/weight_transfer/packed_tensor.py:107-124``)."""
        return self.numel * self.dtype.itemsize


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of a real tensor (the trainer side derives its metadata this way)."""
    return TensorMeta(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))


__all__ = ["DTYPES", "NonFiniteWeightError", "TensorMeta", "dtype_name", "meta_of", "non_finite_counts"]
