"""The pieces of issue 21 that need no transfer round: the store bound to one interface, the policy without a
secret, the secret itself and ``weightsync token new``, ``verify="hmac"``'s check, the interfaces gloo and NCCL
use, and nothing unpickled in the package. The rounds and replays are in ``test_transfer_auth.py``.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch
from transfer_procs import free_port, init_info, secret_env

from weightsync.impl.transfer.base import ChecksumMismatchError, InitInfo
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.packing import bucket_digest, check_bucket
from weightsync.impl.transfer.rendezvous import check_policy, host_store, listen_socket
from weightsync.impl.transfer.secret import TOKEN_ENV, TOKEN_FILE_ENV, Secret, load_secret, write_token

pytestmark = pytest.mark.timeout(120)

SECRET = "5e" * 32
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------- interface, policy


def test_store_bound_to_127_0_0_2_refuses_127_0_0_1_and_the_wildcard_is_refused() -> None:
    """Acceptance 4."""
    port = free_port()
    store = host_store("127.0.0.2", port, 5.0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    socket.create_connection(("127.0.0.2", port), timeout=2).close()
    del store
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(
            ValueError, match="unspecified address: the store would accept connections on every"
        ):
            listen_socket(wildcard, free_port())
    with pytest.raises(ValueError, match="every interface"):
        BroadcastTrainer(init_info(free_port(), 2, 2.0, master_address="0.0.0.0"))


def test_without_a_secret_only_loopback_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError) as info:
        check_policy("10.9.8.7", None, False)
    text = str(info.value)
    assert "WEIGHTSYNC_TOKEN_FILE" in text and "allow_unauthenticated=True" in text
    with caplog.at_level(logging.WARNING, logger="weightsync.auth"):
        check_policy("10.9.8.6", None, True)
        check_policy("10.9.8.6", None, True)
    assert len([r for r in caplog.records if "without authentication" in r.getMessage()]) == 1
    check_policy("127.0.0.1", None, False)
    check_policy("10.9.8.7", Secret.from_hex(SECRET, "test"), False)
    # the same policy on the trainer's endpoint and on the reference engine's DP group, before any socket
    with secret_env(None):
        with pytest.raises(ValueError, match="allow_unauthenticated=True"):
            BroadcastTrainer(init_info(free_port(), 2, 2.0, master_address="10.9.8.7"))
        from weightsync.impl.engine.dp import DPGroup

        with pytest.raises(ValueError, match="allow_unauthenticated=True"):
            DPGroup(0, 2, "10.9.8.7", free_port(), 2.0)
    with pytest.raises(ValueError, match="allow_unauthenticated"):
        InitInfo.parse({**init_info(1, 2), "allow_unauthenticated": "yes"})


# ------------------------------------------------------------------------------------------ the secret


def test_the_secret_file_mode_length_and_sources(tmp_path: pathlib.Path) -> None:
    path = write_token(tmp_path / "token")
    assert (path.stat().st_mode & 0o777) == 0o600
    s = load_secret({TOKEN_FILE_ENV: str(path)})
    assert s is not None and path.read_text().strip() not in repr(s) and "bytes from" in str(s)
    with pytest.raises(FileExistsError):
        write_token(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"has mode 0644, .* must be 0600 or stricter \(chmod 600"):
        load_secret({TOKEN_FILE_ENV: str(path)})
    path.chmod(0o400)
    assert load_secret({TOKEN_FILE_ENV: str(path)}) is not None
    with pytest.raises(ValueError, match="has 16 bytes; it needs at least 32"):
        load_secret({TOKEN_ENV: "ab" * 16})
    with pytest.raises(ValueError, match="not hexadecimal"):
        load_secret({TOKEN_ENV: "not a secret at all, but long enough to be 32 bytes long"})
    with pytest.raises(ValueError, match="set exactly one"):
        load_secret({TOKEN_ENV: SECRET, TOKEN_FILE_ENV: str(path)})
    assert load_secret({}) is None


def test_token_new_command_writes_a_0600_file_and_never_overwrites(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t"
    cmd = [sys.executable, "-m", "weightsync.cli", "token", "new", str(path), "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert (path.stat().st_mode & 0o777) == 0o600 and path.read_text().strip() not in first.stdout
    assert load_secret({TOKEN_FILE_ENV: str(path)}) is not None
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "File exists" in again.stdout


# ------------------------------------------------------------------------------------------- integrity


def test_verify_hmac_detects_a_changed_byte_and_a_foreign_key() -> None:
    key, other = bytes(range(32)), bytes(range(1, 33))
    buf = torch.arange(64, dtype=torch.uint8)
    tag = bucket_digest(buf, "hmac", key)
    check_bucket(buf, tag, "hmac", key, "bucket 0")
    bad = buf.clone()
    bad[17] ^= 1
    with pytest.raises(ChecksumMismatchError, match=r"bucket 0 .*verify='hmac'"):
        check_bucket(bad, tag, "hmac", key, "bucket 0")
    with pytest.raises(ChecksumMismatchError):
        check_bucket(buf, tag, "hmac", other, "bucket 0")
    with pytest.raises(ValueError, match="needs the session key"):
        bucket_digest(buf, "hmac", None)


def test_nothing_is_unpickled_anywhere_in_the_package() -> None:
    """Acceptance (item 3): no unpickling call in ``weightsync/`` (nor torch.load, marshal, shelve,
    dill, cloudpickle or pyzmq's recv_pyobj, which unpickle)."""
    pattern = re.compile(
        r"\b(pickle\.loads?|Unpickler|torch\.load|marshal\.loads?|shelve\.open|dill\.|cloudpickle\.|"
        r"recv_pyobj|jsonpickle|numpy\.load|np\.load|yaml\.load|yaml\.unsafe_load)\b"
    )
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "weightsync").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert hits == []
    # the pattern finds what it is meant to find
    assert pattern.search("obj = pickle.loads(raw)") and pattern.search("torch.load(path)")


def test_gloo_and_nccl_use_the_stores_interface() -> None:
    """Item 2: the trainer's gloo device binds ``master_address`` itself (not 127.0.0.1 for 127.0.0.2), and
    NCCL's socket interface is the one that holds it (``lo`` here), unless the operator set one."""
    from weightsync.impl.transfer.broadcast_group import gloo_device_choice, nccl_socket_ifname
    from weightsync.impl.transfer.rendezvous import interface_of

    assert gloo_device_choice("127.0.0.2", 0) == [{"hostname": "127.0.0.2"}]
    assert gloo_device_choice("127.0.0.2", 1) == [{"hostname": "127.0.0.1"}]
    assert interface_of("127.0.0.2") == "lo" and interface_of("198.51.100.77") is None
    saved = os.environ.pop("NCCL_SOCKET_IFNAME", None)
    try:
        assert nccl_socket_ifname("127.0.0.2", 0) == "lo"
        os.environ["NCCL_SOCKET_IFNAME"] = "eth7"
        assert nccl_socket_ifname("127.0.0.2", 0) is None
    finally:
        os.environ.pop("NCCL_SOCKET_IFNAME", None)
        if saved is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = saved


def _listening_addresses() -> list[str]:
    """The IPv4 addresses this process's listening TCP sockets are bound to (``/proc/self/net/tcp``, state
    0A, matched to this process's socket descriptors by inode)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    out = []
    for line in pathlib.Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:
            out.append(socket.inet_ntoa(bytes.fromhex(f[1].split(":")[0])[::-1]))
    return sorted(out)


@pytest.mark.skipif(not pathlib.Path("/proc/self/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_the_dp_group_listens_on_the_interface_it_was_named() -> None:
    """The reference engine's DP group on 127.0.0.2: its store and rank 0's gloo device listen there
    (gloo's default device would listen on the address the hostname resolves to, 127.0.0.1 here); rank 1,
    which reaches rank 0 over loopback, listens on 127.0.0.1. Both ranks are threads of this process."""
    import threading

    from weightsync.impl.engine.dp import DPGroup

    before = _listening_addresses()
    port = free_port()
    groups: dict[int, DPGroup] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            groups[rank] = DPGroup(rank, 2, "127.0.0.2", port, 20.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == [] and len(groups) == 2
        added = list(_listening_addresses())
        for a in before:
            added.remove(a)
        # the store and rank 0's gloo device on the named interface; rank 1's gloo device on loopback
        assert sorted(added) == ["127.0.0.1", "127.0.0.2", "127.0.0.2"], added
    finally:
        for g in groups.values():
            g.close()


def test_store_errors_never_quote_the_session_namespace() -> None:
    """torch's store timeout names the keys it waited for, and under a session those start with the
    session's namespace, the capability the handshake grants: the text weightsync quotes is redacted."""
    import datetime

    from torch._C._distributed_c10d import PrefixStore

    from weightsync.impl.transfer.secret import namespace_of, redact_namespace

    ns = namespace_of(bytes(range(32)))
    store = host_store("127.0.0.1", free_port(), 5.0)
    with pytest.raises(torch.distributed.DistStoreError) as info:
        PrefixStore(ns, store).wait(["pg/0/1"], datetime.timedelta(milliseconds=100))
    text = str(info.value)
    assert ns in text  # the premise: torch quotes the key
    red = redact_namespace(text)
    assert ns not in red and "ws/<session>/pg/0/1" in red and redact_namespace("ws/xyz") == "ws/xyz"


def test_a_ticket_that_is_json_but_no_ticket_is_refused_naming_it() -> None:
    """Rule 3 of the control plane: a ticket must be ``{"rank": int, "world_size": int}``; anything else a
    process on the store wrote is a RemoteProtocolError naming the key, not a KeyError."""
    from weightsync.impl.transfer.control import ControlPlane
    from weightsync.spec.errors import RemoteProtocolError

    store = host_store("127.0.0.1", free_port(), 5.0)
    store.add("arrivals", 1)
    store.set("ticket/1", '{"rank": "1", "world_size": 2}')
    with pytest.raises(RemoteProtocolError, match=r"ticket/1 is .*rank.*rule 3 wants a ticket"):
        ControlPlane(store, 0, 2, 3.0).join()
