"""The packed transfer format: a deterministic bucket partition, uint8 packing, reusable buffers, digests.

Rules (vLLM 0.32 ``distributed/weight_transfer/packed_tensor.py``, with weightsync's deviations marked):

1. A tensor's payload is ``prod(shape) * itemsize`` bytes of its contiguous form.
2. Tensors are placed in order into buckets of capacity ``B = packed_buffer_size_bytes`` with
   **flush-before-overflow**: a tensor that would overflow the current bucket closes it first, so no
   bucket exceeds ``B`` (vLLM's NCCL packer is exceed-then-flush, its IPC packer flush-before-overflow;
   weightsync uses one rule for both so the extra memory bound is exact).
3. A tensor larger than ``B`` gets a bucket of its own, marked ``oversized``; it is sent straight from
   (or received straight into) a tensor of its own, never through a packing buffer.
4. Each tensor's offset inside a bucket is rounded up to :data:`ALIGN` bytes (weightsync deviation: vLLM
   packs with no alignment, which ``Tensor.view(dtype)`` rejects for mixed dtypes at odd offsets).
5. Both sides compute the partition from metadata alone (names, dtypes, shapes, ``B``); nothing about
   boundaries travels on the wire (vLLM PR #31943 review, scenario B5: both sides must agree on ``B``).
6. Packing buffers are allocated once per slot and reused across syncs (vLLM issue #52950 leaked
   ``B * num_buffers`` per sync); extra memory is at most ``num_buffers * B`` plus one oversized tensor.
7. **Zero-copy runs.** When a bucket's members already lie in one storage exactly at the bucket's offsets
   (a trainer keeping its parameters as views of one flat buffer, as Megatron and FSDP do, with every
   tensor starting at an :data:`ALIGN`-aligned offset in order), :func:`contiguous_run` returns that
   storage range and the sender moves it as is, without packing. The bytes on the wire are the same as
   packing would produce, except padding bytes (never read).
8. **vLLM's layout** (``layout="vllm"``, vLLM 0.32 ``vllm/distributed/weight_transfer/
   packed_tensor.py:69-140``): rules 2-4 replaced by vLLM's NCCL packer, byte for byte: tensors are
   appended in order with **no alignment** and a bucket is closed right **after** the tensor that makes it
   exceed ``B`` (exceed-then-flush; a bucket may hold up to ``B`` plus its last tensor). A bucket whose
   only member exceeds ``B`` is marked ``oversized`` (its bytes are that tensor, as in vLLM). Members at
   an offset their dtype cannot be viewed at are copied out of the buffer on unpacking.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch

from weightsync.impl.transfer.base import LAYOUTS, ChecksumMismatchError, TensorMeta, WireArgs

#: Byte alignment of every tensor inside a bucket (rule 4).
ALIGN = 16
#: Version of the wire format; part of the digest so incompatible peers are told apart (v2: the broadcast
#: transport's per-bucket status travels in-band, :mod:`weightsync.impl.transfer.bucket_header`).
WIRE_FORMAT = "weightsync-packed-v2"


#: The tensors of a round by position: a list, or (a stream's current window) a dict of member indices.
Tensors: TypeAlias = Sequence[torch.Tensor] | Mapping[int, torch.Tensor]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Bucket(NamedTuple):
    """One bucket of the partition.

    Attributes:
        number: position of the bucket in the round (0-based).
        members: indices of its tensors in the update's order.
        offsets: byte offset of each member inside the bucket (aligned to :data:`ALIGN`).
        nbytes: bytes on the wire for this bucket (end of the last member; 0 for zero-size tensors only).
        oversized: the single member is larger than ``B`` and travels unpacked (rule 3).
    """

    number: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    oversized: bool


def plan_buckets(
    sizes: Sequence[int], buffer_size: int, packed: bool = True, layout: str = "aligned"
) -> tuple[Bucket, ...]:
    """The deterministic partition of tensors of ``sizes`` bytes into buckets of capacity ``buffer_size``.

    With ``packed=False`` every tensor is its own bucket (offset 0), still marked ``oversized`` when it
    exceeds ``buffer_size``. ``layout`` is ``"aligned"`` (rules 2-4) or ``"vllm"`` (rule 8). Pure function
    of its arguments (rule 5).

    Raises:
        ValueError: ``buffer_size < 1``, a negative size or an unknown layout.
    """
    if buffer_size < 1:
        raise ValueError(f"packed_buffer_size_bytes={buffer_size} must be >= 1")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {', '.join(map(repr, LAYOUTS))}")
    if layout == "vllm" and packed:
        return _plan_vllm(sizes, buffer_size)
    out: list[Bucket] = []
    cur: list[int] = []
    offs: list[int] = []
    end = 0

    def flush() -> None:
        nonlocal cur, offs, end
        if cur:
            out.append(Bucket(len(out), tuple(cur), tuple(offs), end, False))
        cur, offs, end = [], [], 0

    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"tensor {i} has negative size {n}")
        if n > buffer_size:
            flush()
            out.append(Bucket(len(out), (i,), (0,), n, True))
            continue
        if not packed:
            out.append(Bucket(len(out), (i,), (0,), n, False))
            continue
        start = _align(end) if cur else 0
        if cur and start + n > buffer_size:
            flush()
            start = 0
        cur.append(i)
        offs.append(start)
        end = start + n
    flush()
    return tuple(out)


def _plan_vllm(sizes: Sequence[int], buffer_size: int) -> tuple[Bucket, ...]:
    """Rule 8: ``packed_tensor.pack_tensors`` / ``packed_nccl_broadcast_consumer`` of vLLM 0.32 (append
    unaligned, close the bucket once its size exceeds ``buffer_size``; a trailing bucket, even of
    zero-size tensors only, is sent too)."""
    out: list[Bucket] = []
    cur: list[int] = []
    offs: list[int] = []
    end = 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"tensor {i} has negative size {n}")
        cur.append(i)
        offs.append(end)
        end += n
        if end > buffer_size:
            out.append(Bucket(len(out), tuple(cur), tuple(offs), end, len(cur) == 1))
            cur, offs, end = [], [], 0
    if cur:
        out.append(Bucket(len(out), tuple(cur), tuple(offs), end, False))
    return tuple(out)


def pool_cap(buckets: Sequence[Bucket], buffer_size: int) -> int:
    """Largest size a packing buffer may keep this round: ``B``, or more under vLLM's layout, whose
    buckets may exceed ``B`` by their last tensor (rule 8)."""
    return max(buffer_size, max_packed_bucket(buckets))


def max_packed_bucket(buckets: Sequence[Bucket]) -> int:
    """Largest non-oversized bucket in bytes (what each packing buffer must hold this round)."""
    return max((b.nbytes for b in buckets if not b.oversized), default=0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, any rank, zero-size allowed)."""
    return t.reshape(-1).view(torch.uint8)


def pack_bucket(dst: torch.Tensor, bucket: Bucket, tensors: Tensors) -> torch.Tensor:
    """Copy the bucket's members into ``dst`` (uint8, at least ``bucket.nbytes`` long); return the used view.

    Non-contiguous sources are copied with their strides (no intermediate contiguous copy). Padding bytes
    between members are left as they are (never read).
    """
    for i, off in zip(bucket.members, bucket.offsets, strict=True):
        t = tensors[i]
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        view = dst[off : off + n]
        if t.is_contiguous():
            view.copy_(as_bytes(t))
        elif _viewable(view, t.dtype):
            view.view(t.dtype).view(t.shape).copy_(t)
        else:  # vLLM's layout: an offset this dtype cannot be viewed at (rule 8)
            view.copy_(as_bytes(t.contiguous()))
    return dst[: bucket.nbytes]


def _viewable(b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the uint8 tensor ``b`` can be viewed as ``dtype`` in place (its storage offset is a
    multiple of the item size)."""
    return b.storage_offset() % dtype.itemsize == 0


def contiguous_run(bucket: Bucket, tensors: Tensors) -> torch.Tensor | None:
    """The bucket's bytes as a uint8 view of its members' own storage, or None (rule 7).

    Non-None only if every non-empty member is contiguous, all live in one storage on one device, and
    member ``j`` starts exactly ``offsets[j]`` bytes after the first one; zero-size members are ignored.
    """
    base = -1
    storage_ptr = 0
    first: torch.Tensor | None = None
    for i, off in zip(bucket.members, bucket.offsets, strict=True):
        t = tensors[i]
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            return None
        if first is None:
            first = t
            storage_ptr = t.untyped_storage().data_ptr()
            base = t.data_ptr() - off
            if base < storage_ptr:
                return None
        elif (
            t.data_ptr() != base + off
            or t.device != first.device
            or t.untyped_storage().data_ptr() != storage_ptr
        ):
            return None
    if first is None:
        return None
    storage = first.untyped_storage()
    start = base - storage_ptr
    if start + bucket.nbytes > storage.nbytes():
        return None
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    return view.set_(storage, start, (bucket.nbytes,), (1,))


def flat_layout(metas: Sequence[TensorMeta]) -> tuple[int, list[int]]:
    """Byte offsets of ``metas`` in one flat buffer laid out so that every bucket is a zero-copy run
    (rule 7): in order, each tensor at the next :data:`ALIGN`-aligned offset. Returns (total bytes,
    offsets). For any ``B``, the members of each bucket of :func:`plan_buckets` then sit at the bucket's
    offsets relative to its first member."""
    offsets: list[int] = []
    end = 0
    for m in metas:
        start = _align(end)
        offsets.append(start)
        end = start + m.nbytes
    return end, offsets


def flat_views(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Typed, shaped views of ``metas`` in the uint8 buffer ``flat`` at :func:`flat_layout`'s offsets.

    Raises:
        ValueError: ``flat`` is not a contiguous uint8 tensor of at least the layout's size.
    """
    total, offsets = flat_layout(metas)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous() or flat.numel() < total:
        raise ValueError(f"flat buffer must be a contiguous 1-D uint8 tensor of >= {total} bytes")
    return [flat[o : o + m.nbytes].view(m.dtype).view(m.shape) for m, o in zip(metas, offsets, strict=True)]


def unpack_bucket(
    src: torch.Tensor, bucket: Bucket, metas: Sequence[TensorMeta]
) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's members inside ``src`` (uint8), typed and shaped from ``metas``. No copy,
    except for a member at an offset its dtype cannot be viewed at (vLLM's unaligned layout, rule 8),
    which is copied out (``Tensor.view(dtype)`` rejects it: vLLM's own ``unpack_tensor`` raises there)."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, off in zip(bucket.members, bucket.offsets, strict=True):
        m = metas[i]
        raw = src[off : off + m.nbytes]
        if not _viewable(raw, m.dtype):
            raw = raw.clone()
        out.append((m.name, raw.view(m.dtype).view(m.shape)))
    return out


class BufferPool:
    """``num_buffers`` reusable uint8 packing buffers on one device (rule 6).

    A slot grows only when a round needs a bigger bucket than it holds, to at most ``buffer_size``; it is
    never reallocated otherwise, so repeated syncs with the same geometry allocate nothing.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._slots: list[torch.Tensor] = []

    def reserve(self, num_buffers: int, nbytes: int, buffer_size: int) -> None:
        """Make sure there are ``num_buffers`` slots holding ``nbytes`` each, none larger than
        ``buffer_size`` (a slot is reallocated only when too small, or larger than this round's ``B``)."""
        del self._slots[num_buffers:]
        for i in range(num_buffers):
            if i >= len(self._slots):
                self._slots.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            elif not nbytes <= self._slots[i].numel() <= buffer_size:
                self._slots[i] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free first
                self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def slot(self, i: int) -> torch.Tensor:
        """The full uint8 buffer of slot ``i``."""
        return self._slots[i]

    @property
    def nbytes(self) -> int:
        """Bytes currently held by the pool."""
        return sum(s.numel() for s in self._slots)

    def clear(self) -> None:
        """Free every slot."""
        self._slots.clear()


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a uint8 tensor's bytes (copied to host first when on an accelerator)."""
    if t.numel() == 0:
        return 0
    return zlib.crc32(_host_bytes(t))


#: ``verify`` values (:class:`~weightsync.impl.transfer.request_info.WireArgs`): False (no check), True
#: (CRC-32 per bucket: corruption) or ``"hmac"`` (HMAC-SHA256 per bucket under the session key of the
#: authenticated rendezvous: a bucket changed on the path; needs the deployment's secret).
VERIFY_MODES: tuple[bool | str, ...] = (False, True, "hmac")


def bucket_digest(buf: torch.Tensor | None, verify: bool | str, key: bytes | None) -> int | str | None:
    """The digest the trainer sends with a bucket's bytes ``buf`` (None or empty: no bytes) under
    ``verify``: None, a CRC-32 int, or an HMAC-SHA256 hex string under session key ``key``.

    Raises:
        ValueError: ``verify="hmac"`` and the group has no session key (no secret configured).
    """
    if not verify:
        return None
    if verify == "hmac":
        if key is None:
            raise ValueError(
                "verify='hmac' needs the session key of an authenticated rendezvous: configure the "
                "deployment's secret (WEIGHTSYNC_TOKEN_FILE) on the trainer and every engine"
            )
        data = b"" if buf is None or buf.numel() == 0 else _host_bytes(buf)
        return hmac.new(key, data, hashlib.sha256).hexdigest()
    return 0 if buf is None else crc32(buf)


def check_bucket(
    buf: torch.Tensor | None, expected: object, verify: bool | str, key: bytes | None, where: str
) -> None:
    """Compare ``buf``'s digest with the trainer's ``expected`` (:func:`bucket_digest`).

    Raises:
        ChecksumMismatchError: they differ, naming ``where``, both digests (a CRC) and ``verify``.
    """
    if not verify:
        return
    got = bucket_digest(buf, verify, key)
    # an HMAC tag is compared in constant time (as ``Secret.verify``); a CRC is no secret
    same = (
        isinstance(got, str) and isinstance(expected, str) and hmac.compare_digest(got, expected)
        if verify == "hmac"
        else got == expected
    )
    if not same:
        shown = "" if verify == "hmac" else f": CRC32 {got:#010x} != trainer's {expected!r}"
        raise ChecksumMismatchError(f"{where}{shown} (verify={verify!r}: the bytes changed on the way)")


def _host_bytes(t: torch.Tensor) -> memoryview:
    host = t.detach().cpu() if t.device.type != "cpu" else t.detach()
    return memoryview(host.contiguous().numpy().data).cast("B")


def wire_description(metas: Sequence[TensorMeta], wire: WireArgs) -> dict[str, Any]:
    """What every rank must agree on, as JSON-able data: the wire arguments and per tensor
    ``[name, dtype_name, shape, nbytes]`` (the trainer's nbytes come from its real tensors)."""
    return {
        "format": WIRE_FORMAT,
        "layout": wire.layout,
        "packed": wire.packed,
        "packed_buffer_size_bytes": wire.packed_buffer_size_bytes,
        "packed_num_buffers": wire.packed_num_buffers,
        "verify": wire.verify,
        "tensors": [[m.name, m.dtype_name, list(m.shape), m.nbytes] for m in metas],
    }


def wire_digest(desc: dict[str, Any]) -> str:
    """SHA-256 hex digest of a :func:`wire_description` (canonical JSON)."""
    return hashlib.sha256(json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def first_difference(ref: dict[str, Any], other: dict[str, Any]) -> str:
    """Human description of the first entry where two wire descriptions differ (ref = the trainer's)."""
    for key in ("format", "layout", "packed", "packed_buffer_size_bytes", "packed_num_buffers", "verify"):
        if ref.get(key) != other.get(key):
            return f"{key}: {ref.get(key)!r} vs {other.get(key)!r}"
    a, b = ref.get("tensors", []), other.get("tensors", [])
    fields = ("names", "dtype_names", "shapes", "nbytes")
    for i, (ta, tb) in enumerate(zip(a, b, strict=False)):
        for f, va, vb in zip(fields, ta, tb, strict=True):
            if va != vb:
                return f"tensor {i} ({ta[0]!r}) {f}: {va!r} vs {vb!r}"
    if len(a) != len(b):
        i = min(len(a), len(b))
        extra = (a if len(a) > len(b) else b)[i][0]
        return f"tensor count: {len(a)} vs {len(b)} (first unmatched: entry {i}, {extra!r})"
    return "no difference"


__all__ = [
    "ALIGN",
    "LAYOUTS",
    "VERIFY_MODES",
    "WIRE_FORMAT",
    "Bucket",
    "BufferPool",
    "Tensors",
    "as_bytes",
    "bucket_digest",
    "check_bucket",
    "contiguous_run",
    "crc32",
    "first_difference",
    "flat_layout",
    "flat_views",
    "max_packed_bucket",
    "pack_bucket",
    "plan_buckets",
    "pool_cap",
    "unpack_bucket",
    "wire_description",
    "wire_digest",
]
