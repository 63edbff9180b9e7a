"""The control plane of a transfer group: TCPStore rendezvous and JSON-only exchanges.

Rules:

1. The trainer is transfer rank 0 and hosts a ``torch.distributed.TCPStore`` at
   ``master_address:master_port``; engine workers connect as clients (vLLM 0.32
   ``nccl_common.py:139-159``). The default process group is never touched.
2. Every value written to the store is UTF-8 JSON, and every value read is parsed by :func:`strict_json`
   (at most :data:`CONTROL_LIMIT_BYTES`, no NaN or Infinity): nothing received from the network is unpickled (vLLM refuses pickled IPC handles unless
   ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
3. Joining: each rank takes a ticket (``arrivals``, an atomic counter), publishes ``ticket/<n>`` =
   ``{"rank", "world_size"}`` and increments ``claim/<rank>``, then polls the tickets until it has seen
   ``world_size`` of them. Tickets naming different ``world_size`` values make every rank that sees them
   raise :class:`~weightsync.spec.errors.WireMismatchError` naming each rank's ``world_size`` (it waits up
   to :data:`MISMATCH_GRACE_S` for the ranks that claim more to arrive, so the message is complete),
   instead of joining a group of the wrong size or failing in gloo later. A rank claimed twice (and so
   another never claimed) is a non-bijective rank mapping and is rejected on every rank (scenario B1, vLLM
   PR #36940). If not every rank arrives within the timeout, the ranks with no ticket are named in a
   :class:`~weightsync.spec.errors.TransferTimeoutError`.
4. An exchange writes ``<key>/<rank>`` and waits for every rank's value; on timeout the ranks whose value is
   absent are named, with how the deadline was sized (:attr:`ControlPlane.timeout_basis`). Each rank
   deletes its own keys two rounds later, so the store does not grow.
5. **Bounded store calls.** A ``TCPStore`` client call that waits for the store's answer has no deadline of
   its own once the network goes silent (a cut link, a host that vanished without closing its sockets):
   after ``wait``'s own timeout the client cancels and then blocks in ``recv`` for the cancel's answer,
   and ``get``, ``check``, ``multi_get``, ``add`` and ``delete_key`` block the same way, until TCP gives up
   (minutes, or never when nothing is left to retransmit). So on every rank but 0 (which hosts the store in
   its own process) each such call runs on the control plane's own thread and is waited for at most its
   deadline plus :data:`STORE_GRACE_S`; a miss raises
   :class:`~weightsync.spec.errors.TransferTimeoutError` naming rank 0 (the store's host) and the phase,
   and leaves the control plane unusable (its thread is still blocked): every later call raises the same
   error at once, and the group must be joined again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import datetime
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from weightsync.impl.transfer.secret import error_line
from weightsync.spec.errors import (
    PeerFailedError,
    RemoteProtocolError,
    TransferTimeoutError,
    WireMismatchError,
)

#: After a rank sees the ranks disagree on ``world_size``, how long it waits at most for the ranks that claim
#: a larger group to arrive before it reports (rule 3), seconds.
MISMATCH_GRACE_S = 1.0
#: How much longer than a store call's own deadline a rank other than 0 waits for the store's answer before
#: it gives the store's host up (rule 5), seconds: the store answers a cancelled ``wait`` in milliseconds
#: when the link is alive.
STORE_GRACE_S = 1.0
_POLL_S = 0.005
T = TypeVar("T")
#: Set (in the thread that runs it) for the rendezvous the trainer hosts beside the engines'
#: ``init_weight_transfer_engine`` RPC (:func:`weightsync.impl.transfer.trainer_calls.concurrently`). Once that
#: RPC failed and no worker will come (an engine refused the init), the trainer sets the event: the
#: rendezvous gives up at its next poll, so the store it hosts, and its port, are released at once rather
#: than at the rendezvous deadline (a retry on the same ``master_port`` would otherwise fail with
#: PortInUseError).
RENDEZVOUS_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "weightsync_rendezvous_abandoned", default=None
)


def raise_if_abandoned(phase: str, missing: Sequence[int]) -> None:
    """Raise PeerFailedError naming ``missing`` (the ranks that never joined) and ``phase`` when this
    thread's rendezvous was abandoned (:data:`RENDEZVOUS_ABANDONED`); else nothing."""
    ev = RENDEZVOUS_ABANDONED.get()
    if ev is not None and ev.is_set():
        raise PeerFailedError(
            missing,
            phase,
            "the engines' init_weight_transfer_engine failed: the trainer gave the rendezvous up",
        )


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


#: Largest control-plane value read from the store, bytes (a wire description of ~10^5 tensors fits).
CONTROL_LIMIT_BYTES = 64 << 20


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def strict_json(raw: bytes | str, limit: int, what: str) -> Any:
    """``raw`` parsed as strict JSON (rule 2): UTF-8, at most ``limit`` bytes, no ``NaN``/``Infinity``.

    Raises:
        ValueError: naming ``what``, the value is longer than ``limit`` bytes, not UTF-8, or not JSON.
    """
    if len(raw) > limit:
        raise ValueError(f"{what}: {len(raw)} bytes read from the store, more than the limit of {limit}")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{what}: not strict JSON ({str(exc)[:120]})") from None


def _seen_round(raw: bytes) -> int:
    """The round number a ``seen/<rank>`` key holds (rule 2: read strictly), -1 when it is not one."""
    try:
        value = strict_json(raw, 32, "seen")
    except ValueError:
        return -1
    return value if type(value) is int else -1


class _Caller:
    """One daemon thread running store calls in order (rule 5): a daemon, so that a call blocked on a dead
    link never holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="weightsync-store", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def close(self) -> None:
        self._jobs.put(None)


class ControlPlane:
    """JSON exchanges over a TCPStore for one transfer group.

    Args:
        store: the group's store (already prefixed if shared).
        rank: this process's transfer rank.
        world_size: number of ranks.
        timeout_s: deadline of every wait, seconds (see :meth:`set_deadline`).
        timeout_basis: how ``timeout_s`` was chosen, quoted in timeout errors.
    """

    def __init__(
        self, store: Store, rank: int, world_size: int, timeout_s: float, timeout_basis: str = ""
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timeout_basis = timeout_basis or f"timeout {timeout_s:g} s"
        self._own_keys: dict[int, list[str]] = {}
        # rule 5: rank 0 hosts the store in this process; every other rank bounds its calls on this thread
        self._caller = None if rank == 0 else _Caller()
        #: why the store is given up (rule 5), or None while it answers
        self.lost: str | None = None
        self._lost_after_s = 0.0

    def call(self, phase: str, seconds: float, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, one store call whose own deadline is ``seconds``, bounded on ranks other than 0
        (rule 5): its result, or the exception it raised.

        Raises:
            TransferTimeoutError: naming ``phase`` and rank 0 (the store's host), if the store did not answer
                within ``seconds + STORE_GRACE_S``, or did not an earlier call (:attr:`lost`).
        """
        if self._caller is None:
            return fn(*args)
        if self.lost is not None:
            raise TransferTimeoutError(phase, [0], self._lost_after_s, self.lost)
        fut = self._caller.submit(fn, *args)
        limit = seconds + STORE_GRACE_S
        try:
            return fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            self.lost = (
                f"rank 0's TCPStore (the trainer hosts it) did not answer rank {self.rank} within {limit:.1f} s: "
                f"the link to the trainer or the trainer is gone; {self.timeout_basis}"
            )
            self._lost_after_s = limit
            self._caller.close()
            raise TransferTimeoutError(phase, [0], limit, self.lost) from None

    def close(self) -> None:
        """Release the control plane's thread (idempotent; a call still blocked keeps it until it returns)."""
        if self._caller is not None:
            self._caller.close()
            self.lost = self.lost or f"rank {self.rank}'s control plane is closed"

    def set_deadline(self, timeout_s: float, basis: str) -> None:
        """Use ``timeout_s`` seconds for every following wait (e.g. sized to an update round)."""
        self.timeout_s = timeout_s
        self.timeout_basis = basis

    # ------------------------------------------------------------------------------------- rendezvous
    def _read_tickets(self, seen: list[dict[str, Any]]) -> None:
        """Append to ``seen`` every published ticket after the ones already read (in ticket order)."""
        s, ask, phase = self.store, self.call, "rendezvous"
        n = ask(phase, self.timeout_s, s.add, "arrivals", 0)
        while len(seen) < n:
            key = f"ticket/{len(seen) + 1}"
            if not ask(phase, self.timeout_s, s.check, [key]):  # taken, not yet written: read it next poll
                return
            t = strict_json(ask(phase, self.timeout_s, s.get, key), CONTROL_LIMIT_BYTES, key)
            if not (isinstance(t, dict) and all(type(t.get(f)) is int for f in ("rank", "world_size"))):
                raise RemoteProtocolError(
                    f"rendezvous: {key} is {str(t)[:120]!r}; rule 3 wants a ticket "
                    '{"rank": int, "world_size": int}'
                )
            seen.append({"rank": t["rank"], "world_size": t["world_size"]})

    def join(self) -> None:
        """Rendezvous of all ``world_size`` ranks (rule 3).

        Raises:
            WireMismatchError: the ranks disagree on ``world_size``, naming each rank's value.
            ValueError: some rank was claimed by more than one process (non-bijective rank mapping).
            TransferTimeoutError: phase ``"rendezvous"``, naming the ranks that never joined.
            PeerFailedError: the trainer's store went away (it gave up first).
            ValueError: this rank is outside ``0..world_size-1`` (before touching the store).
            RemoteProtocolError: a ticket is strict JSON but not ``{"rank": int, "world_size": int}`` (a
                process that is no weightsync rank wrote it), naming the key and the value.
        """
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rendezvous: rank {self.rank} is outside 0..{self.world_size - 1} (world_size)")
        s = self.store
        t0 = time.monotonic()
        seen: list[dict[str, Any]] = []
        mismatch_at: float | None = None
        ask, phase = self.call, "rendezvous"
        try:
            # the claim before the ticket: a rank that has read every ticket then reads every claim (one
            # client's store operations are applied in order), so a duplicate rank is seen on every rank
            ask(phase, self.timeout_s, s.add, f"claim/{self.rank}", 1)
            ticket = ask(phase, self.timeout_s, s.add, "arrivals", 1)
            s.set(f"ticket/{ticket}", json.dumps({"rank": self.rank, "world_size": self.world_size}))
            while True:
                self._read_tickets(seen)
                now = time.monotonic()
                sizes = {t["world_size"] for t in seen}
                if len(sizes) > 1:
                    mismatch_at = now if mismatch_at is None else mismatch_at
                    if (
                        len(seen) >= max(sizes)
                        or now - mismatch_at >= MISMATCH_GRACE_S
                        or now - t0 >= self.timeout_s
                    ):
                        self._world_size_mismatch(seen)
                elif len(seen) >= self.world_size:
                    break
                if now - t0 >= self.timeout_s:
                    joined = {t["rank"] for t in seen}
                    missing = [r for r in range(self.world_size) if r not in joined]
                    self.settle(
                        "join_timeout", expected=len([r for r in joined if r != 0 and r != self.rank])
                    )
                    raise TransferTimeoutError(
                        "rendezvous",
                        missing,
                        now - t0,
                        f"{self.world_size - len(missing)} of {self.world_size} joined; {self.timeout_basis}",
                    )
                joined = {t["rank"] for t in seen}
                raise_if_abandoned(phase, [r for r in range(self.world_size) if r not in joined])
                time.sleep(_POLL_S)
            claims = {
                r: ask(phase, self.timeout_s, s.add, f"claim/{r}", 0)
                if ask(phase, self.timeout_s, s.check, [f"claim/{r}"])
                else 0
                for r in range(self.world_size)
            }
        except dist.DistNetworkError as exc:
            raise PeerFailedError(
                [0],
                "rendezvous",
                f"lost the trainer's TCPStore: {error_line(exc)}",
            ) from None
        self.settle("joined")
        dup = sorted(r for r, c in claims.items() if c > 1)
        if dup:
            absent = sorted(r for r, c in claims.items() if c == 0)
            raise ValueError(
                "init_weight_transfer_engine: the rank mapping is not a bijection onto 0.."
                f"{self.world_size - 1}: rank(s) {dup} claimed by more than one worker "
                f"({', '.join(f'{r}: {claims[r]}' for r in dup)}), rank(s) {absent} by none; each worker's rank "
                "is rank_offset + dp_index * tp*pp + local_rank with the DP *index* (vLLM PR #36940)"
            )

    def _world_size_mismatch(self, seen: list[dict[str, Any]]) -> None:
        """Rule 3: report the ``world_size`` of every rank seen, on every rank alike, and raise."""
        shown = ", ".join(
            f"rank {t['rank']}{' (trainer)' if t['rank'] == 0 else ''} says {t['world_size']}"
            for t in sorted(seen, key=lambda t: (t["rank"], t["world_size"]))
        )
        self.settle("world_size_mismatch", expected=len([t for t in seen if t["rank"] != 0]))
        raise WireMismatchError(
            f"init_weight_transfer_engine: the ranks disagree on world_size: {shown}; every rank (the trainer "
            "and each engine worker) must pass the same world_size, 1 + the number of engine workers; "
            "no group was formed"
        )

    def settle(self, key: str, expected: int | None = None, seconds: float = 5.0) -> None:
        """Every rank says it has read what it needs under ``key``; rank 0, which hosts the store, waits
        until ``expected`` other ranks (default all) said so, at most ``min(seconds, timeout_s)``, so that
        it never tears the store down under a peer still reading an error verdict. Never raises (a rank
        other than 0 waits at most ``min(seconds, timeout_s) + STORE_GRACE_S``, rule 5)."""
        want = self.world_size - 1 if expected is None else expected
        end = time.monotonic() + min(seconds, self.timeout_s)
        with contextlib.suppress(dist.DistError, TransferTimeoutError):
            if self.rank != 0:
                self.call(key, min(seconds, self.timeout_s), self.store.add, f"{key}/settled", 1)
                return
            while self.store.add(f"{key}/settled", 0) < want and time.monotonic() < end:
                time.sleep(0.002)

    def mark_seen(self, seq: int) -> None:
        """A worker says it has read everything of round ``seq`` (overwrites one key: no growth)."""
        if self.rank != 0 and self.lost is None:
            with contextlib.suppress(dist.DistError):
                self.store.set(f"seen/{self.rank}", str(seq))

    def wait_seen(self, seq: int, seconds: float = 5.0) -> None:
        """Rank 0, before closing the store: wait (at most ``min(seconds, timeout_s)``) until every worker
        marked round ``seq`` seen, so a worker still reading the round's verdict does not lose the store
        under it (closers pass their ``timeout_s``). Never raises."""
        end = time.monotonic() + min(seconds, self.timeout_s)
        pending = set(range(1, self.world_size)) if seq > 0 else set()
        with contextlib.suppress(dist.DistError):
            while pending and time.monotonic() < end:
                for r in sorted(pending):
                    if self.store.check([f"seen/{r}"]) and _seen_round(self.store.get(f"seen/{r}")) >= seq:
                        pending.discard(r)
                if pending:
                    time.sleep(0.005)

    # --------------------------------------------------------------------------------------- exchange
    def post(self, key: str, value: Any, seq: int, phase: str | None = None) -> None:
        """Write this rank's JSON ``value`` at ``<key>/<rank>`` (remembered for cleanup under ``seq``).

        Raises:
            TransferTimeoutError: naming ``phase`` (default ``key``) and rank 0, if the store was given up
                (:attr:`lost`, rule 5).
        """
        if self.lost is not None:  # the blocked call still owns the store's socket
            raise TransferTimeoutError(phase or key, [0], self._lost_after_s, self.lost)
        k = f"{key}/{self.rank}"
        self.store.set(k, json.dumps(value, separators=(",", ":")))
        self._own_keys.setdefault(seq, []).append(k)

    def collect(self, key: str, phase: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Wait for ``<key>/<r>`` of every rank in ``ranks`` (default all) and return the parsed values.

        Raises:
            TransferTimeoutError: naming ``phase`` and the ranks whose value never appeared, or rank 0 if
                its store stopped answering (rule 5).
            PeerFailedError: naming rank 0, the store's connection failed.
        """
        rs = list(range(self.world_size)) if ranks is None else list(ranks)
        keys = [f"{key}/{r}" for r in rs]
        t0 = time.monotonic()
        s, ask = self.store, self.call
        try:
            ask(phase, self.timeout_s, s.wait, keys, _td(self.timeout_s))
        except dist.DistNetworkError as exc:
            raise PeerFailedError([0], phase, f"lost the trainer's TCPStore: {error_line(exc)}") from None
        except dist.DistError:
            missing = [
                r for r, k in zip(rs, keys, strict=True) if not ask(phase, self.timeout_s, s.check, [k])
            ]
            raise TransferTimeoutError(phase, missing, time.monotonic() - t0, self.timeout_basis) from None
        try:
            raw = ask(phase, self.timeout_s, s.multi_get, keys)
        except dist.DistNetworkError as exc:
            raise PeerFailedError([0], phase, f"lost the trainer's TCPStore: {error_line(exc)}") from None
        return [strict_json(v, CONTROL_LIMIT_BYTES, k) for v, k in zip(raw, keys, strict=True)]

    def exchange(self, key: str, value: Any, seq: int, phase: str) -> list[Any]:
        """:meth:`post` then :meth:`collect` from every rank; returns values in rank order."""
        self.post(key, value, seq, phase)
        return self.collect(key, phase)

    def get(self, key: str, phase: str, rank: int) -> Any:
        """Wait for one key written by ``rank`` and parse it.

        Raises:
            TransferTimeoutError: naming ``phase`` and ``rank``.
        """
        return self.collect(key, phase, [rank])[0]

    def cleanup(self, before_seq: int) -> None:
        """Delete this rank's keys of every round ``< before_seq`` (rule 4)."""
        for seq in [s for s in self._own_keys if s < before_seq]:
            for k in self._own_keys.pop(seq):
                try:
                    self.call("cleanup", self.timeout_s, self.store.delete_key, k)
                except (dist.DistError, TransferTimeoutError):  # pragma: no cover - the store went away
                    return


__all__ = ["CONTROL_LIMIT_BYTES", "ControlPlane", "strict_json"]
