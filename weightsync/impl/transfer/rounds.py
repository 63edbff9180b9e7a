"""Per-update agreement and status exchanges shared by every transport.

Rules:

0. **Deadline.** Every wait of a round uses the round's deadline
   (:meth:`~weightsync.impl.transfer.base.RendezvousInitInfo.round_deadline`: ``init_info['timeout_s']``,
   or sized to the round's bytes), and a timeout error says how it was sized.
1. **Wire agreement.** At the start of every update each rank posts the SHA-256 digest of its wire
   description (names, dtypes, shapes, per-tensor byte counts, ``packed``, ``B``, ``num_buffers``,
   ``verify``) or a veto (its local request was malformed). If any rank vetoed, or any digest differs from
   the trainer's, *every* rank raises before any payload moves: the vetoing rank its own ``ValueError``,
   the others :class:`~weightsync.spec.errors.WireMismatchError` naming the rank and the first differing
   entry (huggingface/trl PR #7104 and SkyRL PR #2114 hung silently instead; scenario B5).
   A trainer whose weight iterator raises posts a *failure* instead: every engine raises
   :class:`~weightsync.spec.errors.PeerFailedError` naming rank 0 and the trainer's exception at once
   (instead of waiting out its deadline), and the trainer re-raises its own exception.
2. **Bucket status.** Before each bucket moves, every rank posts ``ok`` or its error (checkpoint-engine's
   per-bucket error all-reduce); the trainer's status also carries the bucket's CRC32 when ``verify``. One
   failure makes every rank abort at the same bucket: the failing rank raises its own exception, the
   others :class:`~weightsync.spec.errors.PeerFailedError` naming it.
3. **End.** A last status exchange after the final bucket, so a failure while loading the last bucket is
   seen by every rank too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from weightsync.impl.transfer.base import RendezvousInitInfo, SendArgs, TensorMeta, meta_of
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
        PeerFailedError: a peer (the trainer) posted a failure (:func:`fail_round`), naming it and its error.
        WireMismatchError: a peer vetoed, or some rank's description differs from rank 0's.
        TransferTimeoutError: some rank never posted (phase ``update_weights/wire_agreement``).
    """
    cp.cleanup(seq - 1)
    mine = {"digest": wire_digest(desc) if desc is not None else None, "veto": veto}
    vals = cp.exchange(f"r{seq}/wire", mine, seq, PHASE_WIRE)
    failed = [(r, v.get("failed")) for r, v in enumerate(vals) if v.get("failed")]
    if failed:
        cp.settle(f"r{seq}/wire")
        raise PeerFailedError(
            [r for r, _ in failed],
            f"{PHASE_WIRE} (round {seq})",
            "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            + "; no payload was sent and every rank aborts this update",
        )
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


def fail_round(cp: ControlPlane, seq: int, reason: str) -> None:
    """Rule 1, failing side: post ``reason`` as this rank's agreement value for round ``seq`` so every peer
    raises :class:`~weightsync.spec.errors.PeerFailedError` at once; rank 0 then waits (at most
    ``min(5 s, deadline)``) until the peers read it. Never raises (the caller re-raises its own error)."""
    with contextlib.suppress(Exception):
        cp.cleanup(seq - 1)
        cp.post(f"r{seq}/wire", {"digest": None, "veto": None, "failed": reason}, seq)
        cp.settle(f"r{seq}/wire")


def _describe(items: Sequence[Any]) -> tuple[list[TensorMeta], str | None]:
    metas: list[TensorMeta] = []
    for i, item in enumerate(items):
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and item[0]
            and isinstance(item[1], torch.Tensor)
        ):
            shown = (
                type(item).__name__
                if not isinstance(item, tuple | list)
                else f"{type(item).__name__} of " + (", ".join(type(x).__name__ for x in item))
            )
            return [], f"weight {i} is not a (non-empty str name, torch.Tensor) pair: got {shown}"
        try:
            metas.append(meta_of(item[0], item[1]))
        except ValueError as exc:
            return [], str(exc)
    return metas, None


def open_send_round(
    cp: ControlPlane,
    seq: int,
    items: Iterable[tuple[str, torch.Tensor]],
    args: SendArgs,
    init: RendezvousInitInfo,
) -> tuple[list[torch.Tensor], tuple[Bucket, ...]]:
    """Trainer side of rules 0 and 1 for round ``seq``: read ``items``, size the round's deadline, describe
    the tensors, agree on the wire with every consumer (a tensor the trainer cannot describe is vetoed, so
    every consumer is told), then plan the buckets.

    Returns:
        (detached tensors in ``items`` order, the bucket plan).

    Raises:
        the exception of ``items`` itself (the same object) if iterating it raised, after telling every
            consumer (:func:`fail_round`; they raise PeerFailedError naming it).
        ValueError: the trainer vetoed (an item that is not a ``(str, Tensor)`` pair, an unsupported
            dtype), after the consumers were told.
        WireMismatchError / TransferTimeoutError: as :func:`agree`.
    """
    pairs: list[Any] = []
    try:
        for item in items:
            pairs.append(item)
    except BaseException as exc:
        cp.set_deadline(*init.round_deadline(None))
        fail_round(
            cp,
            seq,
            f"the trainer's weight iterator raised {type(exc).__name__}: {exc} after {len(pairs)} tensor(s)",
        )
        raise
    metas, veto = _describe(pairs)
    cp.set_deadline(*init.round_deadline(sum(m.nbytes for m in metas) if veto is None else None))
    info = args.update_info(metas)
    agree(cp, seq, wire_description(info) if veto is None else None, veto)
    if veto is not None:
        raise ValueError(f"trainer_send_weights: {veto}")
    tensors = [t.detach() for _, t in pairs]
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


__all__ = ["PHASE_WIRE", "agree", "fail_round", "open_send_round", "status"]
