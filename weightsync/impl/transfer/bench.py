"""``weightsync bench transfer``: packed broadcast against its ceiling and against per-tensor broadcast, CPU
IPC against memcpy, and resident-memory growth over 20 syncs.

Setup: three spawned processes on this host (trainer rank 0 + two engine workers), gloo on 127.0.0.1,
``torch.set_num_threads(1)`` in each, a synthetic bf16 transformer of about 512 MiB in about 300 tensors
(``quick``: about 32 MiB). Every figure is the best of three timed runs, measured on the trainer from one
barrier to the next (so it includes the slowest engine), in GB/s = model bytes / seconds / 1e9.

- ``raw_gbps``: one gloo ``broadcast`` of a single flat uint8 tensor of the model's bytes (the ceiling).
- ``packed_gbps``: ``trainer_send_weights`` / ``update_weights`` with ``packed=True`` (wire agreement,
  per-bucket status, pipelined packing, unpacking and loading into each engine's model).
- ``per_tensor_gbps``: what ad-hoc integrations do: for each tensor the engine allocates a tensor,
  broadcasts into it and loads it.
- ``ipc_gbps``: the ``ipc`` backend on CPU shared memory into both engines' models.
- ``memcpy_gbps``: ``torch.Tensor.copy_`` of the model's bytes between two preallocated flat tensors.
- ``rss_growth_bytes``: largest growth of any process's resident set between the end of packed sync 1 and
  the end of sync 21 (vLLM issue #52950 grew by 2.09 GB per sync).

Targets: packed >= 0.9 x raw; packed >= 3 x per-tensor; ipc >= 0.5 x memcpy; rss growth < one bucket.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from weightsync.impl.transfer.base import ParallelInfo, dtype_name
from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine
from weightsync.impl.transfer.worker import WeightTransferWorker

REPEATS = 3
SYNCS_FOR_RSS = 20


def synthetic_spec(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like bf16 model: ~512 MiB in ~300 tensors (quick: ~32 MiB, ~150)."""
    hidden, inter, layers, vocab = (1024, 2048, 20, 32768) if not quick else (256, 512, 10, 8192)
    spec: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (hidden // 2, hidden)),
            (p + "self_attn.k_proj.bias", (hidden // 2,)),
            (p + "self_attn.v_proj.weight", (hidden // 2, hidden)),
            (p + "self_attn.v_proj.bias", (hidden // 2,)),
            (p + "self_attn.q_norm.weight", (64,)),
            (p + "self_attn.k_norm.weight", (64,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    spec += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return spec


class BenchModel(nn.Module):
    """A LoadableModel holding one bf16 parameter per checkpoint name (copies on load)."""

    def __init__(self, spec: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self._by_name: dict[str, nn.Parameter] = {}
        for i, (name, shape) in enumerate(spec):
            p = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
            self.register_parameter(f"p{i}", p)
            self._by_name[name] = p

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            self._by_name[name].data.copy_(t)
            done.add(name)
        return done

    def checkpoint_weight_names(self) -> set[str]:
        return set(self._by_name)

    def process_weights_after_loading(self) -> None:
        return None

    def param(self, name: str) -> nn.Parameter:
        return self._by_name[name]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _info(port: int, world: int) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
        "timeout_s": 120.0,
    }


def _barrier(pg: Any) -> None:
    pg.barrier().wait()


def _role(rank: int, world: int, ports: tuple[int, int], quick: bool, bucket: int) -> dict[str, Any]:
    """One process of the benchmark: rank 0 is the trainer, ranks 1..world-1 engines."""
    torch.set_num_threads(1)
    spec = synthetic_spec(quick)
    total = sum(torch.Size(s).numel() * 2 for _, s in spec)
    packing = {"packed": True, "packed_buffer_size_bytes": bucket, "packed_num_buffers": 2}
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        pairs = [(n, torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)) for n, s in spec]
        tr = BroadcastWeightTransferEngine.trainer_init(_info(ports[0], world))
        pg = tr.group.pg
        flat = torch.empty(total, dtype=torch.uint8)
        flat.fill_(1)

        def timed(fn: Callable[[], None]) -> float:
            best = float("inf")
            for _ in range(REPEATS):
                _barrier(pg)
                t0 = time.perf_counter()
                fn()
                _barrier(pg)
                best = min(best, time.perf_counter() - t0)
            return best

        def send() -> None:
            BroadcastWeightTransferEngine.trainer_send_weights(iter(pairs), {"group": tr, **packing})

        def per_tensor() -> None:
            for _, t in pairs:
                tr.group.wait(tr.group.broadcast(t.contiguous().view(-1).view(torch.uint8)), "bench")

        send()  # warm up (allocates the pool)
        out["raw_s"] = timed(lambda: tr.group.wait(tr.group.broadcast(flat), "bench"))
        out["packed_s"] = timed(send)
        out["per_tensor_s"] = timed(per_tensor)
        rss = [_rss()]
        for _ in range(SYNCS_FOR_RSS):
            send()
        rss.append(_rss())
        out["rss"] = rss
        out["pool_bytes"] = tr.pool_bytes
        # CPU IPC against memcpy
        ipc = IPCWeightTransferEngine.trainer_init(_info(ports[1], world))

        def ipc_send() -> None:
            IPCWeightTransferEngine.trainer_send_weights(iter(pairs), {"group": ipc, **packing})

        ipc_send()
        out["ipc_s"] = timed(ipc_send)
        dst = torch.empty_like(flat)
        dst.copy_(flat)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            dst.copy_(flat)
            best = min(best, time.perf_counter() - t0)
        out["memcpy_s"] = best
        _barrier(pg)
        ipc.close()
        tr.close()
        out["total_bytes"] = total
        out["num_tensors"] = len(spec)
        return out

    model = BenchModel(spec)
    names = [n for n, _ in spec]
    info = {
        "names": names,
        "dtype_names": [dtype_name(torch.bfloat16)] * len(spec),
        "shapes": [list(s) for _, s in spec],
        **packing,
    }
    w = WeightTransferWorker(model, "nccl", ParallelInfo(dp_index=rank - 1), name=f"engine {rank - 1}")
    w.init_weight_transfer_engine(_info(ports[0], world))
    g_ = w.engine.group if isinstance(w.engine, BroadcastWeightTransferEngine) else None
    assert g_ is not None
    pg = g_.pg
    flat = torch.empty(total, dtype=torch.uint8)
    flat.fill_(0)

    def recv() -> None:
        w.start_weight_update()
        w.update_weights(info)
        w.finish_weight_update()

    def per_tensor_recv() -> None:
        for name, shape in spec:
            t = torch.empty(shape, dtype=torch.bfloat16)
            g_.wait(g_.broadcast(t.view(-1).view(torch.uint8)), "bench")
            model.load_weights([(name, t)])

    def repeat(fn: Callable[[], None]) -> None:
        for _ in range(REPEATS):
            _barrier(pg)
            fn()
            _barrier(pg)

    recv()
    repeat(lambda: g_.wait(g_.broadcast(flat), "bench"))
    repeat(recv)
    repeat(per_tensor_recv)
    rss = [_rss()]
    for _ in range(SYNCS_FOR_RSS):
        recv()
    rss.append(_rss())
    out["rss"] = rss
    wi = WeightTransferWorker(model, "ipc", ParallelInfo(dp_index=rank - 1), device="cpu")
    wi.init_weight_transfer_engine(_info(ports[1], world))

    def ipc_recv() -> None:
        wi.start_weight_update()
        wi.update_weights(info)
        wi.finish_weight_update()

    ipc_recv()
    repeat(ipc_recv)
    _barrier(pg)
    wi.shutdown()
    w.shutdown()
    return out


def _child(rank: int, world: int, ports: tuple[int, int], quick: bool, bucket: int, q: Any) -> None:
    try:
        q.put((rank, "ok", _role(rank, world, ports, quick, bucket)))
    except BaseException as exc:
        q.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def run_transfer_bench(quick: bool = False, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the benchmark (see the module docstring) and return its figures.

    Returns:
        ``packed_gbps``, ``raw_gbps``, ``per_tensor_gbps``, ``ipc_gbps``, ``memcpy_gbps`` (GB/s),
        ``packed_vs_raw``, ``packed_vs_per_tensor``, ``ipc_vs_memcpy`` (ratios), ``rss_growth_bytes``,
        ``bucket_bytes``, ``model_bytes``, ``num_tensors``, ``ranks``, ``targets`` (name -> bool) and
        ``targets_met``.

    Raises:
        RuntimeError: a process failed or did not finish within ``timeout_s`` seconds.
    """
    world = 3
    bucket = (64 << 20) if not quick else (4 << 20)
    ports = (_free_port(), _free_port())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world, ports, quick, bucket, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    end = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world and time.monotonic() < end:
            try:
                rank, status, value = q.get(timeout=1.0)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors or len(results) < world:
        raise RuntimeError(
            "transfer bench failed: " + ("; ".join(errors) or "a process did not report in time")
        )
    t = results[0]
    nbytes = t["total_bytes"]

    def gbps(seconds: float) -> float:
        return float(nbytes / seconds / 1e9)

    growth = max(r["rss"][1] - r["rss"][0] for r in results.values())
    out: dict[str, Any] = {
        "ranks": world,
        "backend": "gloo",
        "model_bytes": nbytes,
        "num_tensors": t["num_tensors"],
        "bucket_bytes": bucket,
        "num_buffers": 2,
        "raw_gbps": gbps(t["raw_s"]),
        "packed_gbps": gbps(t["packed_s"]),
        "per_tensor_gbps": gbps(t["per_tensor_s"]),
        "ipc_gbps": gbps(t["ipc_s"]),
        "memcpy_gbps": gbps(t["memcpy_s"]),
        "rss_growth_bytes": int(growth),
        "rss_syncs": SYNCS_FOR_RSS,
        "trainer_pool_bytes": t["pool_bytes"],
        "quick": quick,
    }
    out["packed_vs_raw"] = out["packed_gbps"] / out["raw_gbps"]
    out["packed_vs_per_tensor"] = out["packed_gbps"] / out["per_tensor_gbps"]
    out["ipc_vs_memcpy"] = out["ipc_gbps"] / out["memcpy_gbps"]
    out["targets"] = {
        "packed_vs_raw>=0.9": out["packed_vs_raw"] >= 0.9,
        "packed_vs_per_tensor>=3": out["packed_vs_per_tensor"] >= 3.0,
        "ipc_vs_memcpy>=0.5": out["ipc_vs_memcpy"] >= 0.5,
        "rss_growth<bucket": out["rss_growth_bytes"] < bucket,
    }
    out["targets_met"] = all(out["targets"].values())
    return out


__all__ = ["BenchModel", "run_transfer_bench", "synthetic_spec"]
