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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from weightsync.impl.transfer.base import SendArgs, TensorMeta, meta_of
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
    return tensors, plan_buckets([m.nbytes for m in metas], args.packed_buffer_size_bytes, args.packed)


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


__all__ = ["PHASE_WIRE", "agree", "status"]
