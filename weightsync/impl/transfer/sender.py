"""The trainer's side of a transfer group, as every transport shares it: :class:`RoundSender`.

A transport's trainer endpoint (rank 0: :class:`~weightsync.impl.transfer.broadcast.BroadcastTrainer`,
:class:`~weightsync.impl.transfer.ipc.IPCTrainer`) subclasses it and supplies how a round is counted and
how its buckets move; opening the round (deadline, wire agreement, bucket plan) and vetoing one are
:mod:`weightsync.impl.transfer.rounds`' rules, applied here once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from weightsync.impl.transfer.auth import Session
from weightsync.impl.transfer.base import InitInfo, WireArgs
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.packing import Bucket
from weightsync.impl.transfer.rounds import TensorFeed, open_send_round, open_send_stream, veto_round


class RoundSender(ABC):
    """The trainer's endpoint of a transfer group (rank 0), as every transport shares it: each round is
    opened here (``rounds`` rules 0, 1 and 4) and its buckets moved by the transport's
    :meth:`_send_buckets`.

    Args:
        init_info: the engines' ``init_info`` (a dict or an :class:`InitInfo`); the trainer is rank 0.
        default_layout: the layout when ``init_info`` names none (the engines' backend's default).

    Attributes:
        info: the parsed ``init_info`` (sizes each round's deadline).
        wire: the wire arguments every round uses unless :meth:`send` is given others.
        session: the authenticated rendezvous's session (None when the group runs without a secret),
            set by the subclass once its group is formed.

    Raises:
        ValueError: ``init_info`` does not parse (:meth:`InitInfo.parse`).
    """

    def __init__(self, init_info: Mapping[str, Any] | InitInfo, default_layout: str) -> None:
        self.info = init_info if isinstance(init_info, InitInfo) else InitInfo.parse(init_info)
        self.wire = self.info.wire(default_layout)
        self.session: Session | None = None

    @abstractmethod
    def _ensure_open(self) -> None:
        """Raise ``RuntimeError`` when the endpoint is closed."""

    @abstractmethod
    def _next_round(self) -> tuple[ControlPlane, int]:
        """Count a new round; return the group's control plane and the round's sequence number."""

    @abstractmethod
    def _send_buckets(self, seq: int, feed: TensorFeed, buckets: Sequence[Bucket], args: WireArgs) -> None:
        """Move round ``seq``'s ``buckets`` from ``feed`` (the wire agreement is done) and end the round.

        Raises:
            the trainer's own failure (``feed``'s, rule 4), or PeerFailedError / TransferTimeoutError.
        """

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], wire: WireArgs | None = None) -> None:
        """Send one update of ``(name, tensor)`` pairs, in the order of the engines' ``update_info``
        (tensors may be non-contiguous or zero-size; any dtype of
        :data:`~weightsync.impl.transfer.base.DTYPES`). The pairs are gathered first (their metadata opens
        the round); :meth:`send_stream` does not gather.

        Raises:
            ValueError: an item that is not a ``(str, Tensor)`` pair or an unsupported dtype (the engines are
                told through the wire agreement and raise WireMismatchError naming rank 0).
            the exception ``weights`` raised, itself: the engines are told at once and raise
                PeerFailedError naming rank 0 and that exception (``rounds`` rule 1).
            WireMismatchError / PeerFailedError / TransferTimeoutError: as on the engines.
            RuntimeError: the endpoint is closed.
        """
        self._ensure_open()
        args = wire or self.wire
        cp, seq = self._next_round()
        feed, buckets = open_send_round(cp, seq, weights, args, self.info)
        self._send_buckets(seq, feed, buckets, args)

    def send_stream(
        self,
        declared: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        stream: Iterable[tuple[str, torch.Tensor]],
        wire: WireArgs | None = None,
    ) -> None:
        """Send one update whose ``(name, dtype, shape)`` metadata is declared up front, pulling the
        tensors from ``stream`` bucket by bucket (``rounds`` rule 4): the stream is never materialised.

        Raises:
            ValueError: an undescribable dtype (vetoed), or the stream disagrees with ``declared``
                (every rank aborts at that bucket); otherwise as :meth:`send`.
            the exception ``stream`` raised, itself: every rank aborts at the bucket being pulled, the
                engines raising PeerFailedError naming rank 0 and that exception (``rounds`` rule 4).
        """
        self._ensure_open()
        args = wire or self.wire
        cp, seq = self._next_round()
        feed, buckets = open_send_stream(cp, seq, declared, stream, args, self.info)
        self._send_buckets(seq, feed, buckets, args)

    def reject(self, error: ValueError) -> None:
        """Veto the next round in the wire agreement (the trainer's own request was malformed), so every
        engine raises WireMismatchError naming rank 0 at once; then raise ``error`` (:func:`veto_round`)."""
        cp, seq = self._next_round()
        veto_round(cp, seq, self.info, error)


__all__ = ["RoundSender"]
