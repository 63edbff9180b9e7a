"""Multi-process tests of the IPC transport: CPU shared memory between a producer and two consumers.

Acceptance 1 (IPC on CPU) and scenario B7 (slime #929: an ack implies the copy is complete); CUDA IPC
tests are marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from transfer_procs import (
    DictModel,
    bytes_equal,
    err,
    flat_tensors,
    free_port,
    init_info,
    make_tensors,
    model_spec,
    ok,
    run_roles,
    update_info_for,
)

from weightsync.impl.transfer.base import ParallelInfo
from weightsync.impl.transfer.ipc import IPCTrainer
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine as Engine
from weightsync.impl.transfer.ipc_handles import import_handles
from weightsync.impl.transfer.worker import WeightTransferWorker

pytestmark = pytest.mark.timeout(120)

#: Packing plans: vLLM 0.32 fixes them at init, so each plan is a group of its own (its own port).
PLANS: list[dict[str, Any]] = [
    {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2},
    {"packed": False, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 1},
    {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2, "verify": True},
    {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 3},
]


def producer_rounds(ports: list[int], world: int, plans: list[dict[str, Any]]) -> dict[str, Any]:
    pools, paths = [], []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        tr = IPCTrainer(init_info(port, world, **plan))
        try:
            tr.send(iter(make_tensors(r)))
            pools.append(tr.pool_bytes)
            paths.append(sorted(s.path or "" for s in tr.slots))
        finally:
            tr.close()
    return {"pools": pools, "paths": paths, "left": [p for ps in paths for p in ps if os.path.exists(p)]}


def consumer_rounds(
    ports: list[int], world: int, dp_index: int, plans: list[dict[str, Any]]
) -> dict[str, Any]:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=dp_index), device="cpu")
    rounds = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        w.init_weight_transfer_engine(init_info(port, world, **plan))
        w.start_weight_update()
        w.update_weights(update_info_for(make_tensors(r)))
        w.finish_weight_update()
        rounds.append(model.weights())
    w.shutdown()
    return {"rank": w.rank, "version": w.weight_version, "rounds": rounds}


def test_cpu_ipc_bit_exact_several_rounds_two_consumers() -> None:
    """Acceptance 1 (IPC on CPU): mixed dtypes, non-contiguous, zero-size, larger-than-buffer, 4 rounds."""
    ports, world = [free_port() for _ in PLANS], 3
    res = run_roles(
        [
            (producer_rounds, (ports, world, PLANS)),
            (consumer_rounds, (ports, world, 0, PLANS)),
            (consumer_rounds, (ports, world, 1, PLANS)),
        ]
    )
    prod = ok(res[0])
    for c in (ok(r) for r in res[1:]):
        assert c["version"] == len(PLANS)
        for r, weights in enumerate(c["rounds"]):
            for name, sent in make_tensors(r):
                assert bytes_equal(weights[name], sent.contiguous()), (r, name)
    for plan, pool in zip(PLANS, prod["pools"], strict=True):
        assert pool <= plan["packed_num_buffers"] * plan["packed_buffer_size_bytes"]
    assert prod["left"] == []  # shared-memory files are unlinked on close


# ---------------------------------------------------------------------------------------------- B7

B7_TENSORS = {f"w{i}": (torch.float32, (256,), "plain") for i in range(4)}  # 1 KiB each
B7_PACKING = {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 1}


def producer_b7(port: int, world: int) -> list[float]:
    """One 1 KiB buffer, four 1 KiB chunks: every chunk reuses the buffer; log when each refill starts."""
    tr = IPCTrainer(init_info(port, world, **B7_PACKING))
    refills: list[float] = []
    import weightsync.impl.transfer.ipc as ipc_mod

    real_pack = ipc_mod.pack_bucket

    def logged_pack(dst: torch.Tensor, bucket: Any, tensors: Any) -> torch.Tensor:
        refills.append(time.monotonic())
        return real_pack(dst, bucket, tensors)

    ipc_mod.pack_bucket = logged_pack
    try:
        pairs = make_tensors(0, B7_TENSORS)
        tr.send(iter(pairs))
        # the producer is free to scribble on its buffer now: consumers must already hold their copies
        tr.slots[0].tensor.fill_(0xAB)
    finally:
        ipc_mod.pack_bucket = real_pack
        tr.close()
    return refills


def consumer_b7(port: int, world: int, dp_index: int, slow_s: float) -> dict[str, Any]:
    model = DictModel(model_spec(B7_TENSORS))
    model.slow_s = slow_s  # a slow consumer: each copy starts 0.1 s after it was handed the view
    w = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=dp_index), device="cpu")
    w.init_weight_transfer_engine(init_info(port, world, **B7_PACKING))
    w.start_weight_update()
    w.update_weights(update_info_for(make_tensors(0, B7_TENSORS)))
    w.finish_weight_update()
    time.sleep(0.2)  # let the producer overwrite its buffer: our weights must not change
    return {"log": model.load_log, "weights": model.weights()}


def test_b7_ack_implies_copy_complete() -> None:
    """B7 (THUDM/slime #929): the producer refills the shared buffer only after every consumer finished
    copying the chunk it held; weights stay bit-exact although each copy is slow and the buffer is reused."""
    port, world = free_port(), 3
    res = run_roles(
        [
            (producer_b7, (port, world)),
            (consumer_b7, (port, world, 0, 0.1)),
            (consumer_b7, (port, world, 1, 0.0)),
        ]
    )
    refills = ok(res[0])
    assert len(refills) == 4
    for c in (ok(r) for r in res[1:]):
        for name, sent in make_tensors(0, B7_TENSORS):
            assert bytes_equal(c["weights"][name], sent)
        done = {name: t_done for name, _, t_done in c["log"]}
        for k in range(1, 4):  # refill k happened after the copy of chunk k-1 completed on this consumer
            assert refills[k] >= done[f"w{k - 1}"]


# ----------------------------------------------------------------------------------------- bad input


def producer_once(port: int, world: int, plan: dict[str, Any]) -> str:
    tr = IPCTrainer(init_info(port, world, **plan))
    try:
        tr.send(iter(make_tensors(0)))
    finally:
        tr.close()
    return "sent"


def consumer_once(port: int, world: int, dp_index: int, plan: dict[str, Any], fail: bool) -> str:
    model = DictModel(model_spec(), fail_on="model.layers.0.positions" if fail else None)
    w = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=dp_index), device="cpu")
    w.init_weight_transfer_engine(init_info(port, world, **plan))
    w.start_weight_update()
    w.update_weights(update_info_for(make_tensors(0)))
    return "loaded"


def test_ipc_buffer_size_mismatch_and_consumer_failure() -> None:
    """TRL PR #7104 over IPC, then one consumer failing mid-round: every rank aborts, naming it."""
    port, world = free_port(), 3
    eng = {"packed": True, "packed_buffer_size_bytes": 2048, "packed_num_buffers": 2}
    res = run_roles(
        [
            (producer_once, (port, world, {**eng, "packed_buffer_size_bytes": 4096})),
            (consumer_once, (port, world, 0, eng, False)),
            (consumer_once, (port, world, 1, eng, False)),
        ]
    )
    for r in res:
        msg, _ = err(r, "WireMismatchError")
        assert "packed_buffer_size_bytes: 4096 vs 2048" in msg
    port = free_port()
    res = run_roles(
        [
            (producer_once, (port, world, eng)),
            (consumer_once, (port, world, 0, eng, False)),
            (consumer_once, (port, world, 1, eng, True)),
        ]
    )
    assert "injected load failure" in err(res[2], "RuntimeError")[0]
    for r in res[:2]:
        msg, attrs = err(r, "PeerFailedError")
        assert attrs["ranks"] == (2,) and "injected load failure" in msg


def test_ipc_handle_validation() -> None:
    """Handles are plain JSON and validated: no handle for this device, paths outside /dev/shm, bad kinds."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"no IPC handle for local device 'cpu'; handles are for: GPU-123"):
        import_handles({"GPU-123": {"kind": "cuda"}}, cpu)
    with pytest.raises(ValueError, match="is not a /dev/shm/weightsync-\\* file"):
        import_handles({"cpu": {"kind": "shm", "path": "/etc/passwd", "size": 10}}, cpu)
    with pytest.raises(ValueError, match="is not a /dev/shm/weightsync-\\* file"):
        import_handles(
            {"cpu": {"kind": "shm", "path": "/dev/shm/weightsync-../../etc/passwd", "size": 10}}, cpu
        )
    with pytest.raises(ValueError, match="size -1 must be a positive int"):
        import_handles({"cpu": {"kind": "shm", "path": "/dev/shm/weightsync-x", "size": -1}}, cpu)
    with pytest.raises(ValueError, match="unknown IPC handle kind 'pickle'"):
        import_handles({"cpu": {"kind": "pickle"}}, cpu)


# ----------------------------------------------------------------------------------------------- GPU


CUDA_PACKING = {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2}


def _cuda_producer(port: int, world: int) -> str:
    tr = IPCTrainer(init_info(port, world, **CUDA_PACKING), device="cuda")
    pairs = [(n, t.cuda()) for n, t in make_tensors(0)]
    try:
        for _ in range(2):
            tr.send(iter(pairs))
    finally:
        tr.close()
    return "sent"


def _cuda_consumer(port: int, world: int) -> dict[str, torch.Tensor]:
    model = DictModel(model_spec()).cuda()
    w = WeightTransferWorker(model, "ipc", ParallelInfo(), device="cuda")
    w.init_weight_transfer_engine(init_info(port, world, **CUDA_PACKING))
    for _ in range(2):
        w.start_weight_update()
        w.update_weights(update_info_for(make_tensors(0)))
        w.finish_weight_update()
    return {n: t.cpu() for n, t in model.weights().items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_bit_exact() -> None:
    """CUDA IPC (reduce_tensor handles keyed by GPU UUID, JSON-encoded): bit-exact after two rounds."""
    port, world = free_port(), 2
    res = run_roles([(_cuda_producer, (port, world)), (_cuda_consumer, (port, world))])
    ok(res[0])
    weights = ok(res[1])
    for name, sent in make_tensors(0):
        assert bytes_equal(weights[name], sent.contiguous()), name


# ------------------------------------------------------------------ zero-copy producer, closing race


def producer_shared(ports: list[int], world: int, plans: list[dict[str, Any]]) -> dict[str, Any]:
    pools, paths = [], []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        tr = IPCTrainer(init_info(port, world, **plan))
        try:
            if r == 0:  # first call fully shared (no packing buffer at all), then the non-contiguous rest
                rest = [(n, t) for n, t in make_tensors(r) if not t.is_contiguous()]
                shared, owner = flat_tensors(r, shared=True, skip=[n for n, _ in rest])
                tr.send(iter(shared))
                pools.append(tr.pool_bytes)
                tr.send(iter(rest))
            else:
                pairs, owner = flat_tensors(r, shared=True)
                tr.send(iter(pairs))
            paths.append(owner.path)
            owner.close()
        finally:
            tr.close()  # right after the last send: consumers may still be reading the verdict
    return {"pools": pools, "left": [p for p in paths if os.path.exists(p)]}


def consumer_shared(
    ports: list[int], world: int, dp_index: int, plans: list[dict[str, Any]], late_s: float
) -> list[dict[str, torch.Tensor]]:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=dp_index), device="cpu")
    rounds = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        w.init_weight_transfer_engine(init_info(port, world, **plan))
        eng = w.engine
        assert isinstance(eng, Engine) and eng.cp is not None
        cp = eng.cp
        plain_get = cp.get

        def late_get(key: str, phase: str, rank: int, plain: Any = plain_get, first: bool = r == 0) -> Any:
            if key.endswith("/done") and first:
                time.sleep(late_s)  # a consumer slow to read the verdict after its last ack (first round)
            return plain(key, phase, rank)

        cp.get = late_get  # type: ignore[method-assign]
        pairs = make_tensors(r)
        names = [n for n, t in pairs if t.is_contiguous()] if r == 0 else [n for n, _ in pairs]
        w.start_weight_update()
        w.update_weights(update_info_for([p for p in pairs if p[0] in names]))
        if r == 0:
            w.update_weights(update_info_for([p for p in pairs if p[0] not in names]))
        w.finish_weight_update()
        rounds.append(model.weights())
    w.shutdown()
    return rounds


SHARED_PLANS: list[dict[str, Any]] = [
    {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2},
    {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 1, "verify": True},
    {"packed": False, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 1},
]


def test_cpu_ipc_zero_copy_from_shared_trainer_tensors_and_close_waits_for_readers() -> None:
    """IPC rule 5: tensors in a SharedBuffer are handed out by (handle, offset), bit-exact, with no
    packing buffer when all are shared; rule 6: closing right after the last send waits for a consumer
    still reading the verdict (it used to lose the store after 5 s: DistNetworkError; one consumer reads it
    6 s late in the first round)."""
    ports, world = [free_port() for _ in SHARED_PLANS], 3
    res = run_roles(
        [
            (producer_shared, (ports, world, SHARED_PLANS)),
            (consumer_shared, (ports, world, 0, SHARED_PLANS, 0.0)),
            (consumer_shared, (ports, world, 1, SHARED_PLANS, 6.0)),
        ],
        deadline_s=90.0,
    )
    prod = ok(res[0])
    assert prod["left"] == [] and prod["pools"] == [0]
    for rounds in (ok(r) for r in res[1:]):
        for r, weights in enumerate(rounds):
            for name, sent in make_tensors(r):
                assert bytes_equal(weights[name], sent.contiguous()), (r, name)
