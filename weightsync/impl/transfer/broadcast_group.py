"""The broadcast transport's process group (:mod:`weightsync.impl.transfer.broadcast`, rules 1, 2 and 6):
joining it from a TCPStore rendezvous, gloo's device choice towards the trainer's address, and broadcasts
waited for with a deadline."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from weightsync.impl.transfer.auth import Session
from weightsync.impl.transfer.base import InitInfo
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.packing import BufferPool
from weightsync.impl.transfer.rendezvous import interface_of, rendezvous
from weightsync.impl.transfer.secret import error_line, redact_namespace
from weightsync.spec.errors import PeerFailedError, TransferTimeoutError


def resolve_backend(name: str) -> str:
    """The group backend for ``group_backend`` ``name`` (``auto``: NCCL with CUDA, else gloo)."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "init_info['group_backend']='nccl' needs CUDA, which this process does not have; use 'gloo'"
        )
    return name


def local_address_towards(address: str) -> str | None:
    """This host's IPv4 address that the kernel's routing table picks to reach ``address`` (resolved with
    ``gethostbyname``), or None if it cannot be resolved or has no route. A route lookup only: the UDP
    ``connect`` sends no packet."""
    try:
        ip = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def gloo_device_choice(address: str, rank: int | None = None) -> list[dict[str, str]]:
    """The keyword arguments of ``ProcessGroupGloo.create_device``, one per device, that a rank of a group
    whose store is at ``address`` binds and advertises to its peers (rule 1); ``[]``: gloo's default
    device. In order of precedence:

    1. ``GLOO_SOCKET_IFNAME`` (comma-separated interface names), when set: torch's own convention, which
       its ``ProcessGroupGloo(store, rank, size, timeout)`` constructor honours and explicit devices
       would otherwise bypass;
    2. rank 0 (the trainer, which hosts the store): ``address`` itself, the interface its store listens
       on (``rendezvous`` rule 1), so its gloo listens there too;
    3. ``127.0.0.1`` when ``address`` is a loopback address;
    4. the local address on the route to ``address`` (:func:`local_address_towards`), so every peer that
       reaches the store reaches this rank too. gloo's default (the address the hostname resolves to, else
       loopback) is wrong on a host whose hostname names another interface or network namespace: the
       peers would be told to connect to an address they cannot reach, and the group would never form;
    5. ``[]`` when ``address`` does not resolve or has no route.
    """
    ifnames = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if ifnames:
        return [{"interface": n} for n in ifnames]
    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return []
    if rank == 0:
        return [{"hostname": ip}]
    if ip.startswith("127."):
        return [{"hostname": "127.0.0.1"}]
    local = local_address_towards(ip)
    return [] if local is None else [{"hostname": local}]


def gloo_devices(address: str, rank: int | None = None) -> list[Any]:
    """The gloo devices of :func:`gloo_device_choice` (gloo's default device where it chose none)."""
    gloo: Any = dist.ProcessGroupGloo
    chosen = gloo_device_choice(address, rank)
    return [gloo.create_device(**kw) for kw in chosen] or [gloo.create_default_device()]


def nccl_socket_ifname(address: str, rank: int) -> str | None:
    """The interface NCCL's bootstrap and socket transport should use (``NCCL_SOCKET_IFNAME``) in a group
    whose store is at ``address``: the one holding the address gloo binds (:func:`gloo_device_choice`), or
    None when that is unknown or ``NCCL_SOCKET_IFNAME`` is already set (the operator's choice wins)."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return None
    chosen = gloo_device_choice(address, rank)
    host = chosen[0].get("hostname") if chosen else None
    return None if host is None else interface_of(host)


@dataclass
class BroadcastGroup:
    """A joined transfer group (both sides). Built by :func:`join_group`; the trainer's is its ``group``.

    Attributes:
        rank, world_size: this process's transfer rank and the group size.
        backend: ``"gloo"`` or ``"nccl"``.
        device: where payload tensors live (``cpu`` for gloo, the current CUDA device for NCCL).
        info: the ``init_info`` it was joined with (sizes each round's deadline).
        session: the authenticated rendezvous's session (None without a secret): its key tags buckets
            under ``verify="hmac"``.
        seq: number of updates started on this group; ok_seq: the last one that completed everywhere.
    """

    store: TCPStore
    cp: ControlPlane
    pg: Any
    rank: int
    world_size: int
    backend: str
    device: torch.device
    info: InitInfo
    session: Session | None = None
    seq: int = 0
    ok_seq: int = 0
    pool: BufferPool = field(default_factory=BufferPool)
    packer: concurrent.futures.ThreadPoolExecutor | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def timeout_s(self) -> float:
        """Deadline of every wait now (the current round's, ``rounds`` rule 0), seconds."""
        return self.cp.timeout_s

    def begin_round(self, nbytes: int | None) -> None:
        """Size every wait of the round about to start, which moves ``nbytes`` bytes (None: unknown)."""
        self.cp.set_deadline(*self.info.round_deadline(nbytes))

    def broadcast(self, t: torch.Tensor) -> Any:
        """Start an asynchronous broadcast of ``t`` from rank 0; returns the ``Work``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([t], opts)

    @property
    def peers(self) -> list[int]:
        """The ranks a broadcast of this rank waits on (rule 6): every other rank. With one peer (a trainer
        and one worker) that is exactly the missing rank; with more, gloo and NCCL do not say which peer
        stalled a collective, so a broadcast's timeout names them all."""
        return [r for r in range(self.world_size) if r != self.rank]

    def wait(self, work: Any, phase: str) -> None:
        """Wait for ``work`` at most ``timeout_s``.

        Raises:
            TransferTimeoutError: the deadline passed, naming :attr:`peers` (the text says how it was
                sized and who sends: rank 0).
            PeerFailedError: the collective failed (e.g. a peer's connection closed), naming :attr:`peers`.
        """
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            waited = time.monotonic() - t0
            text = redact_namespace(str(exc))
            first = text.splitlines()[0] if text else type(exc).__name__
            what = f"rank {self.rank}'s part of a broadcast from rank 0 (the trainer) to rank(s) 1..{self.world_size - 1}"
            if "timed out" in text.lower() or "timeout" in text.lower() or waited >= self.timeout_s * 0.99:
                detail = f"{what}; {self.cp.timeout_basis}; {first}"
                raise TransferTimeoutError(phase, self.peers, waited, detail) from None
            raise PeerFailedError(self.peers, phase, f"{what}: {first}") from None

    def close(self) -> None:
        """Drop the process group, buffers and packing thread (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            self.cp.wait_seen(self.ok_seq, self.timeout_s)
        self.cp.close()
        self.pool.clear()
        if self.packer is not None:
            self.packer.shutdown(wait=False, cancel_futures=True)
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):
                pg.shutdown()


def join_group(info: InitInfo, rank: int) -> BroadcastGroup:
    """Rendezvous on the store (policy, one interface and the authenticated handshake:
    :func:`~weightsync.impl.transfer.rendezvous.rendezvous`) and build this rank's process group under the
    session's namespace (rule 1).

    Raises:
        ValueError: the policy refused ``master_address`` (before any socket opens).
        AuthenticationError: the handshake refused this rank or the store it reached.
        PortInUseError: rank 0 could not host the store.
        WireMismatchError: the ranks disagree on ``world_size`` (``control`` rule 3).
        TransferTimeoutError: a rank never joined (naming it), or the group could not connect in time.
        ValueError: the rank mapping is not a bijection, or NCCL was asked for without CUDA.
    """
    backend = resolve_backend(info.group_backend)
    rv = rendezvous(info, rank)
    store = rv.store
    try:
        cp = ControlPlane(
            PrefixStore("ctl/", rv.scoped),
            rank,
            info.world_size,
            info.rendezvous_timeout_s,
            info.rendezvous_timeout_basis,
        )
        cp.join()
        pg_store = PrefixStore("pg/", rv.scoped)
        timeout = datetime.timedelta(seconds=info.rendezvous_timeout_s)
        try:
            if backend == "gloo":
                gloo: Any = dist.ProcessGroupGloo
                opts = gloo._Options()
                opts._timeout = timeout
                opts._devices = gloo_devices(info.address, rank)
                pg: Any = gloo(pg_store, rank, info.world_size, opts)
                device = torch.device("cpu")
            else:  # pragma: no cover - needs CUDA
                ifname = nccl_socket_ifname(info.address, rank)
                if ifname is not None:
                    os.environ["NCCL_SOCKET_IFNAME"] = ifname
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(pg_store, rank, info.world_size, nccl_opts)
                device = torch.device("cuda", torch.cuda.current_device())
        except dist.DistError as exc:
            raise TransferTimeoutError(
                "init_weight_transfer_engine/process_group",
                [],
                info.rendezvous_timeout_s,
                f"{info.rendezvous_timeout_basis}; {error_line(exc)}",
            ) from None
    except BaseException:
        del store
        raise
    return BroadcastGroup(store, cp, pg, rank, info.world_size, backend, device, info, rv.session)


def drain(group: BroadcastGroup, works: Iterable[Any]) -> None:
    """Wait (within the group's deadline, errors suppressed) for outstanding broadcasts before giving up."""
    for w in works:
        with contextlib.suppress(Exception):
            w.wait(datetime.timedelta(seconds=group.timeout_s))


__all__ = [
    "BroadcastGroup",
    "drain",
    "gloo_device_choice",
    "gloo_devices",
    "join_group",
    "local_address_towards",
    "nccl_socket_ifname",
    "resolve_backend",
]
