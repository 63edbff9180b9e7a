"""Only the holder of the deployment's secret moves weights (issue 21): the authenticated rendezvous
(:mod:`weightsync.impl.transfer.auth`), the store bound to one interface and the policy
(:mod:`weightsync.impl.transfer.rendezvous`), the secret itself (:mod:`weightsync.impl.transfer.secret`),
``verify="hmac"``, and nothing unpickled in the package.

Real processes and real gloo on loopback for the rounds (a rogue process in the middle of one); the
replay cases drive the host's and the workers' handshakes on one real ``TCPStore`` from threads, so a
replayed message lands exactly where the case needs it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from transfer_procs import (
    DictModel,
    bytes_equal,
    free_port,
    init_info,
    make_tensors,
    model_spec,
    ok,
    run_roles,
    update_info_for,
)

from weightsync.impl.transfer.auth import Session, host_handshake, worker_handshake
from weightsync.impl.transfer.base import AuthenticationError, ChecksumMismatchError, InitInfo, ParallelInfo
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.control import ControlPlane, strict_json
from weightsync.impl.transfer.packing import bucket_digest, check_bucket
from weightsync.impl.transfer.rendezvous import check_policy, host_store, listen_socket
from weightsync.impl.transfer.secret import TOKEN_ENV, TOKEN_FILE_ENV, Secret, load_secret, write_token
from weightsync.impl.transfer.worker import WeightTransferWorker
from weightsync.spec.errors import TransferTimeoutError

pytestmark = pytest.mark.timeout(120)

SECRET = "5e" * 32
OTHER = "a7" * 32
ROOT = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def secret_env(token: str | None) -> Iterator[None]:
    """This process's secret is ``token`` (None: none) inside the block (the pool's processes are reused)."""
    saved = {k: os.environ.pop(k, None) for k in (TOKEN_ENV, TOKEN_FILE_ENV)}
    if token is not None:
        os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# -------------------------------------------------------------------------------------------- the roles


def auth_trainer(
    port: int,
    world: int,
    token: str | None,
    timeout_s: float,
    address: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Host the group, send round 1's tensors; returns what the auth logger said (and the error, if any)."""
    rec = _Records()
    logging.getLogger("weightsync.auth").addHandler(rec)
    try:
        with secret_env(token):
            t0 = time.monotonic()
            try:
                tr = BroadcastTrainer(
                    init_info(port, world, timeout_s, master_address=address, **(extra or {}))
                )
            except Exception as exc:
                return {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "log": rec.lines,
                    "waited": time.monotonic() - t0,
                    "attrs": getattr(exc, "missing_ranks", None),
                }
            try:
                tr.send(iter(make_tensors(1)))
                session = tr.group.session
            finally:
                tr.close()
            return {"log": rec.lines, "handshake_s": None if session is None else session.seconds}
    finally:
        logging.getLogger("weightsync.auth").removeHandler(rec)


def auth_worker(
    port: int,
    world: int,
    token: str | None,
    delay_s: float,
    timeout_s: float,
    address: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Join as rank 1 after ``delay_s`` and receive round 1; returns whether it is bit-exact."""
    time.sleep(delay_s)
    with secret_env(token):
        model = DictModel(model_spec())
        w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=0))
        t0 = time.monotonic()
        try:
            w.init_weight_transfer_engine(
                init_info(port, world, timeout_s, master_address=address, **(extra or {}))
            )
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc), "waited": time.monotonic() - t0}
        sent = make_tensors(1)
        w.start_weight_update()
        w.update_weights(update_info_for(sent))
        w.finish_weight_update()
        got = model.weights()
        w.shutdown()
        return {"bit_exact": all(bytes_equal(got[n], t) for n, t in sent)}


class _Touch:
    """Unpickling this creates the marker file: proof of code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def rogue(port: int, address: str, marker: str) -> list[str]:
    """A client without the secret: a claim for rank 1 with a wrong MAC, the unprefixed keys a group would use,
    and pickled payloads everywhere a peer reads. Returns the keys it wrote."""
    import datetime
    import json

    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(address, port, None, False, datetime.timedelta(seconds=20), wait_for_workers=False)
    store.wait(["auth/hello"])
    hello = json.loads(store.get("auth/hello"))
    rnd = hello["round"]
    payload = pickle.dumps(_Touch(marker))
    written = []
    claim = {"v": 1, "round": rnd, "rank": 1, "world_size": 2, "nonce": "00" * 16, "mac": "11" * 32}
    slot = store.add(f"auth/{rnd}/claims", 1)
    store.set(f"auth/{rnd}/claim/{slot}", json.dumps(claim))
    written.append(f"auth/{rnd}/claim/{slot}")
    slot = store.add(f"auth/{rnd}/claims", 1)
    store.set(f"auth/{rnd}/claim/{slot}", payload)
    written.append(f"auth/{rnd}/claim/{slot}")
    # the keys an unauthenticated group of two would use (torch's PrefixStore("ctl/") names them "ctl//..."):
    # the tickets and claims of the rendezvous, the wire agreement, bucket 0's status, gloo's rank addresses
    for key in (
        "ctl//ticket/1",
        "ctl//ticket/2",
        "ctl//r1/wire/0",
        "ctl//r1/wire/1",
        "ctl//r1/wiredesc/0",
        "ctl//r1/b0/0",
        "pg//0",
        "pg//1",
    ):
        store.set(key, payload)
        written.append(key)
    store.add("ctl//arrivals", 2)
    store.add("ctl//claim/1", 1)
    return written


# ---------------------------------------------------------------------------------------------- rounds


def pair(
    trainer_token: str | None, worker_token: str | None, timeout_s: float, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trainer and one worker on 127.0.0.1, each with its own secret: (trainer's result, worker's)."""
    port = free_port()
    res = run_roles(
        [
            (auth_trainer, (port, 2, trainer_token, timeout_s, "127.0.0.1", extra)),
            (auth_worker, (port, 2, worker_token, 0.0, timeout_s, "127.0.0.1", extra)),
        ],
        deadline_s=60,
    )
    return ok(res[0]), ok(res[1])


def test_rogue_without_the_secret_cannot_take_part_and_nothing_is_unpickled(tmp_path: pathlib.Path) -> None:
    """Acceptance 1: the rogue's claim is rejected with its reason, the marker file never appears, and the
    legitimate round (store on 127.0.0.2) completes bit-exact."""
    port, marker = free_port(), tmp_path / "unpickled"
    res = run_roles(
        [
            (auth_trainer, (port, 2, SECRET, 20.0, "127.0.0.2")),
            (rogue, (port, "127.0.0.2", str(marker))),
            (auth_worker, (port, 2, SECRET, 1.5, 20.0, "127.0.0.2")),
        ],
        deadline_s=60,
    )
    trainer, written, worker = ok(res[0]), ok(res[1]), ok(res[2])
    assert "error" not in trainer and "error" not in worker, (trainer, worker)
    assert worker["bit_exact"]
    assert any("bad MAC for rank 1" in line for line in trainer["log"]), trainer["log"]
    assert any("not strict JSON" in line for line in trainer["log"]), trainer["log"]
    assert "ctl//r1/wire/1" in written and "pg//0" in written
    assert not marker.exists()


def test_a_worker_with_a_wrong_secret_gets_authentication_error_within_2_s() -> None:
    """Acceptance 2 (and the host fails closed at its deadline, naming the missing rank and the rejection)."""
    trainer, worker = pair(SECRET, OTHER, 4.0)
    assert worker["error"] == "AuthenticationError" and "different secrets" in worker["message"], worker
    assert worker["waited"] < 2.0, worker
    assert trainer["error"] == "TransferTimeoutError" and trainer["attrs"] == (1,), trainer
    assert "1 claim(s) rejected (bad MAC for rank 1" in trainer["message"]
    assert any("bad MAC" in line for line in trainer["log"])


@pytest.mark.parametrize(
    ("trainer_token", "worker_token", "says"),
    [
        (SECRET, None, "this worker has none"),
        (None, SECRET, "the trainer runs without one"),
    ],
)
def test_a_secret_on_one_side_only_is_refused_at_once(
    trainer_token: str | None, worker_token: str | None, says: str
) -> None:
    _, worker = pair(trainer_token, worker_token, 3.0)
    assert worker["error"] == "AuthenticationError" and says in worker["message"], worker
    assert worker["waited"] < 2.0


def test_no_secret_on_loopback_still_works() -> None:
    trainer, worker = pair(None, None, 20.0)
    assert trainer["handshake_s"] is None and worker["bit_exact"]


# ---------------------------------------------------------------------------------- replays (threads)


class _Group:
    """One real TCPStore (hosted here, on loopback) and the handshakes of its host and workers on threads."""

    def __init__(self, world: int, timeout_s: float) -> None:
        self.port = free_port()
        self.world, self.timeout_s = world, timeout_s
        self.store = host_store("127.0.0.1", self.port, 10.0)
        self.secret = Secret.from_hex(SECRET, "test")
        self.results: dict[str, Any] = {}
        self.threads: list[threading.Thread] = []

    def client(self) -> Any:
        import datetime

        from torch._C._distributed_c10d import TCPStore

        return TCPStore(
            "127.0.0.1", self.port, None, False, datetime.timedelta(seconds=10), wait_for_workers=False
        )

    def _run(self, name: str, fn: Callable[[], Any]) -> None:
        def body() -> None:
            try:
                self.results[name] = fn()
            except Exception as exc:
                self.results[name] = exc

        t = threading.Thread(target=body, daemon=True)
        t.start()
        self.threads.append(t)

    def host(self) -> None:
        cp = ControlPlane(self.store, 0, self.world, self.timeout_s)
        self._run("host", lambda: host_handshake(cp, self.secret, self.world, self.timeout_s, "test"))

    def worker(self, rank: int, name: str | None = None) -> None:
        cp = ControlPlane(self.client(), rank, self.world, self.timeout_s)
        self._run(
            name or f"w{rank}",
            lambda: worker_handshake(cp, self.secret, rank, self.world, self.timeout_s, "test"),
        )

    def wait(self, *names: str, within: float = 15.0) -> None:
        end = time.monotonic() + within
        while any(n not in self.results for n in names):
            assert time.monotonic() < end, f"hung: {[n for n in names if n not in self.results]}"
            time.sleep(0.01)

    def round_id(self) -> str:
        # a client of its own: a TCPStore object serialises its calls, and a blocking ``wait`` on the host's
        # own object would hold off the host thread's ``set``
        reader = self.client()
        reader.wait(["auth/hello"])
        return str(strict_json(reader.get("auth/hello"), 1 << 16, "hello")["round"])


def test_replays_are_refused_stale_duplicate_and_an_old_accept() -> None:
    """Acceptance 3 and 5: a claim of an earlier round is stale, a re-posted admitted claim a duplicate (the
    rogue re-posts both until the host's deadline, which then fails closed naming the missing rank and the
    rejections, and tells the admitted worker), and a new worker refuses an accept that does not admit it."""
    # round 1: rank 1 is admitted; keep its claim and the accept
    g1 = _Group(2, 10.0)
    g1.host()
    g1.worker(1)
    g1.wait("host", "w1")
    assert isinstance(g1.results["host"], Session) and isinstance(g1.results["w1"], Session)
    assert g1.results["host"].namespace == g1.results["w1"].namespace
    r1 = g1.round_id()
    old_claim = g1.store.get(f"auth/{r1}/claim/1")
    # an old accept by a new worker: rank 1 comes again to the same round, whose accept admits another nonce
    g1.worker(1, "late")
    g1.wait("late")
    assert isinstance(g1.results["late"], AuthenticationError)
    assert "does not admit this worker's claim" in str(g1.results["late"])

    # round 2 (world 3): rank 1 is admitted, rank 2 never comes; a rogue re-posts round 1's claim (stale) and
    # rank 1's admitted claim (duplicate) over and over
    g2 = _Group(3, 3.0)
    rec = _Records()
    logging.getLogger("weightsync.auth").addHandler(rec)
    try:
        t0 = time.monotonic()
        g2.host()
        r2 = g2.round_id()
        g2.worker(1)
        rogue_store = g2.client()
        stop = threading.Event()

        def keep_reposting() -> None:
            while not stop.is_set():
                if rogue_store.check([f"auth/{r2}/claim/1"]):
                    for raw in (old_claim, rogue_store.get(f"auth/{r2}/claim/1")):
                        slot = rogue_store.add(f"auth/{r2}/claims", 1)
                        rogue_store.set(f"auth/{r2}/claim/{slot}", raw)
                time.sleep(0.05)

        threading.Thread(target=keep_reposting, daemon=True).start()
        g2.wait("host", "w1")
        stop.set()
        waited = time.monotonic() - t0
    finally:
        logging.getLogger("weightsync.auth").removeHandler(rec)
    host = g2.results["host"]
    assert isinstance(host, TransferTimeoutError) and host.missing_ranks == (2,), host
    assert 3.0 <= waited < 6.0, waited
    assert re.search(r"\d+ claim\(s\) rejected", str(host))
    assert any("stale round" in line for line in rec.lines), rec.lines
    assert any("duplicate nonce: a replay of rank 1's admitted claim" in line for line in rec.lines)
    w1 = g2.results["w1"]
    assert isinstance(w1, AuthenticationError) and "refused rank 1" in str(w1) and "rank(s) 2" in str(w1)
    # each rejected claim was answered under its slot's reject key, with the reason, signed by the host
    posted = int(g2.store.add(f"auth/{r2}/claims", 0))
    rejects = [
        strict_json(g2.store.get(f"auth/{r2}/reject/{k}"), 1 << 16, "reject")
        for k in range(1, posted + 1)
        if g2.store.check([f"auth/{r2}/reject/{k}"])
    ]
    assert rejects and any("stale round" in r["reason"] for r in rejects)
    assert all(g2.secret.verify(r["mac"], "reject", r2, r["slot"], r["reason"]) for r in rejects)

    # an old accept: round 1's accept copied into round 3 is refused by the worker of round 3
    g3 = _Group(3, 3.0)
    g3.host()
    r3 = g3.round_id()
    g3.client().set(f"auth/{r3}/accept", g1.store.get(f"auth/{r1}/accept"))
    g3.worker(1)
    g3.wait("w1")
    assert isinstance(g3.results["w1"], AuthenticationError) and "stale accept" in str(g3.results["w1"])
    g3.wait("host")


def test_a_duplicate_rank_among_secret_holders_fails_the_round_at_once() -> None:
    """Two workers holding the secret claim rank 1 (a non-bijective rank mapping, vLLM PR #36940): the host
    fails at once with the bijection error, not at its deadline."""
    g = _Group(3, 10.0)
    t0 = time.monotonic()
    g.host()
    g.worker(1, "a")
    g.worker(1, "b")
    g.wait("host")
    assert isinstance(g.results["host"], ValueError) and "not a bijection" in str(g.results["host"])
    assert time.monotonic() - t0 < 5.0


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


def test_a_verify_hmac_round_is_bit_exact() -> None:
    packing = {"verify": "hmac", "packed": True, "packed_buffer_size_bytes": 4096}
    trainer, worker = pair(SECRET, SECRET, 20.0, packing)
    assert trainer["handshake_s"] is not None and worker["bit_exact"] is True


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
