"""vLLM's packed layout, byte for byte (issue 9 item 4; reference vllm-0.32 section 2).

On 240 seeded random tensor lists (mixed dtypes, zero-size tensors, tensors larger than the buffer, buffer
sizes from below the smallest tensor to above the whole list), vLLM 0.32's own packing code
(``vllm/distributed/weight_transfer/packed_tensor.py``: ``packed_nccl_broadcast_producer`` and
``packed_nccl_broadcast_consumer``, run on CPU with their CUDA streams stubbed out and a recording
group) and weightsync's ``layout="vllm"`` must agree on:

1. the chunk boundaries (which tensors, how many bytes), on the producer's and the consumer's side;
2. the bytes of every chunk: weightsync's planner and packer, and weightsync's real broadcast sender
   (``BroadcastTrainer.send_stream`` over gloo, its wire bytes recorded) against vLLM's producer;
3. the tensors unpacked from those bytes (bit exact), where weightsync also unpacks members at offsets
   their dtype cannot be viewed at, which vLLM's own ``unpack_tensor`` rejects (a RuntimeError in
   ``Tensor.view``: vLLM's consumer cannot receive such lists at all; counted below).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transfer_procs import free_port, init_info
from vllm_util import require_vllm

require_vllm()

from vllm.distributed.weight_transfer import packed_tensor as vpt  # noqa: E402

from weightsync.impl.transfer.base import InitInfo, UpdateInfo, WireArgs, meta_of  # noqa: E402
from weightsync.impl.transfer.broadcast import BroadcastTrainer, BroadcastWeightTransferEngine  # noqa: E402
from weightsync.impl.transfer.bucket_header import HEADER_BYTES, MAGIC  # noqa: E402
from weightsync.impl.transfer.packing import BufferPool, pack_bucket, plan_buckets, unpack_bucket  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
CASES = 240


def _tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(
        dtype
    )


def make_case(seed: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """A random tensor list and a buffer size (both shaped by ``seed``)."""
    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(1, 14)):
        dtype = rng.choice(DTYPES)
        r = rng.random()
        if r < 0.1:
            shape: tuple[int, ...] = (0,) if rng.random() < 0.5 else (3, 0)
        elif r < 0.2:
            shape = ()
        elif r < 0.85:
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        else:
            shape = (rng.randint(200, 700),)  # larger than the small buffers
        t = _tensor(rng, dtype, shape)
        if rng.random() < 0.15 and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1:
            t = t.t()  # non-contiguous: both packers linearise it
        out.append((f"layer.{i}.w", t))
    total = sum(t.numel() * t.element_size() for _, t in out)
    b = rng.choice([1, 3, 8, 16, 24, 64, 100, 256, 1000, max(1, total // 2), total, total + 17])
    return out, b


# ---------------------------------------------------------------------------- vLLM's code, on the CPU


class _Stream:
    def synchronize(self) -> None:
        pass


class RecordingGroup:
    """Stands in for vLLM's PyNcclCommunicator: records what the producer broadcasts and, on the
    consumer, fills each receive buffer with the next recorded chunk."""

    def __init__(self, chunks: list[torch.Tensor] | None = None) -> None:
        self.sent: list[torch.Tensor] = []
        self.feed = list(chunks or [])
        self.asked: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0
        if self.feed:
            chunk = self.feed.pop(0)
            self.asked.append(tensor.numel())
            assert chunk.numel() == tensor.numel(), (chunk.numel(), tensor.numel())
            tensor.copy_(chunk)
        else:
            self.sent.append(tensor.clone())


@pytest.fixture
def cpu_vllm_packing(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """vLLM's packed NCCL producer/consumer made runnable on CPU: its CUDA streams become no-ops. Its
    ``unpack_tensor`` is wrapped to count (and get past) the lists it cannot view."""
    monkeypatch.setattr(vpt, "_get_streams", lambda device_idx, n: tuple(_Stream() for _ in range(n)))
    monkeypatch.setattr(vpt.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(vpt.torch.accelerator, "current_device_index", lambda: 0)
    stats = {"vllm_unpack_failed": 0}
    original = vpt.unpack_tensor

    def unpack(packed: torch.Tensor, names: Any, shapes: Any, dtypes: Any, sizes: Any) -> Any:
        try:
            return original(packed, names, shapes, dtypes, sizes)
        except RuntimeError as exc:
            assert "must be divisible" in str(exc)
            stats["vllm_unpack_failed"] += 1
            return [
                (n, t.clone().view(d).view(s))
                for n, s, d, t in zip(names, shapes, dtypes, packed.split(sizes), strict=True)
            ]

    monkeypatch.setattr(vpt, "unpack_tensor", unpack)
    yield stats


def vllm_produce(pairs: list[tuple[str, torch.Tensor]], b: int) -> list[torch.Tensor]:
    group = RecordingGroup()
    with (
        pytest.warns()
        if any(t.numel() * t.element_size() > b for _, t in pairs)
        else contextlib.nullcontext()
    ):
        vpt.packed_nccl_broadcast_producer(
            iter(pairs), group, 0, post_iter_func=lambda item: item[1], buffer_size_bytes=b, num_buffers=2
        )
    return group.sent


def vllm_consume(
    pairs: list[tuple[str, torch.Tensor]], b: int, chunks: list[torch.Tensor]
) -> tuple[list[int], list[tuple[str, torch.Tensor]]]:
    group = RecordingGroup(chunks)
    got: list[tuple[str, torch.Tensor]] = []
    meta = ((n, (list(t.shape), t.dtype)) for n, t in pairs)
    vpt.packed_nccl_broadcast_consumer(
        meta,
        group,
        0,
        post_unpack_func=lambda ts: got.extend((n, t.clone()) for n, t in ts),
        buffer_size_bytes=b,
        num_buffers=2,
        device="cpu",
    )
    return group.asked, got


# ------------------------------------------------------------------------------------------- the test


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def test_planner_packer_and_unpacker_equal_vllms_code(cpu_vllm_packing: dict[str, int]) -> None:
    pool = BufferPool()
    oversized_cases = small_b_cases = large_b_cases = 0
    for seed in range(CASES):
        pairs, b = make_case(seed)
        metas = [meta_of(n, t) for n, t in pairs]
        sizes = [m.nbytes for m in metas]
        ref = vllm_produce(pairs, b)
        buckets = plan_buckets(sizes, b, packed=True, layout="vllm")
        # 1. boundaries, producer side
        assert [bk.nbytes for bk in buckets] == [c.numel() for c in ref], seed
        assert [m for bk in buckets for m in bk.members] == list(range(len(pairs)))
        # 1. boundaries, consumer side (vLLM derives them from metadata alone)
        asked, unpacked = vllm_consume(pairs, b, ref)
        assert asked == [bk.nbytes for bk in buckets], seed
        # 2. bytes
        tensors = [t for _, t in pairs]
        for bk, chunk in zip(buckets, ref, strict=True):
            pool.reserve(1, bk.nbytes, max(b, bk.nbytes))
            mine = pack_bucket(pool.slot(0), bk, tensors)
            assert torch.equal(mine, chunk), (seed, bk.number)
            # 3. unpacking (weightsync copies members it cannot view in place)
            for (name, got), i in zip(unpack_bucket(chunk, bk, metas), bk.members, strict=True):
                assert name == pairs[i][0] and _bitwise(got, pairs[i][1]), (seed, name)
        assert [n for n, _ in unpacked] == [n for n, _ in pairs]
        assert all(_bitwise(g, t) for (_, g), (_, t) in zip(unpacked, pairs, strict=True))
        oversized_cases += any(s > b for s in sizes)
        small_b_cases += b < max(sizes)
        large_b_cases += b >= sum(sizes)
    # the generator covers what it claims to
    assert oversized_cases >= 40 and small_b_cases >= 40 and large_b_cases >= 20
    assert cpu_vllm_packing["vllm_unpack_failed"] >= 20  # vLLM's consumer cannot take these lists
    print(f"\n{CASES} lists; vLLM's unpack_tensor rejected {cpu_vllm_packing['vllm_unpack_failed']} chunks")


def test_weightsyncs_broadcast_sender_puts_vllms_bytes_on_the_wire(
    cpu_vllm_packing: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """weightsync's real sender (streamed, pipelined, with its zero-copy single-tensor path) over gloo
    to a real receiver: the payloads it broadcasts (each after its bucket's 64-byte header) equal vLLM's
    producer's chunks, and the receiver gets the tensors back bit for bit."""
    port = free_port()
    info = InitInfo.parse(init_info(port, 2, 30.0, group_backend="gloo"))
    receiver = BroadcastWeightTransferEngine()
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.setdefault("t", BroadcastTrainer(info)))
    th.start()
    receiver.init_transfer_engine(info)
    th.join(30)
    trainer: BroadcastTrainer = box["t"]
    wire: list[torch.Tensor] = []
    real_broadcast = trainer.group.broadcast

    def record(t: torch.Tensor) -> Any:
        wire.append(t.clone())
        return real_broadcast(t)

    monkeypatch.setattr(trainer.group, "broadcast", record)
    try:
        for seed in range(0, CASES, 4):
            pairs, b = make_case(seed)
            ref = [c for c in vllm_produce(pairs, b) if c.numel() > 0]  # weightsync skips empty chunks
            args = WireArgs(packed=True, packed_buffer_size_bytes=b, packed_num_buffers=2, layout="vllm")
            # one group, a buffer size per case: both transports' wire arguments are set directly (through
            # the API they are init_info's, fixed for the group)
            receiver.wire = args
            uinfo = UpdateInfo.of([meta_of(n, t) for n, t in pairs])
            got: dict[str, torch.Tensor] = {}
            rx = threading.Thread(
                target=lambda u=uinfo, g=got: receiver.receive_weights(
                    u, lambda ts: g.update({n: t.clone() for n, t in ts})
                )
            )
            rx.start()
            wire.clear()
            trainer.send_stream([(n, t.dtype, t.shape) for n, t in pairs], iter(pairs), args)
            rx.join(30)
            # each payload follows its bucket's in-band header (broadcast rule 3)
            heads = [w for w in wire if w.numel() == HEADER_BYTES and bytes(w[:4].tolist()) == MAGIC]
            payload = [w for w in wire if not any(w is h for h in heads)]
            assert len(heads) >= len(ref), seed  # one per bucket; a bucket of empty tensors has no payload
            assert len(payload) == len(ref), seed
            assert all(torch.equal(w, r) for w, r in zip(payload, ref, strict=True)), seed
            assert all(_bitwise(got[n], t) for n, t in pairs), seed
    finally:
        trainer.close()
        receiver.shutdown()
