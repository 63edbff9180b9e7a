"""Multi-process tests of the broadcast transport (gloo on 127.0.0.1): trainer rank 0 + engine workers.

Acceptance 1-3 of issue 3 for the broadcast backend, and the public data-plane bugs it guards against
(a trainer/engine wire mismatch hanging silently, TRL PR #7104 and SkyRL PR #2114; a failed peer; a timeout).
"""

from __future__ import annotations

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
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine as Engine
from weightsync.impl.transfer.worker import WeightTransferWorker

pytestmark = pytest.mark.timeout(120)

#: Packing plans (vLLM 0.32: the packing parameters are init_info's, fixed per group: each plan is a group of
#: its own, on its own port; the workers re-run init_weight_transfer_engine, the trainer opens a new endpoint).
PLANS: list[dict[str, Any]] = [
    # several buckets; the two largest tensors exceed the 4 KiB buffer and travel on their own
    {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2},
    # per-tensor (vLLM's unpacked path)
    {"packed": False},
    # one bucket, one buffer, with per-bucket CRC32
    {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 1, "verify": True},
    # tiny buffers, three slots, and the round split over two update_weights calls
    {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 3, "split": True},
]


def _packing(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "split"}


def _halves(pairs: list[Any], plan: dict[str, Any]) -> list[list[Any]]:
    if plan.get("split"):
        return [pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]]
    return [pairs]


# ---------------------------------------------------------------------------------------------- roles


def trainer_rounds(ports: list[int], world: int, plans: list[dict[str, Any]]) -> list[int]:
    pools = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        tr = BroadcastTrainer(init_info(port, world, **_packing(plan)))
        try:
            for part in _halves(make_tensors(r), plan):
                tr.send(iter(part))
            pools.append(tr.pool_bytes)
        finally:
            tr.close()
    return pools


def engine_rounds(ports: list[int], world: int, dp_index: int, plans: list[dict[str, Any]]) -> dict[str, Any]:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    rounds = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        w.init_weight_transfer_engine(init_info(port, world, **_packing(plan)))
        w.start_weight_update()
        for part in _halves(make_tensors(r), plan):
            w.update_weights(update_info_for(part))
        w.finish_weight_update()
        rounds.append(model.weights())
    w.shutdown()
    return {"rank": w.rank, "version": w.weight_version, "rounds": rounds, "processed": model.processed}


def trainer_send_once(
    port: int, world: int, packing: dict[str, Any], timeout_s: float = 20.0, **kw: Any
) -> float:
    tr = BroadcastTrainer(init_info(port, world, timeout_s, **packing))
    t0 = time.monotonic()
    try:
        pairs = kw.get("pairs") or make_tensors(0)
        tr.send(iter(pairs))
    finally:
        tr.close()
    return time.monotonic() - t0


def engine_update_once(
    port: int,
    world: int,
    dp_index: int,
    info: dict[str, Any],
    spec: Any = None,
    timeout_s: float = 20.0,
    packing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    model = DictModel(spec or model_spec())
    before = model.weights()
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, timeout_s, **(packing or {})))
    w.start_weight_update()
    t0 = time.monotonic()
    try:
        w.update_weights(info)
    finally:
        elapsed = time.monotonic() - t0
        unchanged = all(bytes_equal(before[n], t) for n, t in model.weights().items())
        print(f"elapsed={elapsed:.2f} unchanged={unchanged}")
    return {"elapsed": elapsed}


def engine_init_only(port: int, world: int, parallel: ParallelInfo, timeout_s: float = 20.0) -> int | None:
    w = WeightTransferWorker(DictModel(model_spec()), "nccl", parallel)
    w.init_weight_transfer_engine(init_info(port, world, timeout_s))
    return w.rank


def trainer_init_only(port: int, world: int, timeout_s: float = 20.0) -> str:
    tr = BroadcastTrainer(init_info(port, world, timeout_s))
    tr.close()
    return "joined"


def engine_fail_midway(port: int, world: int, dp_index: int, fail: bool) -> str:
    model = DictModel(model_spec(), fail_on="model.layers.0.positions" if fail else None)
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, **PLANS[0]))
    w.start_weight_update()
    w.update_weights(update_info_for(make_tensors(0)))
    return "finished"


# ---------------------------------------------------------------------------------------------- tests


def test_bit_exact_packed_unpacked_several_rounds_and_dp2_rank_mapping() -> None:
    """Acceptance 1 (broadcast) + B1: DP=2, TP=1, world 3, offset 1 -> ranks {1, 2}."""
    ports, world = [free_port() for _ in PLANS], 3
    res = run_roles(
        [
            (trainer_rounds, (ports, world, PLANS)),
            (engine_rounds, (ports, world, 0, PLANS)),
            (engine_rounds, (ports, world, 1, PLANS)),
        ]
    )
    pools = ok(res[0])
    engines = [ok(r) for r in res[1:]]
    assert sorted(e["rank"] for e in engines) == [1, 2]
    for e in engines:
        assert e["version"] == len(PLANS) and e["processed"] == len(PLANS)
        for r, weights in enumerate(e["rounds"]):
            for name, sent in make_tensors(r):
                assert bytes_equal(weights[name], sent.contiguous()), (r, name)
    # packing buffers: at most num_buffers * B (oversized tensors never enter them)
    for plan, pool in zip(PLANS, pools, strict=True):
        if plan.get("packed"):
            assert pool <= plan["packed_num_buffers"] * plan["packed_buffer_size_bytes"]


def test_b1_non_bijective_rank_mapping_rejected_at_init() -> None:
    """B1 (vLLM #36932): both engines compute rank 1 (DP rank forced to 0) -> every rank raises ValueError."""
    port, world = free_port(), 3
    res = run_roles(
        [
            (trainer_init_only, (port, world)),
            (engine_init_only, (port, world, ParallelInfo(dp_index=0))),
            (engine_init_only, (port, world, ParallelInfo(dp_index=0))),
        ]
    )
    for r in res:
        msg, _ = err(r, "ValueError")
        assert "rank(s) [1] claimed by more than one worker" in msg and "rank(s) [2] by none" in msg


def test_b5_mismatched_buffer_size_raises_wire_mismatch_on_every_rank_within_seconds() -> None:
    """B5 / TRL PR #7104: trainer packs 64 MiB, engines 32 MiB, five 20 MiB tensors -> WireMismatchError."""
    port, world = free_port(), 3
    spec = {f"w{i}": (torch.uint8, (20 << 20,)) for i in range(5)}
    pairs = [(n, torch.empty(1, dtype=d).expand(s)) for n, (d, s) in spec.items()]
    # a hand-made init_info: a trainer_init-built one carries the trainer's own packing to the workers
    engines = {"packed": True, "packed_buffer_size_bytes": 32 << 20, "packed_num_buffers": 2}
    trainer = {"packed": True, "packed_buffer_size_bytes": 64 << 20, "packed_num_buffers": 2}
    info = update_info_for(pairs)
    t0 = time.monotonic()
    res = run_roles(
        [
            (_trainer_send_pairs, (port, world, trainer, spec)),
            (engine_update_once, (port, world, 0, info, spec, 20.0, engines)),
            (engine_update_once, (port, world, 1, info, spec, 20.0, engines)),
        ]
    )
    assert time.monotonic() - t0 < 30
    for r in res:
        msg, _ = err(r, "WireMismatchError")
        assert "packed_buffer_size_bytes: 67108864 vs 33554432" in msg
        assert "rank 1 differs from rank 0" in msg and "rank 2 differs from rank 0" in msg


def _trainer_send_pairs(port: int, world: int, packing: dict[str, Any], spec: Any) -> float:
    pairs = [(n, torch.empty(s, dtype=d)) for n, (d, s) in spec.items()]
    return trainer_send_once(port, world, packing, pairs=pairs)


def test_packed_flag_mismatch_is_a_wire_mismatch() -> None:
    """SkyRL PR #2114: ``packed`` differs between trainer and engines."""
    port, world = free_port(), 2
    info = update_info_for(make_tensors(0))
    res = run_roles(
        [
            (trainer_send_once, (port, world, {"packed": True})),
            (engine_update_once, (port, world, 0, info, None, 20.0, {"packed": False})),
        ]
    )
    for r in res:
        msg, _ = err(r, "WireMismatchError")
        assert "at packed: True vs False" in msg


def test_b17_dtype_mismatch_rejected_before_the_collective() -> None:
    """B17 (OpenRLHF #1349): update declares fp32 for a bf16 weight -> the engine vetoes, nothing moves."""
    port, world = free_port(), 3
    pairs = make_tensors(0)
    info = update_info_for(pairs)
    i = info["names"].index("model.layers.0.self_attn.q_proj.weight")
    info["dtype_names"][i] = "float32"
    res = run_roles(
        [
            (trainer_send_once, (port, world, {})),
            (engine_update_once, (port, world, 0, info)),
            (engine_update_once, (port, world, 1, info)),
        ]
    )
    msg, _ = err(res[0], "WireMismatchError")
    assert "rank(s) 1, 2 rejected the update before any payload moved" in msg
    for r in res[1:]:
        msg, _ = err(r, "ValueError")
        assert (
            "'model.layers.0.self_attn.q_proj.weight' declared as float32 but the model holds bfloat16" in msg
        )


def test_per_bucket_status_makes_every_rank_abort_together() -> None:
    """checkpoint-engine's pattern: rank 2's load fails mid-round -> rank 2 raises its error, others name it."""
    port, world = free_port(), 3
    res = run_roles(
        [
            (trainer_send_once, (port, world, PLANS[0])),
            (engine_fail_midway, (port, world, 0, False)),
            (engine_fail_midway, (port, world, 1, True)),
        ]
    )
    msg, _ = err(res[2], "RuntimeError")
    assert "injected load failure" in msg
    for r in res[:2]:
        msg, attrs = err(r, "PeerFailedError")
        assert attrs["ranks"] == (2,) and "injected load failure" in msg


def test_peer_never_joins_times_out_naming_the_missing_rank() -> None:
    """A worker (rank 2) never starts: trainer and rank 1 raise TransferTimeoutError naming rank 2."""
    port, world, timeout = free_port(), 3, 2.0
    t0 = time.monotonic()
    res = run_roles(
        [
            (trainer_init_only, (port, world, timeout)),
            (engine_init_only, (port, world, ParallelInfo(0), timeout)),
        ]
    )
    for r in res:
        _msg, attrs = err(r, "TransferTimeoutError")
        assert attrs["missing_ranks"] == (2,) and attrs["phase"] == "rendezvous"
        assert attrs["seconds"] <= timeout + 1
    assert time.monotonic() - t0 < 30


def test_port_in_use() -> None:
    import socket

    from weightsync.impl.transfer.base import PortInUseError

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(PortInUseError, match=f"master_port {port} on 127.0.0.1 is already in use"):
            BroadcastTrainer(init_info(port, 2, 2.0))
    finally:
        s.close()


def test_trainer_missing_means_rank0_timeout() -> None:
    """A worker whose trainer never hosts the store raises TransferTimeoutError naming rank 0."""
    from weightsync.spec.errors import TransferTimeoutError

    w = WeightTransferWorker(DictModel(model_spec()), "nccl")
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError) as ei:
        w.init_weight_transfer_engine(init_info(free_port(), 2, 1.0))
    assert ei.value.missing_ranks == (0,) and time.monotonic() - t0 < 15
    # a failed join leaves the worker uninitialised: start is still illegal
    from weightsync.spec.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        w.start_weight_update()


# ------------------------------------------------------------------------------------- flat trainer


def trainer_flat_rounds(ports: list[int], world: int, plans: list[dict[str, Any]]) -> list[int]:
    pools = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        tr = BroadcastTrainer(init_info(port, world, **_packing(plan)))
        try:
            pairs, owner = flat_tensors(r)
            tr.send(iter(pairs))
            pools.append(tr.pool_bytes)
            del owner
        finally:
            tr.close()
    return pools


def engine_flat_rounds(ports: list[int], world: int, dp_index: int, plans: list[dict[str, Any]]) -> list[Any]:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    rounds = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        w.init_weight_transfer_engine(init_info(port, world, **_packing(plan)))
        w.start_weight_update()
        w.update_weights(update_info_for(make_tensors(r)))
        w.finish_weight_update()
        rounds.append(model.weights())
    w.shutdown()
    return rounds


FLAT_PLANS: list[dict[str, Any]] = [
    {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2},
    {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 1, "verify": True},
    {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 3},
]


def test_flat_trainer_is_sent_without_packing_and_bit_exact() -> None:
    """Packing rule 7 end to end: a trainer whose parameters are views of one flat buffer (plus one
    non-contiguous tensor, which is packed) arrives bit-exact on both engines, several rounds."""
    ports, world = [free_port() for _ in FLAT_PLANS], 3
    res = run_roles(
        [
            (trainer_flat_rounds, (ports, world, FLAT_PLANS)),
            (engine_flat_rounds, (ports, world, 0, FLAT_PLANS)),
            (engine_flat_rounds, (ports, world, 1, FLAT_PLANS)),
        ]
    )
    ok(res[0])
    for rounds in (ok(r) for r in res[1:]):
        for r, weights in enumerate(rounds):
            for name, sent in make_tensors(r):
                assert bytes_equal(weights[name], sent.contiguous()), (r, name)


def trainer_flat_pool(port: int, world: int) -> int:
    tr = BroadcastTrainer(init_info(port, world, packed=True, packed_buffer_size_bytes=4096))
    try:
        skip = [n for n, t in make_tensors(0) if not t.is_contiguous()]
        pairs, owner = flat_tensors(0, skip=skip)
        tr.send(iter(pairs))
        del owner
        return tr.pool_bytes
    finally:
        tr.close()


def engine_flat_pool(port: int, world: int, dp_index: int) -> dict[str, torch.Tensor]:
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in make_tensors(0) if t.is_contiguous()}
    model = DictModel(spec)
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, packed=True, packed_buffer_size_bytes=4096))
    pairs = [(n, t) for n, t in make_tensors(0) if t.is_contiguous()]
    w.start_weight_update()
    w.update_weights(update_info_for(pairs))
    w.finish_weight_update()
    w.shutdown()
    return model.weights()


def test_fully_flat_trainer_needs_no_packing_buffer() -> None:
    port, world = free_port(), 3
    res = run_roles(
        [
            (trainer_flat_pool, (port, world)),
            (engine_flat_pool, (port, world, 0)),
            (engine_flat_pool, (port, world, 1)),
        ]
    )
    assert ok(res[0]) == 0
    for weights in (ok(r) for r in res[1:]):
        for name, sent in make_tensors(0):
            if sent.is_contiguous():
                assert bytes_equal(weights[name], sent), name


# ----------------------------------------------------------------------------- receive in place (rule 5)


def _kernel_pairs(r: int, contiguous_only: bool) -> list[tuple[str, torch.Tensor]]:
    return [(n.replace(".", "__"), t) for n, t in make_tensors(r) if t.is_contiguous() or not contiguous_only]


def trainer_kernel_rounds(ports: list[int], world: int, plans: list[dict[str, Any]], flat: bool) -> None:
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        tr = BroadcastTrainer(init_info(port, world, **_packing(plan)))
        try:
            tr.send(iter(_kernel_pairs(r, flat)))
        finally:
            tr.close()


def engine_kernel_rounds(
    ports: list[int], world: int, dp_index: int, plans: list[dict[str, Any]], arena: bool
) -> list[Any]:
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in make_tensors(0) if t.is_contiguous() or not arena}
    model = DictModel(spec, arena=arena)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    rounds = []
    for r, (port, plan) in enumerate(zip(ports, plans, strict=True)):
        # kernel format is an init_info option (vLLM 0.32's start_weight_update() takes no argument)
        w.init_weight_transfer_engine(init_info(port, world, is_checkpoint_format=False, **_packing(plan)))
        w.start_weight_update()
        w.update_weights(update_info_for(_kernel_pairs(r, arena)))
        w.finish_weight_update()
        assert isinstance(w.engine, Engine) and w.engine.group is not None
        rounds.append((model.weights(), w.engine.group.pool.nbytes))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # parameters never moved
    w.shutdown()
    return rounds


KERNEL_PLANS: list[dict[str, Any]] = [
    {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2},
    {"packed": False},
    {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 3, "verify": True},
]


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "separate"])
def test_kernel_format_receives_in_place(arena: bool) -> None:
    """Broadcast rule 5: in kernel format the engine receives straight into its parameters. An engine
    whose parameters lie in one arena in the trainer's order needs no staging buffer at all (pool 0
    bytes) until ``verify=True`` forces staging; separately allocated parameters are staged for
    multi-tensor buckets. Bit-exact in every round, and no parameter's storage moves."""
    ports, world = [free_port() for _ in KERNEL_PLANS], 3
    res = run_roles(
        [
            (trainer_kernel_rounds, (ports, world, KERNEL_PLANS, arena)),
            (engine_kernel_rounds, (ports, world, 0, KERNEL_PLANS, arena)),
            (engine_kernel_rounds, (ports, world, 1, KERNEL_PLANS, arena)),
        ]
    )
    ok(res[0])
    for rounds in (ok(r) for r in res[1:]):
        for r, (weights, _) in enumerate(rounds):
            for name, sent in make_tensors(r):
                if name in weights:
                    assert bytes_equal(weights[name], sent.contiguous()), (r, name)
        pools = [pool for _, pool in rounds]
        if arena:
            assert pools[0] == 0 and pools[1] == 0 and pools[2] > 0, pools
        else:
            assert pools[0] > 0, pools
