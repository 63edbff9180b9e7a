"""The processes of ``weightsync bench transfer``: each spawned rank's role (trainer rank 0 or an engine worker)
in the packed, raw, per-tensor and IPC runs, and the measurements it reports back."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.bench.workload import REPEATS, SYNCS_FOR_RSS, BenchModel, _metas, synthetic_spec
from weightsync.impl.engine.client import free_port
from weightsync.impl.transfer.base import DTYPES, InitInfo, ParallelInfo, dtype_name
from weightsync.impl.transfer.broadcast import BroadcastTrainer, BroadcastWeightTransferEngine
from weightsync.impl.transfer.ipc import IPCTrainer, SharedBuffer
from weightsync.impl.transfer.packing import flat_layout, flat_views
from weightsync.impl.transfer.secret import TOKEN_ENV
from weightsync.impl.transfer.worker import WeightTransferWorker


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _info(port: int, world: int, packing: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
        "timeout_s": 120.0,
        **packing,
        **extra,
    }


def _barrier(pg: Any) -> None:
    pg.barrier().wait()


@contextlib.contextmanager
def _secret(token: str | None) -> Iterator[None]:
    """This process's deployment secret is ``token`` inside the block (the bench's own, never shown)."""
    saved = os.environ.pop(TOKEN_ENV, None)
    if token is not None:
        os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        os.environ.pop(TOKEN_ENV, None)
        if saved is not None:
            os.environ[TOKEN_ENV] = saved


def _share_port(group: Any) -> int:
    """A free port chosen by rank 0 and broadcast on ``group`` (a :class:`BroadcastGroup`)."""
    t = torch.tensor([free_port() if group.rank == 0 else 0], dtype=torch.int64)
    group.wait(group.broadcast(t.view(torch.uint8)), "bench")
    return int(t.item())


def _init_times(group: Any, world: int, token: str) -> tuple[list[float], list[float]]:
    """Rank 0's seconds for ``REPEATS`` interleaved whole-group inits without and with the secret
    (every rank runs this; workers return empty lists). Each init is a fresh group on a fresh port."""
    plain: list[float] = []
    auth: list[float] = []
    for _ in range(REPEATS):
        for with_secret, into in ((False, plain), (True, auth)):
            port = _share_port(group)
            info = _info(port, world, {}, timeout_s=30.0)
            _barrier(group.pg)
            t0 = time.perf_counter()
            with _secret(token if with_secret else None):
                if group.rank == 0:
                    endpoint: Any = BroadcastTrainer(info)
                else:
                    endpoint = BroadcastWeightTransferEngine(ParallelInfo(dp_index=group.rank - 1))
                    endpoint.init_transfer_engine(InitInfo.parse(info))
            into.append(time.perf_counter() - t0)
            _barrier(group.pg)
            if group.rank == 0:
                endpoint.close()
            else:
                endpoint.shutdown()
    return (plain, auth) if group.rank == 0 else ([], [])


def _per_tensor_adhoc_trainer(store: Any, run: int, pairs: list[tuple[str, torch.Tensor]], tr: Any) -> None:
    """OpenRLHF's ``_broadcast_to_vllm``, trainer side: per tensor an RPC carrying (name, dtype, shape)
    (here a TCPStore ``set`` the engines ``get``), the broadcast, then waiting for every engine's reply
    (``ray.get(refs)``; here one TCPStore ``wait`` on their ack keys) before the next tensor. Keys are
    unique per run and tensor and live until the bench ends (a few thousand small keys)."""
    world = tr.group.world_size
    for i, (name, t) in enumerate(pairs):
        meta = json.dumps({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)})
        store.set(f"bench/pt{run}/meta/{i}", meta)
        tr.group.wait(tr.group.broadcast(t.view(-1).view(torch.uint8)), "bench")
        store.wait([f"bench/pt{run}/ack/{i}/{r}" for r in range(1, world)])


def _per_tensor_adhoc_engine(store: Any, run: int, n: int, g: Any, model: Any, rank: int) -> None:
    """Engine side of :func:`_per_tensor_adhoc_trainer` (vLLM worker ``update_weight``): read the
    metadata, allocate an empty tensor, receive the broadcast into it, ``load_weights`` it, reply."""
    for i in range(n):
        meta = json.loads(store.get(f"bench/pt{run}/meta/{i}"))
        t = torch.empty(meta["shape"], dtype=DTYPES[meta["dtype"]])
        g.wait(g.broadcast(t.view(-1).view(torch.uint8)), "bench")
        model.load_weights([(meta["name"], t)])
        store.set(f"bench/pt{run}/ack/{i}/{rank}", "1")


def _role(
    rank: int,
    world: int,
    ports: tuple[int, int, int, int],
    quick: bool,
    bucket: int,
    num_buffers: int,
    token: str,
) -> dict[str, Any]:
    """One process of the benchmark: rank 0 is the trainer, ranks 1..world-1 engines."""
    torch.set_num_threads(1)
    spec = synthetic_spec(quick)
    metas = _metas(spec)
    total = sum(m.nbytes for m in metas)
    packing = {"packed": True, "packed_buffer_size_bytes": bucket, "packed_num_buffers": num_buffers}
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        separate = [(n, torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)) for n, s in spec]
        # the flat trainer: every parameter a view of one buffer (Megatron / FSDP style), and that buffer
        # in shared memory so the IPC producer can hand it out by handle
        flat_size, _ = flat_layout(metas)
        shm = SharedBuffer(flat_size)
        views = flat_views(shm.tensor, metas)
        for v, (_, t) in zip(views, separate, strict=True):
            v.copy_(t)
        flat_pairs = [(n, v) for (n, _), v in zip(separate, views, strict=True)]
        tr = BroadcastTrainer(_info(ports[0], world, packing))
        trk = BroadcastTrainer(_info(ports[2], world, packing))  # the engines' kernel-format group
        with _secret(token):  # an authenticated group whose buckets carry HMAC tags
            trh = BroadcastTrainer(_info(ports[3], world, packing, verify="hmac"))
        pg = tr.group.pg
        store = tr.group.store
        raw = torch.empty(total, dtype=torch.uint8)
        raw.fill_(1)
        runs = [0]

        def timed(**fns: Callable[[], object]) -> None:
            # interleaved (a, b, c, a, b, c, ...) so load swings on a shared machine hit every figure alike
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(REPEATS):
                for key, fn in fns.items():
                    _barrier(pg)
                    t0 = time.perf_counter()
                    fn()
                    _barrier(pg)
                    best[key] = min(best[key], time.perf_counter() - t0)
            out.update(best)

        kernel_pairs = [(f"p{i}", v) for i, (_, v) in enumerate(flat_pairs)]

        def send(pairs: list[tuple[str, torch.Tensor]], endpoint: BroadcastTrainer = tr) -> None:
            endpoint.send(iter(pairs))

        def per_tensor_bare() -> None:
            for _, t in separate:
                tr.group.wait(tr.group.broadcast(t.view(-1).view(torch.uint8)), "bench")

        def per_tensor() -> None:
            runs[0] += 1
            _per_tensor_adhoc_trainer(store, runs[0], separate, tr)

        send(separate)  # warm up (allocates the pool)
        send(flat_pairs)
        send(kernel_pairs, trk)
        send(flat_pairs, trh)
        timed(
            raw_s=lambda: tr.group.wait(tr.group.broadcast(raw), "bench"),
            packed_s=lambda: send(kernel_pairs, trk),
            packed_load_s=lambda: send(flat_pairs),
            packed_separate_s=lambda: send(separate),
            packed_hmac_s=lambda: send(flat_pairs, trh),
        )
        out["init_plain_s"], out["init_auth_s"] = _init_times(tr.group, world, token)
        timed(per_tensor_s=per_tensor, per_tensor_bare_s=per_tensor_bare)
        rss = [_rss()]
        for _ in range(SYNCS_FOR_RSS):
            send(separate)  # the packing path: the one that uses (and could leak) buffers
        rss.append(_rss())
        out["rss"] = rss
        out["pool_bytes"] = tr.pool_bytes
        # CPU IPC against memcpy
        ipc = IPCTrainer(_info(ports[1], world, packing))

        def ipc_send(pairs: list[tuple[str, torch.Tensor]]) -> None:
            ipc.send(iter(pairs))

        ipc_send(flat_pairs)
        ipc_send(separate)
        dst = torch.empty_like(raw)
        dst.copy_(raw)
        # memcpy: one dst.copy_(src) of the model's bytes in this process (engines idle at a barrier)
        timed(
            ipc_shared_s=lambda: ipc_send(flat_pairs),
            ipc_packed_s=lambda: ipc_send(separate),
            memcpy_s=lambda: dst.copy_(raw),
        )
        _barrier(pg)
        ipc.close()
        trh.close()
        trk.close()
        tr.close()
        shm.close()
        out["total_bytes"] = total
        out["num_tensors"] = len(spec)
        return out

    model = BenchModel(spec, arena=True)
    names = [n for n, _ in spec]
    info = {
        "names": names,
        "dtype_names": [dtype_name(torch.bfloat16)] * len(spec),
        "shapes": [list(s) for _, s in spec],
    }
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=rank - 1), name=f"engine {rank - 1}")
    w.init_weight_transfer_engine(_info(ports[0], world, packing))
    wk = WeightTransferWorker(
        model, "nccl", ParallelInfo(dp_index=rank - 1), name=f"engine {rank - 1} kernel"
    )
    wk.init_weight_transfer_engine(_info(ports[2], world, packing, is_checkpoint_format=False))
    wh = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=rank - 1), name=f"engine {rank - 1} hmac")
    with _secret(token):
        wh.init_weight_transfer_engine(_info(ports[3], world, packing, verify="hmac"))
    g_ = w.engine.group if isinstance(w.engine, BroadcastWeightTransferEngine) else None
    assert g_ is not None
    pg = g_.pg
    flat = torch.empty(total, dtype=torch.uint8)
    flat.fill_(0)
    runs = [0]

    def recv() -> None:
        w.start_weight_update()
        w.update_weights(info)
        w.finish_weight_update()

    # kernel format (exact parameter names): received in place into the arena (broadcast rule 5)
    kernel_info = {**info, "names": [f"p{i}" for i in range(len(spec))]}

    def recv_kernel() -> None:
        wk.start_weight_update()
        wk.update_weights(kernel_info)
        wk.finish_weight_update()

    def per_tensor_bare_recv() -> None:
        for name, shape in spec:
            t = torch.empty(shape, dtype=torch.bfloat16)
            g_.wait(g_.broadcast(t.view(-1).view(torch.uint8)), "bench")
            model.load_weights([(name, t)])

    def per_tensor_recv() -> None:
        runs[0] += 1
        _per_tensor_adhoc_engine(g_.store, runs[0], len(spec), g_, model, rank)

    def repeat(*fns: Callable[[], None]) -> None:
        for _ in range(REPEATS):
            for fn in fns:
                _barrier(pg)
                fn()
                _barrier(pg)

    def recv_hmac() -> None:
        wh.start_weight_update()
        wh.update_weights(info)
        wh.finish_weight_update()

    recv()
    recv()
    recv_kernel()
    recv_hmac()
    repeat(lambda: g_.wait(g_.broadcast(flat), "bench"), recv_kernel, recv, recv, recv_hmac)
    _init_times(g_, world, token)
    repeat(per_tensor_recv, per_tensor_bare_recv)
    rss = [_rss()]
    for _ in range(SYNCS_FOR_RSS):
        recv()
    rss.append(_rss())
    out["rss"] = rss
    wi = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=rank - 1), device="cpu")
    wi.init_weight_transfer_engine(_info(ports[1], world, packing))

    def ipc_recv() -> None:
        wi.start_weight_update()
        wi.update_weights(info)
        wi.finish_weight_update()

    ipc_recv()
    ipc_recv()
    repeat(ipc_recv, ipc_recv, lambda: None)
    _barrier(pg)
    wi.shutdown()
    wh.shutdown()
    wk.shutdown()
    w.shutdown()
    return out


def _child(
    rank: int,
    world: int,
    ports: tuple[int, int, int, int],
    quick: bool,
    bucket: int,
    num_buffers: int,
    token: str,
    q: Any,
) -> None:
    try:
        q.put((rank, "ok", _role(rank, world, ports, quick, bucket, num_buffers, token)))
    except BaseException as exc:
        q.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


__all__ = []
