"""Packing rule 9 (issue 20): a packed bucket travels as one broadcast per span, a member of at least
``SPAN_MIN_BYTES`` straight from the trainer's tensor and each run of small ones packed. The spans are a
pure function of metadata, the bytes land at the bucket's offsets (bit-exact on every worker), and a
stream that raises mid-round still aborts every rank at its bucket with nothing one-sided."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
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

from weightsync.impl.transfer.base import ParallelInfo, WireArgs
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.packing import SPAN_MIN_BYTES, plan_buckets, spans
from weightsync.impl.transfer.worker import WeightTransferWorker

pytestmark = pytest.mark.timeout(120)

#: small, large (>= 1 MiB), non-contiguous large, zero-size and odd-sized members
SPANNED: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {
    "a.small": (torch.float32, (8,), "plain"),
    "a.big": (torch.float32, (512, 600), "plain"),  # 1,228,800 bytes
    "a.odd": (torch.bfloat16, (7, 3), "plain"),  # 42 bytes
    "a.step": (torch.int64, (5,), "plain"),
    "a.bigt": (torch.bfloat16, (700, 800), "noncontig"),  # 1,120,000 bytes, a transposed view
    "a.zero": (torch.float32, (0, 4), "plain"),
    "a.big2": (torch.float16, (1024, 600), "plain"),  # 1,228,800 bytes
    "a.tail": (torch.float32, (3,), "plain"),
}
SIZES = [torch.Size(s).numel() * d.itemsize for d, s, _ in SPANNED.values()]
#: one bucket of everything; several buckets of 2 MiB in two slots
PLANS: list[dict[str, Any]] = [
    {"packed": True, "packed_buffer_size_bytes": 8 << 20, "packed_num_buffers": 1},
    {"packed": True, "packed_buffer_size_bytes": 2 << 20, "packed_num_buffers": 2},
]


class ShardGone(RuntimeError):
    pass


def _wire(**kw: Any) -> WireArgs:
    return WireArgs(**{"packed": True, "packed_buffer_size_bytes": 8 << 20, **kw})


def test_spans_are_the_large_members_and_the_runs_between_them() -> None:
    (bucket,) = plan_buckets(SIZES, 8 << 20)
    got = spans(bucket, SIZES, _wire())
    # (start in the bucket, members, offsets relative to the start, bytes)
    want = [(0, (0,)), (1, (1,)), (2, (2, 3)), (4, (4,)), (6, (6,)), (7, (7,))]
    assert [(sp.part.members[0], sp.part.members) for sp in got] == want
    for sp in got:
        first = bucket.members.index(sp.part.members[0])
        assert sp.start == bucket.offsets[first] and sp.part.offsets[0] == 0
        for m, rel in zip(sp.part.members, sp.part.offsets, strict=True):
            assert sp.start + rel == bucket.offsets[bucket.members.index(m)]
        last = sp.part.members[-1]
        assert sp.part.nbytes == sp.part.offsets[-1] + SIZES[last]
    assert got[1].part.nbytes == SIZES[1] >= SPAN_MIN_BYTES
    # the spans cover every byte a member occupies, in order, and nothing twice
    covered = [(sp.start, sp.start + sp.part.nbytes) for sp in got]
    assert covered == sorted(covered) and all(a[1] <= b[0] for a, b in itertools.pairwise(covered))
    # the 2 MiB plan of the transfer tests: three buckets, the first two in several spans
    small = _wire(packed_buffer_size_bytes=2 << 20)
    counts = [len(spans(b, SIZES, small)) for b in plan_buckets(SIZES, 2 << 20)]
    assert counts == [3, 1, 2], counts
    # a large member and a zero-size one after it (at an aligned offset past its end): the bucket whole
    sizes = [SPAN_MIN_BYTES + 1, 0]
    (bucket,) = plan_buckets(sizes, 4 << 20)
    assert bucket.nbytes > sizes[0] and spans(bucket, sizes, _wire()) == ((0, bucket),)


@pytest.mark.parametrize(
    "wire",
    [_wire(verify=True), _wire(layout="vllm"), _wire(packed=False)],
    ids=["verify", "vllm-layout", "unpacked"],
)
def test_one_span_where_the_bucket_must_travel_whole(wire: WireArgs) -> None:
    for bucket in plan_buckets(SIZES, wire.packed_buffer_size_bytes, wire.packed, wire.layout):
        assert spans(bucket, SIZES, wire) == ((0, bucket),)


def test_small_members_only_make_one_span() -> None:
    sizes = [SPAN_MIN_BYTES - 1, 10, 3]
    (bucket,) = plan_buckets(sizes, 4 << 20)
    assert spans(bucket, sizes, _wire()) == ((0, bucket),)


# ---------------------------------------------------------------------------------------------- roles


def trainer_rounds(ports: list[int], world: int) -> int:
    for port, plan in zip(ports, PLANS, strict=True):
        tr = BroadcastTrainer(init_info(port, world, **plan))
        try:
            for r in range(2):
                tr.send(iter(make_tensors(r, SPANNED)))
        finally:
            tr.close()
    return len(ports)


def engine_rounds(ports: list[int], world: int, dp_index: int) -> list[bool]:
    model = DictModel(model_spec(SPANNED))
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    exact = []
    for port, plan in zip(ports, PLANS, strict=True):
        w.init_weight_transfer_engine(init_info(port, world, **plan))
        for r in range(2):
            sent = make_tensors(r, SPANNED)
            w.start_weight_update()
            w.update_weights(update_info_for(sent))
            w.finish_weight_update()
            got = model.weights()
            exact.append(all(bytes_equal(got[n], t) for n, t in sent))
    w.shutdown()
    return exact


def _failing(pairs: list[tuple[str, torch.Tensor]], after: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, p in enumerate(pairs):
        if i == after:
            raise ShardGone(f"checkpoint shard {i} is gone")
        yield p


def trainer_stream_raises(port: int, world: int, after: int) -> str:
    tr = BroadcastTrainer(init_info(port, world, **PLANS[1]))
    try:
        pairs = make_tensors(0, SPANNED)
        declared = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
        try:
            tr.send_stream(declared, _failing(pairs, after))
        except ShardGone as exc:
            first = str(exc)
        else:
            raise AssertionError("send_stream swallowed the stream's exception")
        good = make_tensors(1, SPANNED)
        tr.send_stream([(n, t.dtype, tuple(t.shape)) for n, t in good], iter(good))
        return first
    finally:
        tr.close()


def engine_sees_stream_failure(port: int, world: int, dp_index: int) -> dict[str, Any]:
    from weightsync.spec.errors import PeerFailedError

    model = DictModel(model_spec(SPANNED))
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, **PLANS[1]))
    w.start_weight_update()
    t0 = time.monotonic()
    try:
        w.update_weights(update_info_for(make_tensors(0, SPANNED)))
    except PeerFailedError as exc:
        out: dict[str, Any] = {"msg": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - t0}
    else:
        raise AssertionError("update_weights succeeded although the trainer's stream raised")
    w.fail_round()
    w.start_weight_update()
    good = make_tensors(1, SPANNED)
    w.update_weights(update_info_for(good))
    w.finish_weight_update()
    got = model.weights()
    out["exact"] = all(bytes_equal(got[n], t) for n, t in good)
    w.shutdown()
    return out


# ---------------------------------------------------------------------------------------------- tests


def test_spanned_buckets_arrive_bit_exact_on_every_worker() -> None:
    ports, world = [free_port() for _ in PLANS], 3
    res = run_roles(
        [
            (trainer_rounds, (ports, world)),
            (engine_rounds, (ports, world, 0)),
            (engine_rounds, (ports, world, 1)),
        ]
    )
    assert ok(res[0]) == len(PLANS)
    for r in res[1:]:
        assert ok(r) == [True] * (2 * len(PLANS))


@pytest.mark.parametrize("after", [1, 5])
def test_a_stream_raising_in_a_spanned_round_aborts_every_rank_at_its_bucket(after: int) -> None:
    """``after`` = 1: at the first bucket (three spans); 5: at the second, the first sent in spans and the
    one after it posted by the workers (2 MiB buckets, two slots)."""
    port, world = free_port(), 3
    res = run_roles(
        [
            (trainer_stream_raises, (port, world, after)),
            (engine_sees_stream_failure, (port, world, 0)),
            (engine_sees_stream_failure, (port, world, 1)),
        ]
    )
    assert ok(res[0]) == f"checkpoint shard {after} is gone"
    for r in res[1:]:
        out = ok(r)
        assert out["ranks"] == (0,) and f"checkpoint shard {after} is gone" in out["msg"], out
        assert out["elapsed"] < 10.0 and out["exact"], out
