"""Single-process tests of the transfer layer: parsing, registry, packing, worker call order, completeness.

Bad input of acceptance 3 (out-of-order calls, unknown backend, malformed init/update info) and scenario
B4 (vLLM PR #37334: a never-loaded buffer must not block completeness).
"""

from __future__ import annotations

import threading
import time
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
    update_info_for,
)

from weightsync.impl.transfer.base import InitInfo, UpdateInfo, WeightTransferEngine, WireArgs
from weightsync.impl.transfer.broadcast import BroadcastTrainer, BroadcastWeightTransferEngine
from weightsync.impl.transfer.packing import (
    ALIGN,
    BufferPool,
    contiguous_run,
    first_difference,
    flat_layout,
    flat_views,
    max_packed_bucket,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    wire_description,
)
from weightsync.impl.transfer.registry import WeightTransferEngineFactory
from weightsync.impl.transfer.worker import WeightTransferWorker
from weightsync.spec.errors import IncompleteUpdateError, LocalProtocolError
from weightsync.spec.worker import WorkerState

pytestmark = pytest.mark.timeout(60)

GOOD_UPDATE = {"names": ["a", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[2, 3], [4]]}


# ------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"dtype_names": ["float32"], "shapes": [[1]]}, "missing required field 'names'"),
        (
            {**GOOD_UPDATE, "shapes": [[2, 3]]},
            "length mismatch: names has 2, dtype_names has 2, shapes has 1",
        ),
        (
            {**GOOD_UPDATE, "dtype_names": ["float32", "float33"]},
            r"dtype_names'\]\[1\]='float33' \(for 'b'\)",
        ),
        (
            {**GOOD_UPDATE, "shapes": [[2, -3], [4]]},
            r"shapes'\]\[0\]=\[2, -3\] \(for 'a'\) has negative dimension -3",
        ),
        ({**GOOD_UPDATE, "names": ["a", "a"]}, "lists 'a' twice"),
        (
            {**GOOD_UPDATE, "verify": "yes"},
            r"\['verify'\]='yes' must be False, True \(a CRC-32 per bucket\) or 'hmac'",
        ),
        ({**GOOD_UPDATE, "check_finite": 1}, r"\['check_finite'\] must be a bool, got int 1"),
        # vLLM 0.32: the packing parameters are init_info's, not update_info's
        ({**GOOD_UPDATE, "packed": True}, "unknown field 'packed'"),
        ({**GOOD_UPDATE, "shapes": [[2, 3.0], [4]]}, "must contain only ints"),
        ({**GOOD_UPDATE, "typo": 1}, "unknown field 'typo'"),
        (["names"], "update_info must be a dict, got list"),
    ],
)
def test_update_info_rejects_malformed(bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BroadcastWeightTransferEngine().parse_update_info(bad)


def test_update_info_defaults_and_round_trip() -> None:
    info = UpdateInfo.parse(GOOD_UPDATE)
    assert (info.verify, info.check_finite) == (None, False)
    assert info.to_dict() == GOOD_UPDATE  # vLLM's three fields only: the optional ones when set
    assert UpdateInfo.parse(info.to_dict()) == info
    assert info.check_finite is False  # opt-in; local to the worker, not part of the wire description
    checked = UpdateInfo.parse({**GOOD_UPDATE, "check_finite": True})
    assert checked.check_finite and UpdateInfo.parse(checked.to_dict()) == checked
    wire = WireArgs()
    assert wire_description(checked.metas(), wire) == wire_description(info.metas(), wire)
    assert wire.for_round(UpdateInfo.parse({**GOOD_UPDATE, "verify": True})).verify is True
    assert UpdateInfo.parse({"names": [], "dtype_names": [], "shapes": []}).names == []  # empty is valid


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2},
            "missing required field 'rank_offset'",
        ),
        ({**init_info(1, 2), "master_port": 70000}, r"master_port'\]=70000 must be <= 65535"),
        ({**init_info(1, 2), "master_port": "29500"}, r"master_port'\] must be an int, got str"),
        ({**init_info(1, 2), "rank_offset": 0}, r"rank_offset'\]=0 must be >= 1"),
        ({**init_info(1, 2), "world_size": 1}, r"world_size'\]=1 must be >= 2"),
        ({**init_info(1, 2), "timeout_s": -1}, "positive finite number of seconds"),
        ({**init_info(1, 2), "group_backend": "mpi"}, "must be one of 'auto', 'gloo', 'nccl'"),
        ({**init_info(1, 2), "packed": "yes"}, r"\['packed'\] must be a bool"),
        ({**init_info(1, 2), "packed_buffer_size_bytes": 0}, r"packed_buffer_size_bytes'\]=0 must be >= 1"),
        ({**init_info(1, 2), "packed_num_buffers": 0}, r"packed_num_buffers'\]=0 must be >= 1"),
        ({**init_info(1, 2), "layout": "dense"}, r"\['layout'\]='dense' must be 'aligned'"),
        ({**init_info(1, 2), "is_checkpoint_format": 0}, r"\['is_checkpoint_format'\] must be a bool"),
        ({**init_info(1, 2), "nccl_unique_id_b64": "AAAA"}, "rendezvous on the trainer's TCPStore"),
        ({**init_info(1, 2), "backend": "gloo"}, "unknown field 'backend'"),
    ],
)
def test_init_info_rejects_malformed(bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BroadcastWeightTransferEngine().parse_init_info(bad)


# ------------------------------------------------------------------------------------------ registry


def test_registry_semantics() -> None:
    assert {"nccl", "ipc"} <= set(WeightTransferEngineFactory.names())
    with pytest.raises(
        ValueError, match=r"unknown weight transfer backend 'rdma'; known backends: .*ipc.*nccl"
    ):
        WeightTransferEngineFactory.create_engine("rdma")
    with pytest.raises(ValueError, match="'nccl' is already registered; registered: "):
        WeightTransferEngineFactory.register_engine("nccl", BroadcastWeightTransferEngine)
    with pytest.raises(ValueError, match="class_name is required with a module path"):
        WeightTransferEngineFactory.register_engine("custom", "some.module")
    WeightTransferEngineFactory.register_engine(
        "custom", "weightsync.impl.transfer.broadcast", "BroadcastWeightTransferEngine"
    )
    try:
        assert isinstance(
            WeightTransferEngineFactory.create_engine({"backend": "custom"}), WeightTransferEngine
        )
    finally:
        WeightTransferEngineFactory.unregister_engine("custom")
    with pytest.raises(ValueError, match="unknown weight transfer backend"):
        WeightTransferWorker(DictModel(model_spec()), "rdma")


# ------------------------------------------------------------------------------------------- packing


def test_partition_equals_the_hand_computed_one_bounded_and_aligned() -> None:
    """The partition against one computed by hand from the rules (packing.py rules 2-4: greedy in order,
    each offset rounded up to ALIGN=16, a tensor that does not fit closes the bucket, one larger than the
    buffer is a bucket of its own): 7@0, 100@16 (7 -> 16), 0@128 (116 -> 128) | 4096@0 | 5000 oversized |
    1@0, 33@16, 2048@64 (49 -> 64; ends at 2112) | 2048@0 (2112 + 2048 > 4096). Comparing the function
    with itself on a copy of its input, as before, could not fail."""
    sizes = [7, 100, 0, 4096, 5000, 1, 33, 2048, 2048]
    a = plan_buckets(sizes, 4096)
    assert ALIGN == 16
    assert [(bk.members, bk.offsets, bk.nbytes, bk.oversized) for bk in a] == [
        ((0, 1, 2), (0, 16, 128), 128, False),
        ((3,), (0,), 4096, False),
        ((4,), (0,), 5000, True),
        ((5, 6, 7), (0, 16, 64), 2112, False),
        ((8,), (0,), 2048, False),
    ]
    assert [bk.number for bk in a] == list(range(5))
    assert [m for bk in a for m in bk.members] == list(range(len(sizes)))
    for bk in a:
        if bk.oversized:
            assert len(bk.members) == 1 and sizes[bk.members[0]] > 4096
        else:
            assert bk.nbytes <= 4096
            assert all(off % ALIGN == 0 for off in bk.offsets)
    assert [bk.oversized for bk in a].count(True) == 1  # only the 5000-byte tensor


def test_b5_both_sides_compute_identical_partitions_only_with_equal_buffers() -> None:
    """B5 (vLLM PR #31943 review): five 20 MiB tensors; 64 MiB vs 32 MiB give different partitions, which is
    why B is part of the wire digest."""
    sizes = [20 << 20] * 5
    assert [len(b.members) for b in plan_buckets(sizes, 64 << 20)] == [3, 2]
    assert [len(b.members) for b in plan_buckets(sizes, 32 << 20)] == [1] * 5
    info = update_info_for([(f"w{i}", torch.empty(1, dtype=torch.uint8).expand(20 << 20)) for i in range(5)])
    metas = UpdateInfo.parse(info).metas()
    d64 = wire_description(metas, WireArgs(packed=True, packed_buffer_size_bytes=64 << 20))
    d32 = wire_description(metas, WireArgs(packed=True, packed_buffer_size_bytes=32 << 20))
    assert first_difference(d64, d32) == "packed_buffer_size_bytes: 67108864 vs 33554432"


def test_pack_unpack_bit_exact_and_pool_does_not_grow() -> None:
    pairs = make_tensors(3)
    info = UpdateInfo.parse(update_info_for(pairs))
    metas = info.metas()
    tensors = [t for _, t in pairs]
    pool = BufferPool()
    for _ in range(3):
        buckets = plan_buckets([m.nbytes for m in metas], 1024)
        pool.reserve(2, max_packed_bucket(buckets), 1024)
        held = pool.nbytes
        for bk in buckets:
            if bk.oversized:
                continue
            view = pack_bucket(pool.slot(bk.number % 2), bk, tensors)
            for (name, got), i in zip(unpack_bucket(view, bk, metas), bk.members, strict=True):
                assert name == pairs[i][0] and bytes_equal(got, tensors[i].contiguous())
        assert pool.nbytes == held <= 2 * 1024


# ------------------------------------------------------------------------------------ worker, 1 process


class _Pair:
    """A trainer and one worker in one process (two threads), for quick worker-level tests."""

    def __init__(self, model: DictModel, init_kw: dict[str, Any] | None = None, **worker_kw: Any) -> None:
        init_kw = init_kw or {}
        self.port = free_port()
        self.worker = WeightTransferWorker(model, "nccl", **worker_kw)
        out: dict[str, Any] = {}

        def trainer() -> None:
            out["t"] = BroadcastTrainer(init_info(self.port, 2, 10.0))

        th = threading.Thread(target=trainer)
        th.start()
        self.worker.init_weight_transfer_engine(init_info(self.port, 2, 10.0, **init_kw))
        th.join(10)
        self.trainer = out["t"]

    def round(self, pairs: list[tuple[str, torch.Tensor]], info: dict[str, Any] | None = None) -> None:
        errors: list[BaseException] = []

        def send() -> None:
            try:
                self.trainer.send(iter(pairs))
            except BaseException as exc:
                errors.append(exc)

        th = threading.Thread(target=send)
        th.start()
        try:
            self.worker.update_weights(info or update_info_for(pairs))
        finally:
            th.join(15)

    def close(self) -> None:
        self.trainer.close()


def test_out_of_order_calls_raise_local_protocol_error_before_side_effects() -> None:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "nccl")
    with pytest.raises(LocalProtocolError, match=r"start_weight_update.*guard"):
        w.start_weight_update()  # before init
    assert w.state is WorkerState.ERROR
    with pytest.raises(LocalProtocolError, match="legal events here: shutdown"):
        w.update_weights(GOOD_UPDATE)  # sticky error: nothing but shutdown
    w.shutdown()
    with pytest.raises(LocalProtocolError):
        w.init_weight_transfer_engine(init_info(1, 2))

    w2 = WeightTransferWorker(model, None)  # weight transfer not configured
    with pytest.raises(LocalProtocolError, match="no_engine"):
        w2.init_weight_transfer_engine(init_info(1, 2))

    w3 = WeightTransferWorker(model, "nccl")
    with pytest.raises(ValueError, match="needs both master_address and master_port"):
        w3.init_weight_transfer_engine({"master_address": "x", "rank_offset": 1, "world_size": 2})
    assert w3.state is WorkerState.READY  # bad input changes nothing
    with pytest.raises(LocalProtocolError, match="update_weights"):
        w3.update_weights(GOOD_UPDATE)  # update before start: illegal before parsing anything


def test_round_completeness_b4_buffers_kernel_format_and_incomplete() -> None:
    model = DictModel(model_spec())
    p = _Pair(model)
    w = p.worker
    try:
        w.start_weight_update()
        with pytest.raises(LocalProtocolError, match="init_weight_transfer_engine"):
            w.init_weight_transfer_engine(init_info(p.port, 2))  # re-init mid-round is rejected (weightsync)
        assert w.state is WorkerState.ERROR  # sticky until shutdown: use a fresh pair for the rest
    finally:
        p.close()

    model = DictModel(model_spec())
    p = _Pair(model)
    w = p.worker
    try:
        # B4: a checkpoint round with every parameter but never the inv_freq buffer completes
        pairs = make_tensors(1)
        w.start_weight_update()
        half = len(pairs) // 2
        p.round(pairs[:half])
        with pytest.raises(IncompleteUpdateError) as ei:
            w.finish_weight_update()
        assert set(ei.value.missing) == {n for n, _ in pairs[half:]}
        assert w.state is WorkerState.ACTIVE  # the round stays open
        with pytest.raises(ValueError, match="already loaded in this round"):
            p.round(pairs[:1])
        with pytest.raises(ValueError, match=r"unknown weight 'model\.rotary\.inv_freq'"):
            p.round([("model.rotary.inv_freq", torch.zeros(4))])
        p.round(pairs[half:])
        w.finish_weight_update()
        assert (w.weight_version, model.processed) == (1, 1)
        stats = w.round_stats()
        assert stats["loaded"] == stats["expected"] == len(pairs)
        assert torch.equal(model.inv_freq, torch.arange(4, dtype=torch.float32))  # buffer untouched
        for name, t in pairs:
            assert bytes_equal(model.weights()[name], t.contiguous())

        w.shutdown()
    finally:
        p.close()

    # kernel format (init_info is_checkpoint_format=False): exact parameter names, dtype and shape
    # checked before the collective
    model = DictModel(model_spec())
    p = _Pair(model, {"is_checkpoint_format": False})
    w = p.worker
    try:
        w.start_weight_update()
        assert w.machine.vars.is_checkpoint_format is False
        kp = [(n, t.contiguous()) for n, t in model.named_parameters()]
        bad = update_info_for(kp[:1])
        bad["shapes"][0] = [1, 2]
        with pytest.raises(ValueError, match="declared with shape"):
            p.round(kp[:1], bad)
        bad = update_info_for(kp[:1])
        bad["dtype_names"][0] = "float16"
        with pytest.raises(ValueError, match="declared as float16 but the model holds float32"):
            p.round(kp[:1], bad)
        new = [(n, torch.ones_like(t)) for n, t in kp]
        p.round(new)
        w.finish_weight_update()
        assert w.weight_version == 1 and stats["expected_bytes"] == 0
        assert w.round_stats()["expected_bytes"] == sum(t.numel() * t.element_size() for _, t in kp)
        assert all(bool((t == 1).all()) for _, t in model.named_parameters())
        w.shutdown()
    finally:
        p.close()


def test_init_info_parse_roundtrip() -> None:
    d = init_info(29500, 3)
    info = InitInfo.parse(d)
    assert (info.rank_offset, info.world_size, info.group_backend) == (1, 3, "auto")
    assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (False, 1 << 30, 2)
    # vLLM's fields always (with vLLM's worker defaults), weightsync's only when set (timeout_s here)
    assert info.to_dict() == {
        **d,
        "packed": False,
        "packed_buffer_size_bytes": 1 << 30,
        "packed_num_buffers": 2,
    }
    assert info.is_checkpoint_format and InitInfo.parse(info.to_dict()) == info
    assert info.wire("aligned") == WireArgs() and info.wire("vllm").layout == "vllm"
    packed = InitInfo.parse({**d, "packed": True, "packed_num_buffers": 3, "layout": "vllm"})
    assert packed.wire("aligned") == WireArgs(packed=True, packed_num_buffers=3, layout="vllm")


# ----------------------------------------------------------------------------------- zero-copy runs


def test_contiguous_run_of_a_flat_trainer_equals_packing() -> None:
    """Packing rule 7: members adjacent at the packed offsets are sent from their own storage, and the
    bytes equal what packing produces (padding aside)."""
    from weightsync.impl.transfer.base import meta_of

    pairs = [(n, t.contiguous()) for n, t in make_tensors(0)]
    metas = [meta_of(n, t) for n, t in pairs]
    total, offsets = flat_layout(metas)
    assert all(o % ALIGN == 0 for o in offsets)
    flat = torch.zeros(total, dtype=torch.uint8)
    views = flat_views(flat, metas)
    for v, (_, t) in zip(views, pairs, strict=True):
        v.copy_(t)
    for size in (1024, 4096, 1 << 20):
        for b in plan_buckets([m.nbytes for m in metas], size):
            run = contiguous_run(b, views)
            if b.nbytes == 0:
                continue
            assert run is not None and run.numel() == b.nbytes
            assert run.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # no copy
            packed = torch.zeros(b.nbytes, dtype=torch.uint8)
            pack_bucket(packed, b, views)
            for (name, got), (_, want) in zip(
                unpack_bucket(run, b, metas), unpack_bucket(packed, b, metas), strict=True
            ):
                assert bytes_equal(got, want), name
    # separately allocated, non-contiguous or out-of-order tensors are not runs
    b = plan_buckets([m.nbytes for m in metas], 1 << 20)[0]
    assert len(b.members) > 1
    assert contiguous_run(b, [t for _, t in pairs]) is None
    swapped = list(views)
    swapped[0], swapped[1] = views[1], views[0]
    assert contiguous_run(b, swapped) is None
    noncontig = list(views)
    noncontig[2] = make_tensors(0)[2][1]
    assert not noncontig[2].is_contiguous() and contiguous_run(b, noncontig) is None
    with pytest.raises(ValueError, match="flat buffer"):
        flat_views(flat[:-1], metas)


def test_gloo_binds_the_address_on_the_route_to_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.impl.transfer.broadcast import gloo_device_choice, local_address_towards

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_device_choice("127.0.0.1") == [{"hostname": "127.0.0.1"}]
    assert gloo_device_choice("localhost") == [{"hostname": "127.0.0.1"}]
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("no-such-host.invalid") is None
    assert gloo_device_choice("no-such-host.invalid") == []  # gloo's default device
    # a non-loopback store: the source address the kernel routes towards it (TEST-NET-1, never answered)
    local = local_address_towards("192.0.2.1")
    assert gloo_device_choice("192.0.2.1") == ([] if local is None else [{"hostname": local}])
    assert local is None or not local.startswith("127.")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9,lo")  # torch's convention wins
    assert gloo_device_choice("192.0.2.1") == [{"interface": "eth9"}, {"interface": "lo"}]


class _SilentStore:
    """A store whose answers never come (a cut link): every call that waits for one blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sets: list[str] = []

    def _block(self, *args: Any) -> Any:
        self.release.wait()
        raise RuntimeError("released")

    wait = check = multi_get = add = get = delete_key = _block

    def set(self, key: str, value: str) -> None:
        self.sets.append(key)


def test_a_store_that_stops_answering_is_a_timeout_naming_rank_0_never_a_hang() -> None:
    from weightsync.impl.transfer.control import STORE_GRACE_S, ControlPlane
    from weightsync.spec.errors import TransferTimeoutError

    store = _SilentStore()
    cp = ControlPlane(store, 1, 2, 0.5, "timeout 0.5 s: init_info['timeout_s']")  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError) as ei:
            cp.exchange("r1/b0", {"ok": True}, 1, "update_weights/bucket")
        waited = time.monotonic() - t0
        assert 0.5 + STORE_GRACE_S - 0.05 <= waited < 0.5 + STORE_GRACE_S + 1.0, waited
        e = ei.value
        assert (e.phase, e.missing_ranks) == ("update_weights/bucket", (0,))
        assert "waiting for rank(s) 0 (rank 0's TCPStore (the trainer hosts it) did not answer rank 1" in str(
            e
        )
        assert "timeout 0.5 s: init_info['timeout_s']" in str(e)
        assert store.sets == ["r1/b0/1"]
        # the blocked call still owns the connection: nothing more is sent, every later call fails at once
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match=r"update_weights/bucket: .*rank\(s\) 0"):
            cp.exchange("r1/b1", {"ok": True}, 1, "update_weights/bucket")
        cp.settle("r1/b1")  # never raises
        cp.cleanup(5)
        assert time.monotonic() - t0 < 0.5 and store.sets == ["r1/b0/1"]
    finally:
        store.release.set()
        cp.close()
