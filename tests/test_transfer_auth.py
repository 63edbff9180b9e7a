"""Only the holder of the deployment's secret moves weights (issue 21): the authenticated rendezvous
(:mod:`weightsync.impl.transfer.auth`) in real rounds and under replays.

Real processes and real gloo on loopback for the rounds (a rogue process in the middle of one); the replay
cases drive the host's and the workers' handshakes on one real ``TCPStore`` from threads, so a replayed
message lands exactly where the case needs it. The pieces that need no round (interface, policy, the secret,
the HMAC check, nothing unpickled) are in ``test_transfer_secret.py``.
"""

from __future__ import annotations

import logging
import pathlib
import pickle
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from transfer_procs import (
    DictModel,
    bytes_equal,
    free_port,
    init_info,
    make_tensors,
    model_spec,
    ok,
    run_roles,
    secret_env,
    update_info_for,
)

from weightsync.impl.transfer.auth import Session, host_handshake, worker_handshake
from weightsync.impl.transfer.base import AuthenticationError, ParallelInfo
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.control import ControlPlane, strict_json
from weightsync.impl.transfer.rendezvous import host_store
from weightsync.impl.transfer.secret import Secret
from weightsync.impl.transfer.worker import WeightTransferWorker
from weightsync.spec.errors import TransferTimeoutError

pytestmark = pytest.mark.timeout(120)

SECRET = "5e" * 32
OTHER = "a7" * 32
ROOT = pathlib.Path(__file__).resolve().parents[1]


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


# ------------------------------------------------------------------------------------------- integrity


def test_a_verify_hmac_round_is_bit_exact() -> None:
    packing = {"verify": "hmac", "packed": True, "packed_buffer_size_bytes": 4096}
    trainer, worker = pair(SECRET, SECRET, 20.0, packing)
    assert trainer["handshake_s"] is not None and worker["bit_exact"] is True
