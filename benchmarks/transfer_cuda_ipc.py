"""Time CUDA IPC transfer of 8 GiB of bf16 (weightsync ``ipc`` backend) against a device-to-device copy.

Two processes on one GPU: the producer (trainer) holds 16 bf16 tensors of 512 MiB; the consumer holds a
model of the same shapes. The producer packs into 1 GiB x 2 exported buffers (reduce_tensor handles keyed
by GPU UUID, JSON over the TCPStore); the consumer clones each tensor out of the shared buffer and loads it
(vLLM's consumer), acking after the device synchronised. Prints one JSON object.

Usage: python benchmarks/transfer_cuda_ipc.py [--gib 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from weightsync.impl.transfer.base import ParallelInfo
from weightsync.impl.transfer.ipc import IPCTrainer
from weightsync.impl.transfer.worker import WeightTransferWorker

ROWS, COLS = 4096, 65536  # 512 MiB of bf16 per tensor


class Model(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(
            [
                nn.Parameter(
                    torch.empty(ROWS, COLS, dtype=torch.bfloat16, device="cuda"), requires_grad=False
                )
                for _ in range(n)
            ]
        )

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, t in weights:
            self.w[int(name.split(".")[1])].data.copy_(t)
            done.add(name)
        return done

    def checkpoint_weight_names(self) -> set[str]:
        return {f"w.{i}" for i in range(len(self.w))}

    def process_weights_after_loading(self) -> None:
        return None


def _info(port: int) -> dict[str, Any]:
    # vLLM 0.32's init_info: the packing parameters travel here, fixed for the group
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 120.0,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 30,
        "packed_num_buffers": 2,
    }


def producer(port: int, n: int, repeats: int, q: Any) -> None:
    try:
        tr = IPCTrainer(_info(port), device="cuda")  # the data plane of IPCTrainerEngine.send_weights
        g = torch.Generator(device="cuda").manual_seed(0)
        pairs = [
            (
                f"w.{i}",
                torch.randn(ROWS, COLS, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16),
            )
            for i in range(n)
        ]
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            tr.send(iter(pairs))
            times.append(time.perf_counter() - t0)
        checksum = float(sum(t.float().sum().item() for _, t in pairs))
        tr.close()
        q.put(("producer", {"times": times[1:], "checksum": checksum}))
    except BaseException as exc:
        q.put(("producer", {"error": f"{type(exc).__name__}: {exc}"}))


def consumer(port: int, n: int, repeats: int, q: Any) -> None:
    try:
        model = Model(n)
        w = WeightTransferWorker(model, "ipc", ParallelInfo(), device="cuda")
        w.init_weight_transfer_engine(_info(port))
        info = {
            "names": [f"w.{i}" for i in range(n)],
            "dtype_names": ["bfloat16"] * n,
            "shapes": [[ROWS, COLS]] * n,
        }
        for _ in range(repeats + 1):
            w.start_weight_update()
            w.update_weights(info)
            w.finish_weight_update()
        checksum = float(sum(p.float().sum().item() for p in model.w))
        q.put(("consumer", {"checksum": checksum, "version": w.weight_version}))
    except BaseException as exc:
        q.put(("consumer", {"error": f"{type(exc).__name__}: {exc}"}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    n = a.gib * 2
    nbytes = n * ROWS * COLS * 2
    # device-to-device copy baseline
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    d2d = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=f, args=(port, n, a.repeats, q)) for f in (producer, consumer)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=600) for _ in ps)
    for p in ps:
        p.join(60)
    out: dict[str, Any] = {
        "bytes": nbytes,
        "d2d_gbps": nbytes / min(d2d) / 1e9,
        "gpu": torch.cuda.get_device_name(),
    }
    if "error" in res["producer"] or "error" in res["consumer"]:
        out["error"] = [res["producer"].get("error"), res["consumer"].get("error")]
        print(json.dumps(out))
        return 1
    out["ipc_gbps"] = nbytes / min(res["producer"]["times"]) / 1e9
    out["ipc_times_s"] = res["producer"]["times"]
    out["ipc_vs_d2d"] = out["ipc_gbps"] / out["d2d_gbps"]
    out["bit_exact_checksum"] = res["producer"]["checksum"] == res["consumer"]["checksum"]
    print(json.dumps(out))
    return 0 if out["bit_exact_checksum"] else 1


if __name__ == "__main__":
    sys.exit(main())
