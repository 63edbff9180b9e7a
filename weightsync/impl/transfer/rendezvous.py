"""Opening a transfer group's store: one interface, the policy, and the authenticated handshake.

Rules:

1. **One interface.** The store's host (rank 0) binds its listening socket to ``master_address``'s
   interface itself and hands it to ``TCPStore`` as ``master_listen_fd``: torch's TCPStore master binds
   every interface whatever host it is given (pytorch/pytorch#173909), and only a socket passed that way
   chooses the address. An unspecified address (``0.0.0.0``, ``::``) is refused: it would listen on every
   interface. gloo binds the same address (``broadcast_group.gloo_device_choice``) and NCCL, when
   ``NCCL_SOCKET_IFNAME`` is unset, the interface that holds it (:func:`interface_of`).
2. **Policy.** With a secret (each process's own environment, :mod:`weightsync.impl.transfer.secret`) the
   handshake of :mod:`weightsync.impl.transfer.auth` is required: a worker with a secret refuses a host that
   runs without one, and a worker without one refuses a host that requires one, each with
   :class:`~weightsync.impl.transfer.base.AuthenticationError` at once. Without a secret a loopback
   ``master_address`` works (the store then listens on loopback only); any other address is refused, naming
   both fixes (a secret, or the init option ``allow_unauthenticated=True``, which logs a warning once per
   process and address).
3. After the handshake everything (control plane, process group, buckets) runs under the session's store
   namespace (:attr:`Rendezvous.scoped`).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore

from weightsync.impl.transfer.auth import Session, host_handshake, worker_handshake
from weightsync.impl.transfer.base import InitInfo, PortInUseError
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.secret import Secret, load_secret
from weightsync.spec.errors import TransferTimeoutError

log = logging.getLogger("weightsync.auth")
_warned_unauthenticated: set[str] = set()


def resolve(address: str) -> str:
    """The IP address ``address`` names (the first ``getaddrinfo`` answer; an IP is returned as is).

    Raises:
        ValueError: ``address`` does not resolve.
    """
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"master_address={address!r} does not resolve ({exc})") from None
    return str(infos[0][4][0])


def is_loopback(address: str) -> bool:
    """Whether ``address`` resolves to a loopback address (127.0.0.0/8, ``::1``)."""
    try:
        return ipaddress.ip_address(resolve(address)).is_loopback
    except ValueError:
        return False


def refuse_unspecified(address: str) -> str:
    """``address``'s IP (rule 1).

    Raises:
        ValueError: it is an unspecified address, naming it and the reason.
    """
    ip = resolve(address)
    if ipaddress.ip_address(ip).is_unspecified:
        raise ValueError(
            f"master_address={address!r} is the unspecified address: the store would accept connections on "
            "every interface of the host; name the one interface the engines reach the trainer on "
            "(e.g. 10.0.0.1, or 127.0.0.1 on one host)"
        )
    return ip


def listen_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address``'s IP and ``port``, listening (rule 1): pass its ``detach()``-ed
    descriptor to ``TCPStore(..., master_listen_fd=fd)``.

    Raises:
        ValueError: an unspecified or unresolvable address.
        OSError: the bind failed (``errno`` EADDRINUSE when the port is taken).
    """
    ip = refuse_unspecified(address)
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def interface_of(ip: str) -> str | None:
    """The name of the local IPv4 interface whose network holds ``ip`` (``lo`` for 127.0.0.0/8), or None.
    Uses the ``SIOCGIFADDR`` / ``SIOCGIFNETMASK`` ioctls of Linux; None elsewhere."""
    try:
        import fcntl
        import struct

        target = ipaddress.IPv4Address(ip)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                req = struct.pack("256s", name.encode()[:15])
                try:
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
                    mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])
                except OSError:
                    continue
                if target in ipaddress.IPv4Network(f"{addr}/{mask}", strict=False):
                    return name
    except (ImportError, OSError, ValueError):
        return None
    return None


def check_policy(address: str, secret: Secret | None, allow_unauthenticated: bool) -> None:
    """Rule 2 before any socket opens.

    Raises:
        ValueError: an unspecified address; or no secret, a non-loopback address and no
            ``allow_unauthenticated``, naming both fixes.
    """
    refuse_unspecified(address)
    if secret is not None or is_loopback(address):
        return
    if not allow_unauthenticated:
        raise ValueError(
            f"master_address={address!r} is not a loopback address and no secret is configured: anyone who "
            "reaches that port could join the transfer group and read or inject weights. Either give every "
            "process the deployment's secret (WEIGHTSYNC_TOKEN_FILE=<file of mode 0600>, written by "
            "`weightsync token new PATH`, or WEIGHTSYNC_TOKEN), or pass the init option "
            "allow_unauthenticated=True to accept that risk"
        )
    if address not in _warned_unauthenticated:
        _warned_unauthenticated.add(address)
        log.warning(
            "weightsync: the transfer group at %s runs without authentication (allow_unauthenticated=True): "
            "any process that reaches it can join, read and inject weights",
            address,
        )


def host_store(
    address: str, port: int, timeout_s: float, world_size: int | None = None, wait_for_workers: bool = False
) -> TCPStore:
    """A ``TCPStore`` master listening on ``address``'s interface only (rule 1).

    Raises:
        ValueError: an unspecified or unresolvable address.
        PortInUseError: ``port`` is taken on that address.
    """
    try:
        sock = listen_socket(address, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                errno.EADDRINUSE,
                f"init_weight_transfer_engine: master_port {port} on {address} is already in use; the trainer "
                "(rank 0) must host the rendezvous TCPStore on a free port",
            ) from None
        raise
    ip = str(sock.getsockname()[0])
    fd = sock.detach()
    try:
        td = datetime.timedelta(seconds=timeout_s)
        return TCPStore(
            ip, port, world_size, True, td, wait_for_workers=wait_for_workers, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise


def open_store(info: InitInfo, rank: int) -> TCPStore:
    """Host (rank 0, rule 1) or connect to (other ranks) the group's TCPStore.

    Raises:
        PortInUseError: rank 0 and ``master_port`` is taken.
        ValueError: an unspecified or unresolvable ``master_address``.
        TransferTimeoutError: a worker found no store at the address within ``timeout_s`` (phase
            ``"rendezvous"``, missing rank 0).
    """
    if rank == 0:
        return host_store(info.address, info.port, info.rendezvous_timeout_s)
    try:
        td = datetime.timedelta(seconds=info.rendezvous_timeout_s)
        return TCPStore(info.address, info.port, None, False, td, wait_for_workers=False)
    except dist.DistNetworkError:
        raise TransferTimeoutError(
            "rendezvous",
            [0],
            info.rendezvous_timeout_s,
            f"no TCPStore answered at {info.master_address}:{info.master_port} (the trainer hosts it); "
            f"{info.rendezvous_timeout_basis}",
        ) from None


def authenticate(
    store: Store, rank: int, world_size: int, timeout_s: float, secret: Secret | None, what: str
) -> Session | None:
    """The handshake (:mod:`weightsync.impl.transfer.auth`) on ``store``, as its host (rank 0) or a worker;
    None when neither side holds a secret. Raises as :func:`~weightsync.impl.transfer.auth.host_handshake`
    or :func:`~weightsync.impl.transfer.auth.worker_handshake`."""
    cp = ControlPlane(store, rank, world_size, timeout_s)
    try:
        if rank == 0:
            return host_handshake(cp, secret, world_size, timeout_s, what)
        return worker_handshake(cp, secret, rank, world_size, timeout_s, what)
    finally:
        cp.close()


@dataclass
class Rendezvous:
    """An opened, admitted group store.

    Attributes:
        store: the TCPStore itself (keep it referenced for the group's life).
        scoped: where everything after the handshake goes (rule 3): ``store`` under the session's
            namespace, or ``store`` itself without a secret.
        session: the handshake's session, None without a secret.
    """

    store: TCPStore
    scoped: Store
    session: Session | None


def rendezvous(info: InitInfo, rank: int, secret: Secret | None = None) -> Rendezvous:
    """Policy (rule 2), store (rule 1) and handshake for transfer rank ``rank`` of ``info``'s group;
    ``secret`` defaults to this process's own (:func:`~weightsync.impl.transfer.secret.load_secret`).

    Raises:
        ValueError: the policy refuses the address (before any socket opens), or the secret's
            configuration is invalid.
        PortInUseError / TransferTimeoutError: as :func:`open_store`; TransferTimeoutError also when the
            handshake misses its deadline (phase ``init_weight_transfer_engine/auth``).
        AuthenticationError / WireMismatchError: as the handshake.
    """
    secret = load_secret() if secret is None else secret
    check_policy(info.address, secret, info.allow_unauthenticated)
    store = open_store(info, rank)
    try:
        session = authenticate(
            store, rank, info.world_size, info.rendezvous_timeout_s, secret, "init_weight_transfer_engine"
        )
    except BaseException:
        del store
        raise
    return Rendezvous(store, session.scoped(store) if session else store, session)


__all__ = [
    "Rendezvous",
    "authenticate",
    "check_policy",
    "host_store",
    "interface_of",
    "is_loopback",
    "listen_socket",
    "open_store",
    "refuse_unspecified",
    "rendezvous",
    "resolve",
]
