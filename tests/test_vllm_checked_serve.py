"""CheckedEngine around a real ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``, backend ``weightsync``) through
``HTTPServerAdapter``: an ``update_weights`` while serving and a second ``start_weight_update`` are refused
and never reach the server (its access log has no such request), a checked keep-round from a trainer on
vLLM's public factory passes through, and the trace replays. Marked slow: the server takes 30-60 s to start
here (the in-process ``AsyncLLM`` path is in the default suite: ``test_vllm_checked.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_util import CPU_ENV, require_vllm

require_vllm()

from transfer_procs import free_port  # noqa: E402
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from weightsync.cli import main  # noqa: E402
from weightsync.spec.errors import LocalProtocolError  # noqa: E402
from weightsync.vllm.trainer import WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.vllm_tools.checked import checked_http  # noqa: E402
from weightsync.vllm_tools.models import build_tiny_llama, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]
LAUNCH = Path(__file__).with_name("vllm_serve_launch.py")


class Server:
    def __init__(self, tmp: Path) -> None:
        self.hf = build_tiny_llama(str(tmp / "model"), seed=0)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        env = {**os.environ, **CPU_ENV, "VLLM_SERVER_DEV_MODE": "1"}
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        cmd = [sys.executable, str(LAUNCH), "serve", str(tmp / "model"), "--port", str(self.port)]
        cmd += ["--enforce-eager", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8"]
        cmd += ["--weight-transfer-config", json.dumps({"backend": "weightsync"})]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        while time.monotonic() - t0 < 240:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/is_paused", timeout=2) as r:
                    json.loads(r.read())
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError("vllm serve did not come up in 240 s")
        self.start_s = time.monotonic() - t0

    def posts(self, route: str) -> int:
        """POST requests to ``route`` in the server's access log (what reached vLLM's HTTP front-end)."""
        return sum(1 for line in self.log.read_text().splitlines() if f'"POST {route}' in line)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("serve"))
    print(f"\nvllm serve start: {s.start_s:.1f} s")
    try:
        yield s
    finally:
        s.close()


def wait_logged(server: Server, route: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while server.posts(route) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_checked_vllm_serve_refuses_before_the_server_and_replays(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "serve.jsonl"
    eng = checked_http(server.url, trace_path=trace, timeout_s=120)
    client = eng  # a CheckedEngine is a VLLMWeightSyncClient: the trainer's calls are checked
    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=1 + eng.dp_size,
        rank=0,
        packed_buffer_size_bytes=96 << 10,
        timeout_s=60,
    )
    tr: Any = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(server.hf))
    try:
        names = [(n, p) for n, p in server.hf.named_parameters()][:1]
        upd = {"names": [names[0][0]], "dtype_names": ["float32"], "shapes": [list(names[0][1].shape)]}
        with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
            client.update_weights(upd)
        eng.pause(mode="keep")
        client.start_weight_update()
        with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state updating"):
            client.start_weight_update()
        server.hf.load_state_dict(perturbed_state(server.hf, seed=5, scale=0.5))
        tr.update(server.hf)
        client.finish_weight_update("step-1")
        eng.resume()
        wait_logged(server, "/resume", 1)
        assert eng.get_weight_version() == "step-1"
        # what reached the server: one start, the trainer's updates only, all after the pause
        assert server.posts("/start_weight_update") == 1
        assert server.posts("/update_weights") == 1  # a declared source: one update_weights per round
        log = server.log.read_text()
        assert log.index('"POST /pause') < log.index('"POST /update_weights')
    finally:
        tr.shutdown()
    assert eng.violations == []
    assert main(["replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    assert out["ok"] and out["outcomes_checked"] == 2
