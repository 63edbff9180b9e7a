"""Per-update agreement and status exchanges shared by every transport.

Rules:

0. **Deadline.** Every wait of a round uses the round's deadline
   (:meth:`~weightsync.impl.transfer.request_info.InitInfo.round_deadline`: ``init_info['timeout_s']``,
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
   others :class:`~weightsync.spec.errors.PeerFailedError` naming it. The IPC transport exchanges it over
   the store; the broadcast transport carries the trainer's part in-band, in a header before each bucket
   (``broadcast`` rule 3), and the workers' in the end status (rule 3).
3. **End.** A last status exchange after the final bucket, so a failure while loading the last bucket is
   seen by every rank too.
4. **Streaming senders.** A trainer that declares its tensors' metadata up front (vLLM's
   ``WeightSource.metadata()``) agrees on the wire from that declaration alone and then pulls the tensors
   from its stream bucket by bucket (:class:`TensorFeed`): the stream is never materialised, and only the
   tensors of buckets being packed or on the wire are referenced. A streamed tensor that differs from its
   declaration (name, dtype or shape), a missing one or an extra one fails that bucket (or the end), so
   every rank aborts there (rule 2) instead of splitting the stream differently.

The engine workers open each round with :func:`open_receive_round` and veto one with :func:`veto_round`;
the trainer endpoints of the transports share :class:`~weightsync.impl.transfer.sender.RoundSender`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from weightsync.impl.transfer.base import (
    InitInfo,
    LocalCheck,
    TensorMeta,
    UpdateInfo,
    WireArgs,
    dtype_name,
    meta_of,
)
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


def veto_round(cp: ControlPlane, seq: int, init: InitInfo, error: BaseException) -> NoReturn:
    """Rule 1, vetoing side, for round ``seq`` (already counted by the caller): size the round's deadline
    with no payload known, post ``error`` as this rank's veto, then raise ``error``.

    Raises:
        ``error`` itself, once the wire agreement took it (every peer raises WireMismatchError naming this
            rank); TransferTimeoutError / PeerFailedError: as :func:`agree`, if the agreement itself failed.
    """
    cp.set_deadline(*init.round_deadline(None))
    agree(cp, seq, None, f"{type(error).__name__}: {error}")
    raise error


def plan_round(metas: Sequence[TensorMeta], wire: WireArgs) -> tuple[Bucket, ...]:
    """The bucket plan of a round moving ``metas`` in order under ``wire`` (the same on every rank)."""
    return plan_buckets([m.nbytes for m in metas], wire.packed_buffer_size_bytes, wire.packed, wire.layout)


def _agree_on_send(
    cp: ControlPlane,
    seq: int,
    init: InitInfo,
    metas: Sequence[TensorMeta],
    wire: WireArgs,
    veto: str | None,
) -> tuple[Bucket, ...]:
    """Trainer side of rules 0 and 1 once the round's tensors are described (``veto``: why they cannot
    be): size the deadline, agree, plan.

    Raises:
        ValueError: ``send_weights: <veto>``, after the consumers were told.
        WireMismatchError / TransferTimeoutError: as :func:`agree`.
    """
    cp.set_deadline(*init.round_deadline(sum(m.nbytes for m in metas) if veto is None else None))
    agree(cp, seq, wire_description(metas, wire) if veto is None else None, veto)
    if veto is not None:
        raise ValueError(f"send_weights: {veto}")
    return plan_round(metas, wire)


def open_receive_round(
    cp: ControlPlane,
    seq: int,
    init: InitInfo,
    update_info: UpdateInfo,
    wire: WireArgs,
    local_check: LocalCheck | None,
) -> tuple[list[TensorMeta], tuple[Bucket, ...]]:
    """Engine side of rules 0 and 1 for round ``seq`` (already counted by the caller): size the round's
    deadline from ``update_info``'s bytes, run ``local_check`` (a ``ValueError`` from it is this rank's
    veto), agree on the wire, then plan the buckets.

    Returns:
        (the round's tensor metadata in order, the bucket plan).

    Raises:
        ValueError: ``local_check``'s own, after the agreement told every peer (no payload moved).
        WireMismatchError / PeerFailedError / TransferTimeoutError: as :func:`agree`.
    """
    metas = update_info.metas()
    cp.set_deadline(*init.round_deadline(sum(m.nbytes for m in metas)))
    veto: BaseException | None = None
    if local_check is not None:
        try:
            local_check(update_info)
        except ValueError as exc:
            veto = exc
    agree(cp, seq, None if veto else wire_description(metas, wire), None if veto is None else f"{veto}")
    if veto is not None:
        raise veto
    return metas, plan_round(metas, wire)


def pair_problem(i: int, item: Any) -> str | None:
    """Why weight ``i`` is not a ``(non-empty str name, torch.Tensor)`` pair, or None."""
    if (
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and item[0]
        and isinstance(item[1], torch.Tensor)
    ):
        return None
    shown = (
        type(item).__name__
        if not isinstance(item, tuple | list)
        else f"{type(item).__name__} of " + (", ".join(type(x).__name__ for x in item))
    )
    return f"weight {i} is not a (non-empty str name, torch.Tensor) pair: got {shown}"


def _describe(items: Sequence[Any]) -> tuple[list[TensorMeta], str | None]:
    metas: list[TensorMeta] = []
    for i, item in enumerate(items):
        problem = pair_problem(i, item)
        if problem is not None:
            return [], problem
        try:
            metas.append(meta_of(item[0], item[1]))
        except ValueError as exc:
            return [], str(exc)
    return metas, None


def open_send_round(
    cp: ControlPlane,
    seq: int,
    items: Iterable[tuple[str, torch.Tensor]],
    wire: WireArgs,
    init: InitInfo,
) -> tuple[TensorFeed, tuple[Bucket, ...]]:
    """Trainer side of rules 0 and 1 for round ``seq``: read ``items`` (all of them: their metadata opens
    the round; :func:`open_send_stream` does not gather), size the round's deadline, describe
    the tensors, agree on the wire with every consumer (a tensor the trainer cannot describe is vetoed, so
    every consumer is told), then plan the buckets.

    Returns:
        (a :class:`TensorFeed` holding the detached tensors in ``items`` order, the bucket plan).

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
        fail_round(cp, seq, iterator_failure(exc, len(pairs)))
        raise
    metas, veto = _describe(pairs)
    buckets = _agree_on_send(cp, seq, init, metas, wire, veto)
    return TensorFeed(metas, tensors=[t.detach() for _, t in pairs]), buckets


def iterator_failure(exc: BaseException, taken: int) -> str:
    """How the peers are told that the trainer's weight iterator raised ``exc`` after ``taken`` tensors
    (rules 1 and 4)."""
    return f"the trainer's weight iterator raised {type(exc).__name__}: {exc} after {taken} tensor(s)"


class TensorFeed:
    """The trainer's tensors of one round in order: all at hand (a list) or pulled from a stream (rule 4).

    Args:
        metas: what the round declared, in order.
        tensors: the tensors, when the caller already holds them all (random access).
        stream: ``(name, tensor)`` pairs to pull from in order, when it does not.

    Attributes:
        source_error: the exception the stream itself raised (re-raised by :meth:`take`, as is), or None.
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
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None
        self.source_error: BaseException | None = None
        self._source_text = ""
        self._next = 0
        if stream is not None:
            try:
                self._it = iter(stream)
            except BaseException as exc:  # not iterable, or iter() itself raised: the first pull fails
                self._fail_source(exc)
                self._it = iter(())

    def _fail_source(self, exc: BaseException) -> None:
        self.source_error = exc
        self._source_text = iterator_failure(exc, self._next)

    def describe(self, error: BaseException | None) -> str | None:
        """The text the peers get for this rank's ``error`` (rule 2): the iterator's own failure names the
        trainer's exception and how many tensors it had yielded (as rule 1's)."""
        if error is None:
            return None
        if error is self.source_error:
            return self._source_text
        return f"{type(error).__name__}: {error}"

    def take(self, members: Sequence[int]) -> dict[int, torch.Tensor]:
        """The tensors of ``members`` (consecutive, in order, each taken once when streaming), detached.

        Raises:
            the stream's own exception, as is, if pulling from it raised (:attr:`source_error`; every
                later call raises it again).
            ValueError: a streamed item is not a ``(str, Tensor)`` pair or differs from its declaration,
                or the stream ended early.
        """
        if self.at_hand is not None:
            return {i: self.at_hand[i] for i in members}
        if self.source_error is not None:
            raise self.source_error
        assert self._it is not None
        out: dict[int, torch.Tensor] = {}
        for i in members:
            if i != self._next:
                raise ValueError(f"tensor {i} requested out of order (next is {self._next})")
            m = self.metas[i]
            try:
                item = next(self._it)
            except StopIteration:
                raise ValueError(
                    f"the weight stream ended after {i} tensors; {len(self.metas)} were declared "
                    f"(first missing: {m.name!r})"
                ) from None
            except BaseException as exc:  # the trainer's own failure: every rank aborts at this bucket
                self._fail_source(exc)
                raise
            problem = pair_problem(i, item)
            if problem is not None:
                raise ValueError(f"the weight stream: {problem}")
            name, t = item
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
            the stream's own exception, as is, if pulling the end from it raised (:attr:`source_error`).
            ValueError: it yields more (naming the first extra) or fewer tensors than declared.
        """
        if self._it is None:
            return
        if self.source_error is not None:
            raise self.source_error
        if self._next != len(self.metas):
            raise ValueError(f"only {self._next} of {len(self.metas)} declared tensors were taken")
        try:
            extra = next(self._it, None)
        except BaseException as exc:
            self._fail_source(exc)
            raise
        if extra is not None:
            shown = extra[0] if isinstance(extra, tuple | list) and extra else extra
            raise ValueError(
                f"the weight stream yields more tensors than the {len(self.metas)} declared; "
                f"first extra is {shown!r}"
            )

    def finish_error(self) -> BaseException | None:
        """:meth:`finish`, returning the error that fails the round on every rank (rules 3 and 4: a
        ``ValueError``, or the stream's own exception) instead of raising it; None when the feed is sound.

        Raises:
            any other exception :meth:`finish` raised, as is.
        """
        try:
            self.finish()
        except BaseException as exc:
            if not isinstance(exc, ValueError) and exc is not self.source_error:
                raise
            return exc
        return None


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
    wire: WireArgs,
    init: InitInfo,
) -> tuple[TensorFeed, tuple[Bucket, ...]]:
    """Trainer side of rules 0 and 1 from declared ``(name, dtype, shape)`` metadata (rule 4): size the
    round's deadline from the declared bytes, agree on the wire (an undescribable dtype is vetoed, so every
    consumer is told), then plan the buckets. Nothing is pulled from ``stream`` here.

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
    buckets = _agree_on_send(cp, seq, init, metas, wire, veto)
    return TensorFeed(metas, stream=stream), buckets


def status(
    cp: ControlPlane,
    seq: int,
    key: str,
    error: BaseException | None,
    phase: str,
    crc: int | str | None = None,
    detail: str | None = None,
) -> list[dict[str, Any]]:
    """Rules 2 and 3: post this rank's status for ``key`` and collect everyone's (rank order). ``detail``
    replaces ``"<type>: <error>"`` as the text the peers get for ``error`` (e.g.
    :meth:`TensorFeed.describe`).

    Raises:
        the local ``error`` itself if this rank failed; PeerFailedError naming the failed ranks if a peer
        failed; TransferTimeoutError if some rank never posted.
    """
    mine = {
        "ok": error is None,
        "error": None if error is None else (detail or f"{type(error).__name__}: {error}"),
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


__all__ = [
    "PHASE_WIRE",
    "TensorFeed",
    "agree",
    "fail_round",
    "open_receive_round",
    "open_send_round",
    "open_send_stream",
    "plan_round",
    "status",
    "veto_round",
]
