"""The in-band bucket header of the broadcast transport (``broadcast`` rules 3 and 7): what each bucket's
status exchange over the TCPStore carried, moved onto the group itself, and the abort built on it.

Before each bucket's payload the trainer broadcasts a :data:`HEADER_BYTES`-byte header: a magic, the
round, the bucket's number, whether the round is aborted at this bucket (the trainer's weight stream
raised: its message is in the store under ``r<seq>/abort``), and the bucket's digest under ``verify``
(CRC-32 or HMAC-SHA256). A worker waits for the header, checks it, and only then posts the payload's
receive, so an aborted bucket has no payload and no collective is one-sided. Layout (little-endian):

====== ====== =================================================================
offset bytes  field
====== ====== =================================================================
0      4      magic ``b"WSB2"``
4      4      flags (bit 0: abort)
8      8      round (``seq``)
16     8      bucket number
24     1      digest kind (0: none, 1: CRC-32, 2: HMAC-SHA256)
32     32     digest (CRC-32: 4 bytes; HMAC: the 32 raw bytes)
====== ====== =================================================================
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from weightsync.impl.transfer.broadcast_group import BroadcastGroup, drain
from weightsync.impl.transfer.packing import Bucket
from weightsync.spec.errors import PeerFailedError, WireMismatchError

PHASE_BUCKET = "update_weights/bucket"
PHASE_BROADCAST = "update_weights/broadcast"

#: bytes of one header on the wire
HEADER_BYTES = 64
MAGIC = b"WSB2"
_FIXED = struct.Struct("<4sIQQB")
_ABORT = 1
_NONE, _CRC, _HMAC = 0, 1, 2
_DIGEST_AT = 32


class BucketHeader(NamedTuple):
    """A decoded header.

    Attributes:
        seq: the round.
        number: the bucket's number in the round.
        abort: the trainer aborted the round at this bucket (no payload follows).
        digest: the bucket's digest as :func:`~weightsync.impl.transfer.packing.bucket_digest` returns it
            (None, a CRC-32 int, or an HMAC-SHA256 hex string).
    """

    seq: int
    number: int
    abort: bool
    digest: int | str | None


def encode_header(
    seq: int, number: int, digest: int | str | None, abort: bool, device: torch.device
) -> torch.Tensor:
    """The header of bucket ``number`` of round ``seq`` as a uint8 tensor of :data:`HEADER_BYTES` on
    ``device``.

    Raises:
        ValueError: ``digest`` is a string that is not 64 hex digits (an HMAC-SHA256).
    """
    raw = bytearray(HEADER_BYTES)
    if digest is None:
        kind, body = _NONE, b""
    elif isinstance(digest, str):
        body = bytes.fromhex(digest)
        if len(body) != 32:
            raise ValueError(f"bucket header: an HMAC-SHA256 digest is 32 bytes, got {len(body)}")
        kind = _HMAC
    else:
        kind, body = _CRC, struct.pack("<I", digest & 0xFFFFFFFF)
    _FIXED.pack_into(raw, 0, MAGIC, _ABORT if abort else 0, seq, number, kind)
    raw[_DIGEST_AT : _DIGEST_AT + len(body)] = body
    t = torch.frombuffer(raw, dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device)


def empty_header(device: torch.device) -> torch.Tensor:
    """A receive buffer for one header."""
    return torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)


def decode_header(t: torch.Tensor, seq: int, number: int, where: str) -> BucketHeader:
    """Decode a received header and check that it is bucket ``number`` of round ``seq``.

    Raises:
        WireMismatchError: the magic, the round or the bucket number differ (a peer on another wire
            format, or the ranks' collectives out of step), naming rank 0 and ``where``.
    """
    raw = bytes(t.cpu().tolist())
    magic, flags, got_seq, got_number, kind = _FIXED.unpack_from(raw, 0)
    if magic != MAGIC or got_seq != seq or got_number != number:
        raise WireMismatchError(
            f"{where}: from rank 0, expected the header of bucket {number} of round {seq} ({MAGIC!r}), got "
            f"{magic!r} round {got_seq} bucket {got_number}",
        )
    body = raw[_DIGEST_AT:]
    digest: int | str | None
    if kind == _CRC:
        digest = int(struct.unpack_from("<I", body, 0)[0])
    elif kind == _HMAC:
        digest = body[:32].hex()
    else:
        digest = None
    return BucketHeader(got_seq, got_number, bool(flags & _ABORT), digest)


#: buckets a worker posts beyond the one whose header it checks, with two slots or more (``broadcast`` rule 3)
LOOKAHEAD = 1


def lookahead(num_buffers: int) -> int:
    """Buckets a worker has posted beyond the one whose header it checks (``broadcast`` rule 3): :data:`LOOKAHEAD`, or 0
    with one slot (bucket ``k`` is then checked and loaded before bucket ``k+1`` may use its slot). The
    trainer aborts as many buckets after the failing one, so no collective is left one-sided."""
    return min(LOOKAHEAD, num_buffers - 1)


def abort_round(
    group: BroadcastGroup,
    seq: int,
    buckets: Sequence[Bucket],
    ahead: int,
    k: int,
    error: BaseException,
    detail: str | None,
    inflight: dict[int, tuple[list[Any], list[torch.Tensor]]],
) -> NoReturn:
    """``broadcast`` rule 7: the trainer's weight stream raised at bucket ``k``: its message to the store, abort headers
    for bucket ``k`` and the ``ahead`` after it (a worker has posted exactly those when it checks bucket
    ``k``'s header: :func:`lookahead`, ``broadcast`` rule 3), each with a payload of its size that nobody loads, the broadcasts in flight
    completed, then ``error`` re-raised. Every worker raises PeerFailedError naming rank 0 and ``detail``
    at bucket ``k``."""
    text = detail or f"{type(error).__name__}: {error}"
    key = f"r{seq}/abort"
    group.cp.post(key, {"error": text}, seq, PHASE_BUCKET)
    for j in range(k, min(k + 1 + ahead, len(buckets))):
        head = encode_header(seq, j, None, True, group.device)
        works, bufs = [group.broadcast(head)], [head]
        if buckets[j].nbytes:
            bufs.append(torch.empty(buckets[j].nbytes, dtype=torch.uint8, device=group.device))
            works.append(group.broadcast(bufs[-1]))
        inflight[j] = (works, bufs)
    for j in sorted(inflight):
        for w in inflight.pop(j)[0]:
            group.wait(w, PHASE_BROADCAST)
    group.cp.settle(key)
    raise error


def raise_aborted(g: BroadcastGroup, seq: int, k: int, works: list[Any]) -> NoReturn:
    """``broadcast`` rule 7, worker side: the trainer aborted round ``seq`` at bucket ``k``; read its message, let it
    close the store, and fail naming rank 0 and the trainer's error.

    Raises:
        PeerFailedError: always.
    """
    drain(g, works)
    key = f"r{seq}/abort"
    detail = g.cp.get(key, PHASE_BUCKET, 0).get("error")
    g.cp.settle(key)
    raise PeerFailedError(
        [0], f"{PHASE_BUCKET} (round {seq}, b{k})", f"rank 0: {detail}; every rank aborts this update"
    )


__all__ = [
    "HEADER_BYTES",
    "LOOKAHEAD",
    "MAGIC",
    "PHASE_BROADCAST",
    "PHASE_BUCKET",
    "BucketHeader",
    "abort_round",
    "decode_header",
    "empty_header",
    "encode_header",
    "lookahead",
    "raise_aborted",
]
