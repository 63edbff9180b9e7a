"""Per-update agreement and status exchanges shared by every transport.

Rules:

1. **Wire agreement.** At the start of every update each rank posts the SHA-256 digest of its wire
   description (names, dtypes, shapes, per-tensor byte counts, ``packed``, ``B``, ``num_buffers``,
   ``verify``) or a veto (its local request was malformed). If any rank vetoed, or any digest differs from
   the trainer's, *every* rank raises before any payload moves: the vetoing rank its own ``ValueError``,
   the others :class:`~weightsync.spec.errors.WireMismatchError` naming the rank and the first differing
   entry (huggingface/trl PR #7104 and SkyRL PR #2114 hung silently instead; scenario B5).
2. **Bucket status.** Before each bucket moves, every rank posts ``ok`` or its error (checkpoint-engine's
   per-bucket error all-reduce); the trainer's status also carries the bucket's CRC32 when ``verify``. One
   failure makes every rank abort at the same bucket: the failing rank raises its own exception, the
   others :class:`~weightsync.spec.errors.PeerFailedError` naming it.
3. **End.** A last status exchange after the final bucket, so a failure while loading the last bucket is
   seen by every rank too.
4. **Streaming senders.** A trainer that declares its tensors' metadata up front (vLLM's
   ``WeightSource.metadata()``) agrees on the wire from that declaration alone and then pulls the tensors
   from its stream bucket by bucket (:class:`TensorFeed`): the stream is never materialised, and only the
   tensors of buckets being packed or on the wire are referenced. A streamed tensor that differs from its
   declaration (name, dtype or shape), a missing one or an extra one fails that bucket (or the end), so
   every rank aborts there (rule 2) instead of splitting the stream differently.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from weightsync.impl.transfer.base import SendArgs, TensorMeta, dtype_name, meta_of
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.packing import (
    Bucket,
    first_difference,
    plan_buckets,
    wire_description,
    wire_digest,
)
from weightsync.spec.errors import PeerFailedError, WireMismatchError

PHASE_WIRE = "update_weights/wire_agreement"


def agree(cp: ControlPlane, seq: int, desc: dict[str, Any] | None, veto: str | None) -> None:
    """Rule 1 for round ``seq``. ``desc`` is this rank's wire description (None with a veto).

    Returns normally only if every rank posted the trainer's digest and nobody vetoed. A rank that vetoed
    gets back control without an exception (it raises its own error); others raise.

    Raises:
        WireMismatchError: a peer vetoed, or some rank's description differs from rank 0's.
        TransferTimeoutError: some rank never posted (phase ``update_weights/wire_agreement``).
    """
    cp.cleanup(seq - 1)
    mine = {"digest": wire_digest(desc) if desc is not None else None, "veto": veto}
    vals = cp.exchange(f"r{seq}/wire", mine, seq, PHASE_WIRE)
    vetoes = [(r, v.get("veto")) for r, v in enumerate(vals) if v.get("veto")]
    if vetoes:
        cp.settle(f"r{seq}/wire")
        if veto is not None:
            return
        shown = "; ".join(f"rank {r}: {msg}" for r, msg in vetoes)
        raise WireMismatchError(
            f"{PHASE_WIRE} (round {seq}): rank(s) {', '.join(str(r) for r, _ in vetoes)} rejected the update "
            f"before any payload moved: {shown}"
        )
    ref = vals[0].get("digest")
    bad = [r for r, v in enumerate(vals) if v.get("digest") != ref]
    if not bad:
        return
    cp.post(f"r{seq}/wiredesc", desc, seq)
    ref_desc = cp.get(f"r{seq}/wiredesc", PHASE_WIRE, 0)
    parts = []
    for r in bad:
        other = cp.get(f"r{seq}/wiredesc", PHASE_WIRE, r)
        parts.append(f"rank {r} differs from rank 0 (trainer) at {first_difference(ref_desc, other)}")
    cp.settle(f"r{seq}/wire")
    raise WireMismatchError(
        f"{PHASE_WIRE} (round {seq}): "
        + "; ".join(parts)
        + " (rank 0's value first); trainer and engines must "
        "agree on names, dtypes, shapes, packed, packed_buffer_size_bytes and packed_num_buffers "
        "(huggingface/trl PR #7104); no payload was sent"
    )


def open_send_round(
    cp: ControlPlane, seq: int, items: Sequence[tuple[str, torch.Tensor]], args: SendArgs
) -> tuple[list[torch.Tensor], tuple[Bucket, ...]]:
    """Trainer side of rule 1 for round ``seq``: describe ``items``, agree on the wire with every consumer
    (a tensor the trainer cannot describe is vetoed, so every consumer is told), then plan the buckets.

    Returns:
        (detached tensors in ``items`` order, the bucket plan).

    Raises:
        ValueError: the trainer vetoed (e.g. an unsupported dtype), after the consumers were told.
        WireMismatchError / TransferTimeoutError: as :func:`agree`.
    """
    veto: str | None = None
    metas: list[TensorMeta] = []
    try:
        metas = [meta_of(n, t) for n, t in items]
    except ValueError as exc:
        veto = str(exc)
    info = args.update_info(metas)
    agree(cp, seq, wire_description(info) if veto is None else None, veto)
    if veto is not None:
        raise ValueError(f"trainer_send_weights: {veto}")
    tensors = [t.detach() for _, t in items]
    return tensors, plan_buckets(
        [m.nbytes for m in metas], args.packed_buffer_size_bytes, args.packed, args.layout
    )


class TensorFeed:
    """The trainer's tensors of one round in order: all at hand (a list) or pulled from a stream (rule 4).

    Args:
        metas: what the round declared, in order.
        tensors: the tensors, when the caller already holds them all (random access).
        stream: ``(name, tensor)`` pairs to pull from in order, when it does not.
    """

    def __init__(
        self,
        metas: Sequence[TensorMeta],
        tensors: Sequence[torch.Tensor] | None = None,
        stream: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        if (tensors is None) == (stream is None):
            raise ValueError("TensorFeed needs exactly one of tensors and stream")
        self.metas = metas
        self.at_hand: list[torch.Tensor] | None = None if tensors is None else list(tensors)
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None if stream is None else iter(stream)
        self._next = 0

    def take(self, members: Sequence[int]) -> dict[int, torch.Tensor]:
        """The tensors of ``members`` (consecutive, in order, each taken once when streaming), detached.

        Raises:
            ValueError: a streamed tensor differs from its declaration, or the stream ended early.
        """
        if self.at_hand is not None:
            return {i: self.at_hand[i] for i in members}
        assert self._it is not None
        out: dict[int, torch.Tensor] = {}
        for i in members:
            if i != self._next:
                raise ValueError(f"tensor {i} requested out of order (next is {self._next})")
            m = self.metas[i]
            try:
                name, t = next(self._it)
            except StopIteration:
                raise ValueError(
                    f"the weight stream ended after {i} tensors; {len(self.metas)} were declared "
                    f"(first missing: {m.name!r})"
                ) from None
            got = (name, _dtype_text(t.dtype), tuple(int(d) for d in t.shape))
            if got != (m.name, m.dtype_name, m.shape):
                raise ValueError(
                    f"the weight stream disagrees with its declared metadata at index {i}: declared "
                    f"{m.name!r} {m.dtype_name} {list(m.shape)}, got {got[0]!r} {got[1]} {list(got[2])}; "
                    "both must enumerate the same tensors in the same order"
                )
            out[i] = t.detach()
            self._next += 1
        return out

    def finish(self) -> None:
        """Check that a stream is exhausted after the last declared tensor.

        Raises:
            ValueError: it yields more (naming the first extra) or fewer tensors than declared.
        """
        if self._it is None:
            return
        if self._next != len(self.metas):
            raise ValueError(f"only {self._next} of {len(self.metas)} declared tensors were taken")
        extra = next(self._it, None)
        if extra is not None:
            raise ValueError(
                f"the weight stream yields more tensors than the {len(self.metas)} declared; "
                f"first extra is {extra[0]!r}"
            )


def _dtype_text(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def open_send_stream(
    cp: ControlPlane,
    seq: int,
    declared: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    stream: Iterable[tuple[str, torch.Tensor]],
    args: SendArgs,
) -> tuple[TensorFeed, tuple[Bucket, ...]]:
    """Trainer side of rule 1 from declared ``(name, dtype, shape)`` metadata (rule 4): agree on the wire
    (an undescribable dtype is vetoed, so every consumer is told), then plan the buckets.

    Returns:
        (a :class:`TensorFeed` over ``stream``, the bucket plan).

    Raises:
        ValueError: the trainer vetoed, after the consumers were told.
        WireMismatchError / TransferTimeoutError: as :func:`agree`.
    """
    veto: str | None = None
    metas: list[TensorMeta] = []
    try:
        metas = [TensorMeta(n, dtype_name(d), tuple(int(x) for x in s)) for n, d, s in declared]
    except ValueError as exc:
        veto = str(exc)
    info = args.update_info(metas)
    agree(cp, seq, wire_description(info) if veto is None else None, veto)
    if veto is not None:
        raise ValueError(f"trainer_send_weights: {veto}")
    sizes = [m.nbytes for m in metas]
    return TensorFeed(metas, stream=stream), plan_buckets(
        sizes, args.packed_buffer_size_bytes, args.packed, args.layout
    )


def status(
    cp: ControlPlane, seq: int, key: str, error: BaseException | None, phase: str, crc: int | None = None
) -> list[dict[str, Any]]:
    """Rules 2 and 3: post this rank's status for ``key`` and collect everyone's (rank order).

    Raises:
        the local ``error`` itself if this rank failed; PeerFailedError naming the failed ranks if a peer
        failed; TransferTimeoutError if some rank never posted.
    """
    mine = {
        "ok": error is None,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "crc": crc,
    }
    vals = cp.exchange(f"r{seq}/{key}", mine, seq, phase)
    failed = [r for r, v in enumerate(vals) if not v.get("ok")]
    if failed:
        cp.settle(f"r{seq}/{key}")
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {vals[r].get('error')}" for r in failed)
        raise PeerFailedError(
            failed, f"{phase} (round {seq}, {key})", detail + "; every rank aborts this update"
        )
    return vals


__all__ = ["PHASE_WIRE", "TensorFeed", "agree", "open_send_round", "open_send_stream", "status"]
