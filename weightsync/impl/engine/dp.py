"""The DP group of the engine ranks: a stateless gloo group with timeouts, plus a status board.

- The group is its own ``ProcessGroupGloo`` over a ``TCPStore`` hosted by DP rank 0 (like vLLM's stateless
  DP group); it never touches torch.distributed's default group, so the weight-transfer group can coexist.
- The store is opened as the transfer group's is (:mod:`weightsync.impl.transfer.rendezvous`): rank 0
  listens on ``host``'s interface only, the same policy applies (without the deployment's secret only a
  loopback ``host``, unless ``allow_unauthenticated``), and with a secret every rank is admitted by the
  authenticated handshake first; the group and the board then live under the session's namespace.
- Every DP collective (``dp_step``, ``dp_sync``, ``resume_barrier``) is one all-gather of a fixed-size
  int64 row ``[kind, seq, a, b]`` per rank. Each rank checks that every row names the same (kind, seq)
  (a mismatch raises :class:`~weightsync.spec.errors.RemoteProtocolError` naming every rank's collective)
  and reduces ``a, b`` locally by the spec's reduction (:mod:`weightsync.spec.collectives`).
- Before entering, a rank posts ``"kind#seq"`` to the store (the status board). When the gloo timeout
  fires, the rank reads the board and raises :class:`~weightsync.spec.errors.TransferTimeoutError` whose
  ``missing_ranks`` are the ranks not posted at the same (kind, seq) and whose detail lists what each
  rank was blocked in.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any

import torch
import torch.distributed as _dist_mod

from weightsync.impl.transfer.broadcast_group import gloo_devices
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.rendezvous import authenticate, check_policy, host_store
from weightsync.impl.transfer.secret import error_line, load_secret
from weightsync.spec.collectives import reduce_values
from weightsync.spec.errors import RemoteProtocolError, TransferTimeoutError
from weightsync.spec.states import Collective

dist: Any = _dist_mod  # the c10d classes (TCPStore, ProcessGroupGloo) are not in torch's public stubs

KIND_CODE: dict[str, int] = {
    Collective.DP_STEP.value: 1,
    Collective.DP_SYNC.value: 2,
    Collective.RESUME_BARRIER.value: 3,
}
_CODE_KIND = {v: k for k, v in KIND_CODE.items()}
#: Deadline of each store read of :meth:`DPGroup.board` (a diagnostic after a timeout), seconds.
BOARD_READ_S = 2.0


class DPGroup:
    """A DP group of ``size`` engine ranks over gloo on ``host:port``.

    Args:
        rank: this DP rank.
        size: number of DP ranks.
        host: address of the TCPStore (hosted by rank 0).
        port: its port.
        timeout_s: deadline of every collective and of the rendezvous, seconds.
        allow_unauthenticated: accept a non-loopback ``host`` without the deployment's secret.

    Raises:
        ValueError: the policy refused ``host`` (before any socket opens).
        AuthenticationError: the handshake refused this rank or the store it reached.
        TransferTimeoutError: the rendezvous did not complete within ``timeout_s`` (phase ``dp_group/init``,
            naming rank 0 on the others and the others on rank 0; the store keys in torch's text are
            redacted, :func:`~weightsync.impl.transfer.secret.redact_namespace`).
        PortInUseError: rank 0 and ``port`` is taken on ``host``.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        host: str,
        port: int,
        timeout_s: float,
        allow_unauthenticated: bool = False,
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        td = datetime.timedelta(seconds=timeout_s)
        t0 = time.monotonic()
        secret = load_secret()
        check_policy(host, secret, allow_unauthenticated)
        # rank 0 waits for every other rank to reach its store, the others for rank 0's store
        peers = list(range(1, size)) if rank == 0 else [0]
        try:
            if rank == 0:
                self.raw_store = host_store(host, port, timeout_s, size, wait_for_workers=True)
            else:
                self.raw_store = dist.TCPStore(host, port, size, False, timeout=td, wait_for_workers=True)
        except dist.DistError as exc:  # rendezvous failure (timeout or refused); PortInUseError passes
            raise TransferTimeoutError(
                "dp_group/init", peers, time.monotonic() - t0, _first_line(exc)
            ) from None
        session = authenticate(self.raw_store, rank, size, timeout_s, secret, "dp_group/init")
        self.store = session.scoped(self.raw_store) if session is not None else self.raw_store
        #: bounds the board's store reads on ranks other than 0 (``control`` rule 5)
        self.cp = ControlPlane(self.store, rank, size, timeout_s)
        gloo: Any = dist.ProcessGroupGloo
        opts = gloo._Options()
        opts._timeout = td
        # gloo listens on the interface towards ``host`` (``broadcast_group.gloo_device_choice``), not on
        # gloo's default (the address the hostname resolves to, which may be another interface)
        opts._devices = gloo_devices(host, rank)
        try:
            self.pg = gloo(dist.PrefixStore("dp", self.store), rank, size, opts)
        except RuntimeError as exc:  # DistError (a peer did not publish its address in time) or gloo's own
            raise TransferTimeoutError(
                "dp_group/init",
                [r for r in range(size) if r != rank],
                time.monotonic() - t0,
                _first_line(exc),
            ) from None
        self.current = ""

    def board(self) -> dict[int, str]:
        """What every rank last posted as its current collective (``"kind#seq"``, or ``"?"`` if unknown).

        Each store read is bounded by :data:`BOARD_READ_S` (``control`` rule 5: on a rank other than 0 a
        read from a store whose host vanished would otherwise block until TCP gives up); once one read
        misses its deadline, the ranks not read yet are ``"?"``. This rank's own entry is what it posted.
        """
        out: dict[int, str] = {}
        for r in range(self.size):
            if r == self.rank:
                out[r] = self.current or "?"
                continue
            key = f"at/{r}"
            try:
                posted = self.cp.call("board", BOARD_READ_S, self.store.check, [key])
                out[r] = (
                    self.cp.call("board", BOARD_READ_S, self.store.get, key)[:64].decode() if posted else "?"
                )
            except TransferTimeoutError:
                out.update({q: "?" for q in range(r, self.size) if q != self.rank})
                break
            except Exception:
                out[r] = "?"
        return out

    def post(self, what: str) -> None:
        """Post this rank's current activity (a collective ``kind#seq``, or ``"idle"``) on the board."""
        self.current = what
        self.store.set(f"at/{self.rank}", what)

    def collective(self, kind: str, seq: int, a: int, b: int) -> tuple[int, ...]:
        """Join DP collective ``kind`` number ``seq`` with values (a, b); returns them reduced by the spec's
        reduction (:data:`weightsync.spec.collectives.COLLECTIVES`: SUM for ``dp_sync``, MAX for
        ``resume_barrier``; ``()`` for ``dp_step``, which has no outcome).

        Raises:
            TransferTimeoutError: not every rank joined within ``timeout_s`` (phase ``"kind#seq"``).
            RemoteProtocolError: the ranks joined different collectives (kinds or sequence numbers differ).
        """
        tag = f"{kind}#{seq}"
        self.post(tag)
        row = torch.tensor([KIND_CODE[kind], seq, a, b], dtype=torch.int64)
        out = [torch.zeros(4, dtype=torch.int64) for _ in range(self.size)]
        t0 = time.monotonic()
        try:
            self.pg.allgather([out], [row]).wait()
        except Exception as exc:
            waited = time.monotonic() - t0
            board = self.board()
            missing = [r for r, w in board.items() if w != tag]
            detail = "; ".join(f"rank {r} in {w}" for r, w in sorted(board.items()))
            gloo_text = _first_line(exc)[:160]
            raise TransferTimeoutError(f"{tag}", missing, waited, f"{detail}; gloo: {gloo_text}") from exc
        rows = [[int(x) for x in t.tolist()] for t in out]
        if any(r[0] != rows[0][0] or r[1] != rows[0][1] for r in rows):
            desc = ", ".join(f"rank {i} in {_CODE_KIND.get(r[0], '?')}#{r[1]}" for i, r in enumerate(rows))
            raise RemoteProtocolError(f"{tag}: mismatched DP collectives: {desc}")
        self.post("idle")
        return reduce_values(kind, [r[2:] for r in rows])

    def close(self) -> None:
        """Drop the group and the board's store thread (best effort)."""
        self.cp.close()
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {error_line(exc)}"
