"""Multi-node on one machine: the trainer and a real ``vllm serve`` in two network namespaces joined by a
veth pair (iproute2), syncing through weightsync's broadcast backend (``weightsync``) and vLLM's own
``HTTPVLLMWeightSyncClient``. Needs root and ``ip netns`` (skipped, saying which, without them).

Namespace A holds the trainer (``tests/netns_trainer.py``), B the server (``python -m
weightsync.vllm_tools.serve``, ``VLLM_SERVER_DEV_MODE=1``); each has its loopback up and one end of the veth,
``A_ADDR`` and ``B_ADDR``, and no other interface, so every byte between them (the HTTP API on
``B_ADDR``, the rendezvous TCPStore the trainer hosts on ``A_ADDR``, gloo's connections) crosses the veth.
Both namespaces are new, so fixed ports below the ephemeral range are free in each.

Both sides hold the deployment's secret (``WEIGHTSYNC_TOKEN_FILE``, a file of mode 0600 written by
``weightsync token new``): the rendezvous is authenticated (issue 21). One test, in order:

1. **A bit-exact round over the link.** The trainer sends new weights (``step-1``); the server then
   reports that version, and its greedy tokens and prompt logprobs equal a transformers reference built
   from the weights the trainer saved as sent (which are bit-for-bit the ones the test gave it) within
   1e-4, while before the round they were far from that reference.
2. **A second trainer without the secret cannot take the engines over.** From the trainer's namespace it
   hosts its own rendezvous (``allow_unauthenticated=True``) and calls the server's unauthenticated
   ``/init_weight_transfer_engine``: the engine's worker, which holds the secret, refuses the trainer with
   an ``AuthenticationError`` at once, the second trainer's init fails, and the server keeps its weights,
   its version and its group with the legitimate trainer (the next round, below, runs on that group).
3. **The link cut mid-round.** In the next round the trainer's weight source stops with half of its
   tensors pulled (inside ``update_weights``, so the worker is waiting on the trainer's next bucket); the
   test sets B's veth end down (A's end keeps its address, so the trainer still reaches the store it
   hosts), then lets the trainer go on. Each side must report a ``TransferTimeoutError`` naming the
   other's rank within ``TIMEOUT_S`` (the init info's ``timeout_s``) plus ``MARGIN_S`` of the cut, never
   hang: the trainer the exception ``send_weights`` raised (missing rank 1, the engine worker), the server
   in its log its worker's error (missing rank 0, the trainer, whose TCPStore stopped answering), the
   engine's failed RPC quoting it and ``POST /update_weights`` answered 500. With the link back the server
   still answers ``/health``.

The namespaces are deleted in the fixture's teardown, and every process in them stopped first, pass or
fail. 57-102 s here, 34-59 s of it the server's start (not ``slow``: under two minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import pytest
import torch
from vllm_util import require_vllm

require_vllm()

from vllm_served import PROBES, hf_greedy, hf_prompt_logprobs  # noqa: E402
from vllm_server import ROOT, Server  # noqa: E402

from weightsync.impl.transfer.control import STORE_GRACE_S  # noqa: E402
from weightsync.impl.transfer.secret import TOKEN_ENV, TOKEN_FILE_ENV, write_token  # noqa: E402
from weightsync.vllm_tools.models import build_tiny_llama, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ci, pytest.mark.timeout(360)]

A_ADDR, B_ADDR = "10.231.0.1", "10.231.0.2"
SERVE_PORT, MASTER_PORT = 8000, 29500
#: the init info's ``timeout_s``: every wait of the transfer, on both sides, seconds
TIMEOUT_S = 10.0
#: how much later than ``TIMEOUT_S`` after the cut each side may report, seconds (the store-call grace of
#: 1 s, process and log latency on a loaded 2-core machine)
MARGIN_S = 8.0
HEALTH = (
    "import sys, urllib.request\n"
    "try:\n"
    "    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class VethPair:
    """Namespaces ``a`` and ``b`` joined by the veth ``va`` (in a, ``A_ADDR``) -- ``vb`` (in b,
    ``B_ADDR``), loopback up in both. Names carry this process's id, so parallel runs do not meet.

    Raises:
        RuntimeError: an ``ip`` command failed (its stderr).
    """

    def __init__(self) -> None:
        tag = f"ws{os.getpid() % 100000}"
        self.a, self.b, self.va, self.vb = f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb"

    def create(self) -> None:
        self.run("netns", "add", self.a)
        self.run("netns", "add", self.b)
        self.run(
            "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb, "netns", self.b
        )
        for ns, dev, addr in ((self.a, self.va, A_ADDR), (self.b, self.vb, B_ADDR)):
            self.run("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self.run("-n", ns, "link", "set", "lo", "up")
            self.run("-n", ns, "link", "set", dev, "up")

    @staticmethod
    def run(*args: str) -> str:
        r = _ip(*args)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def exec(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def set_b(self, state: str) -> None:
        """Set B's end of the veth ``up`` or ``down`` (down: A's end loses its carrier; nothing crosses)."""
        self.run("-n", self.b, "link", "set", self.vb, state)

    def healthy_from_a(self, url: str) -> bool:
        """``GET url/health`` answered 200, asked from namespace A (over the veth)."""
        cmd = [*self.exec(self.a), sys.executable, "-c", HEALTH, f"{url}/health"]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def get_from_a(self, url: str) -> Any:
        """``GET url``'s JSON, asked from namespace A (over the veth)."""
        code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
        cmd = [*self.exec(self.a), sys.executable, "-c", code, url]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout)

    def close(self) -> None:
        """Delete both namespaces (and with them the veth); idempotent."""
        for ns in (self.a, self.b):
            _ip("netns", "del", ns)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` for network namespaces"
    probe = f"wsprobe{os.getpid() % 100000}"
    r = _ip("netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def veth() -> Iterator[VethPair]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    pair = VethPair()
    try:
        pair.create()
        yield pair
    finally:
        pair.close()
        left = _ip("netns", "list").stdout
        assert pair.a not in left and pair.b not in left, left


class Events:
    """JSON lines of a process's stdout, read on a thread, waited for with a deadline."""

    def __init__(self, stream: IO[str], stderr_log: pathlib.Path) -> None:
        self.q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr_log = stderr_log
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("{"):
                self.q.put(json.loads(line))

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            tail = "\n".join(self.stderr_log.read_text(errors="replace").splitlines()[-30:])
            raise AssertionError(f"the trainer reported nothing within {timeout:.0f} s:\n{tail}") from None


def _hf_with(model: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model.load_state_dict(state)
    return {
        "greedy": [hf_greedy(model, p) for p in PROBES],
        "prompt_logprobs": [hf_prompt_logprobs(model, p) for p in PROBES],
    }


def _worst(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


#: the server reporting the cut, at each level: its worker's TransferTimeoutError naming rank 0 (the
#: trainer), the engine's failed RPC quoting it, and the HTTP route's error status
SERVER_ERRORS = {
    "worker": re.compile(
        r"TransferTimeoutError: (update_weights/\S+): timed out after ([\d.]+) s waiting for rank\(s\) 0 \((.*)\)"
    ),
    "rpc": re.compile(
        r"RuntimeError: Worker failed with error 'update_weights/\S+: timed out .* rank\(s\) 0 "
    ),
    "http": re.compile(r'"POST /update_weights HTTP/1\.1" 500'),
}


def test_round_and_a_cut_link_across_two_network_namespaces(veth: VethPair, tmp_path: pathlib.Path) -> None:
    hf = build_tiny_llama(tmp_path / "model")
    new1 = perturbed_state(hf, seed=5, scale=0.5)
    torch.save(new1, tmp_path / "new1.pt")
    torch.save(perturbed_state(hf, seed=6, scale=0.5), tmp_path / "new2.pt")
    url = f"http://{B_ADDR}:{SERVE_PORT}"
    log = tmp_path / "serve.log"
    token = write_token(tmp_path / "deployment.token")  # mode 0600; both sides read it themselves
    server = Server(
        tmp_path / "model",
        log,
        host=B_ADDR,
        port=SERVE_PORT,
        netns=veth.b,
        healthy=lambda: veth.healthy_from_a(url),
        env_extra={TOKEN_FILE_ENV: str(token)},
    )
    print(f"\nvllm serve in {veth.b} healthy from {veth.a} after {server.start_s:.1f} s")
    trainer_log = tmp_path / "trainer.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop(TOKEN_ENV, None)
    rogue_env = {k: v for k, v in env.items() if k != TOKEN_FILE_ENV}
    env[TOKEN_FILE_ENV] = str(token)
    argv = [sys.executable, str(ROOT / "tests" / "netns_trainer.py"), url, str(tmp_path / "model")]
    argv += [str(tmp_path), A_ADDR, str(MASTER_PORT), str(TIMEOUT_S)]
    trainer: subprocess.Popen[str] | None = None
    try:
        with trainer_log.open("w") as err:
            trainer = subprocess.Popen(
                [*veth.exec(veth.a), *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        assert trainer.stdin is not None and trainer.stdout is not None
        events = Events(trainer.stdout, trainer_log)

        # 1. a bit-exact round over the veth
        ev = events.next(180)
        assert ev["event"] == "round", ev
        sent = torch.load(tmp_path / "sent1.pt")
        assert sent.keys() == new1.keys()
        assert all(torch.equal(sent[n], new1[n]) for n in new1)  # the trainer sent exactly new1
        old = _hf_with(hf, {n: p.detach().clone() for n, p in hf.named_parameters()})
        ref = _hf_with(hf, sent)
        assert ev["version"] == {"weight_version": "step-1"}
        assert ev["after"]["greedy"] == ref["greedy"]
        worst = _worst(ev["after"]["prompt_logprobs"], ref["prompt_logprobs"])
        assert worst <= 1e-4, worst
        # the check can fail: before the round the server served other weights, far from the reference
        assert ev["before"]["greedy"] == old["greedy"]
        assert _worst(ev["before"]["prompt_logprobs"], ref["prompt_logprobs"]) > 1e-2
        print(
            f"round over the veth: {ev['round_s']:.2f} s (pause + send_weights + resume); logprob diff {worst:.1e}"
        )

        # 2. a second trainer in A without the secret tries to make the engines join its group
        rogue_argv = [
            sys.executable,
            str(ROOT / "tests" / "netns_rogue.py"),
            url,
            A_ADDR,
            str(MASTER_PORT + 1),
        ]
        t_rogue = time.monotonic()
        rogue = subprocess.run(
            [*veth.exec(veth.a), *rogue_argv, str(TIMEOUT_S)],
            capture_output=True,
            text=True,
            timeout=120,
            env=rogue_env,
        )
        rogue_s = time.monotonic() - t_rogue
        lines = [json.loads(x) for x in rogue.stdout.splitlines() if x.startswith("{")]
        assert lines and lines[-1]["joined"] is False, (rogue.stdout, rogue.stderr[-3000:])
        refused = re.search(
            r"AuthenticationError: init_weight_transfer_engine: this worker holds a secret \(WEIGHTSYNC_TOKEN_FILE=",
            log.read_text(errors="replace"),
        )
        assert refused, server.tail(60)
        assert veth.get_from_a(f"{url}/weight_info") == {"weight_version": "step-1"}
        print(
            f"second trainer without the secret refused in {rogue_s:.1f} s: {lines[-1]['type']}: {refused.group(0)}"
        )
        trainer.stdin.write("go\n")
        trainer.stdin.flush()

        # 3. the link cut while update_weights streams (on the group the second trainer could not replace)
        ev = events.next(120)
        assert ev["event"] == "mid-round", ev
        veth.set_b("down")
        t_cut = time.monotonic()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        deadline = t_cut + TIMEOUT_S + MARGIN_S
        trainer_ev: dict[str, Any] | None = None
        seen: dict[str, tuple[float, re.Match[str]]] = {}  # level -> (seconds after the cut, match)
        while (trainer_ev is None or len(seen) < len(SERVER_ERRORS)) and time.monotonic() < deadline:
            if trainer_ev is None:
                with contextlib.suppress(queue.Empty):
                    trainer_ev = events.q.get(timeout=0.1)
            text = log.read_text(errors="replace")
            for level, pattern in SERVER_ERRORS.items():
                if level not in seen and (m := pattern.search(text)):
                    seen[level] = (time.monotonic() - t_cut, m)
            time.sleep(0.05)
        assert trainer_ev is not None, f"trainer: no error within {TIMEOUT_S + MARGIN_S} s of the cut"
        assert seen.keys() == SERVER_ERRORS.keys(), (
            f"server: only {sorted(seen)} of {sorted(SERVER_ERRORS)} within {TIMEOUT_S + MARGIN_S} s of the "
            f"cut:\n{server.tail(60)}"
        )

        # trainer side: the exception send_weights raised names the engine worker, rank 1
        assert trainer_ev["event"] == "error", trainer_ev
        assert trainer_ev["type"] == "TransferTimeoutError", trainer_ev
        assert trainer_ev["missing_ranks"] == [1], trainer_ev
        assert trainer_ev["phase"].startswith("update_weights/"), trainer_ev
        assert "waiting for rank(s) 1 " in trainer_ev["message"], trainer_ev
        assert f"timeout {TIMEOUT_S:g} s: init_info['timeout_s']" in trainer_ev["message"], trainer_ev
        trainer_s = trainer_ev["raised_at"] - t_cut
        # it waited for its deadline (it resumed after the cut), and not much longer
        assert TIMEOUT_S * 0.9 <= trainer_s < TIMEOUT_S + MARGIN_S, trainer_s
        # server side: the worker's update_weights names the trainer, rank 0, having waited at most its
        # deadline (plus the store-call grace, should the cut find it in the end status exchange). At the cut
        # it is waiting for the trainer's next bucket, whose header and payload travel on the group itself
        # (broadcast rule 3), so the wait that times out is a broadcast from rank 0
        worker_s, worker = seen["worker"]
        assert worker_s < TIMEOUT_S + MARGIN_S and seen["http"][0] < TIMEOUT_S + MARGIN_S, seen
        assert float(worker.group(2)) <= TIMEOUT_S + STORE_GRACE_S + 0.5, worker.group(0)
        assert worker.group(1) in ("update_weights/bucket", "update_weights/broadcast"), worker.group(0)
        assert "rank 1's part of a broadcast from rank 0 (the trainer)" in worker.group(
            3
        ) or "rank 0's TCPStore (the trainer hosts it) did not answer rank 1" in worker.group(3), (
            worker.group(0)
        )
        print(f"trainer after the cut: {trainer_s:.1f} s: {trainer_ev['type']}: {trainer_ev['message']}")
        for level, (secs, m) in seen.items():
            print(f"server ({level}) after the cut: within {secs:.1f} s: {m.group(0)}")

        # with the link back the server answers again: it did not hang either
        veth.set_b("up")
        t0 = time.monotonic()
        while not veth.healthy_from_a(url):
            assert time.monotonic() - t0 < 30, f"no /health after the link came back:\n{server.tail()}"
            time.sleep(0.5)
    finally:
        if trainer is not None:
            if trainer.poll() is None:
                trainer.kill()
            trainer.wait(10)
        rc = server.stop()
        print(f"server stopped (rc {rc}); trainer rc {None if trainer is None else trainer.returncode}")
