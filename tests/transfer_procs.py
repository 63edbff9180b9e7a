"""Helpers for the weight-transfer tests: a tiny LoadableModel, deterministic tensors, a spawn harness.

Roles run in a small pool of processes started with ``torch.multiprocessing``'s spawn context (reused
across tests: spawning and importing torch costs seconds per process on two cores); each runs role
functions with ``torch.set_num_threads(1)`` and reports ``("ok", value)`` or
``("err", type name, message, attributes, traceback)``. The parent never waits longer than its deadline:
then the pool is killed and the missing roles are reported as ``("hung", ...)``.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from weightsync.impl.transfer.secret import TOKEN_ENV, TOKEN_FILE_ENV

# ------------------------------------------------------------------------------------------- the model


def _attr(name: str) -> str:
    return name.replace(".", "__")


class DictModel(nn.Module):
    """A LoadableModel whose checkpoint names are given as ``{name: (dtype, shape)}``.

    Every checkpoint name maps 1:1 to a parameter (dots become ``__``); a never-loaded buffer
    ``rotary.inv_freq`` exists to check that buffers never count toward completeness (scenario B4).
    ``load_weights`` copies (never aliases) and raises KeyError naming an unknown name.
    """

    def __init__(
        self,
        spec: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        fail_on: str | None = None,
        arena: bool = False,
    ) -> None:
        super().__init__()
        self.spec = dict(spec)
        self.fail_on = fail_on
        self.processed = 0
        self.load_log: list[tuple[str, float, float]] = []  # (name, t_start, t_done) of each copy
        self.slow_s = 0.0
        if arena:
            # every parameter a view of one flat arena, in spec order at flat_layout's offsets
            from weightsync.impl.transfer.base import TensorMeta, dtype_name
            from weightsync.impl.transfer.packing import flat_layout, flat_views

            metas = [TensorMeta(n, dtype_name(d), s) for n, (d, s) in spec.items()]
            self.arena = torch.zeros(flat_layout(metas)[0], dtype=torch.uint8)
            datas = flat_views(self.arena, metas)
        else:
            datas = [torch.zeros(s, dtype=d) for d, s in spec.values()]
        for name, data in zip(spec, datas, strict=True):
            self.register_parameter(_attr(name), nn.Parameter(data, requires_grad=False))
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done: set[str] = set()
        for name, t in weights:
            if name not in self.spec:
                raise KeyError(f"unknown checkpoint name {name!r}")
            if name == self.fail_on:
                raise RuntimeError(f"injected load failure on {name!r}")
            t0 = time.monotonic()
            if self.slow_s:
                time.sleep(self.slow_s)
            getattr(self, _attr(name)).data.copy_(t)
            self.load_log.append((name, t0, time.monotonic()))
            done.add(name)
        return done

    def checkpoint_weight_names(self) -> set[str]:
        return set(self.spec)

    def checkpoint_weight_dtypes(self) -> dict[str, torch.dtype]:
        return {n: d for n, (d, _) in self.spec.items()}

    def process_weights_after_loading(self) -> None:
        self.processed += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, _attr(n)).detach().clone() for n in self.spec}


# ------------------------------------------------------------------------------------------ the tensors

#: name -> (dtype, shape, kind); kind "noncontig" is sent as a transposed view.
MIXED: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {
    "model.embed_tokens.weight": (torch.float32, (64, 32), "plain"),
    "model.layers.0.self_attn.q_proj.weight": (torch.bfloat16, (7, 3), "plain"),  # odd byte count
    "model.layers.0.mlp.up_proj.weight": (torch.float16, (10, 6), "noncontig"),
    "model.layers.0.input_layernorm.weight": (torch.float32, (0, 5), "plain"),  # zero-size
    "model.layers.0.step": (torch.int64, (), "plain"),  # 0-dim
    "model.layers.0.positions": (torch.int64, (33,), "plain"),
    "model.big.weight": (torch.bfloat16, (160, 200), "plain"),  # 64000 bytes: larger than small buffers
    "model.norm.weight": (torch.float32, (32,), "plain"),
}


def model_spec(
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = MIXED,
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (d, s) for n, (d, s, _) in tensors.items()}


def make_tensors(
    round_: int, tensors: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = MIXED
) -> list[tuple[str, torch.Tensor]]:
    """Deterministic trainer tensors for round ``round_`` (non-contiguous ones are transposed views)."""
    g = torch.Generator().manual_seed(1000 + round_)
    out = []
    for name, (dtype, shape, kind) in tensors.items():
        src_shape = tuple(reversed(shape)) if kind == "noncontig" else shape
        if dtype.is_floating_point:
            t = torch.randn(src_shape, generator=g, dtype=torch.float32).to(dtype)
        else:
            t = torch.randint(-(2**40), 2**40, src_shape, generator=g, dtype=torch.int64).to(dtype)
        if kind == "noncontig":
            t = t.t()
            assert not t.is_contiguous()
        out.append((name, t))
    return out


def flat_tensors(
    round_: int, shared: bool = False, skip: Iterable[str] = ()
) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """:func:`make_tensors` as a flat trainer (Megatron / FSDP style): every contiguous tensor becomes a
    view of one flat buffer at :func:`~weightsync.impl.transfer.packing.flat_layout`'s offsets (a
    ``SharedBuffer`` when ``shared``); non-contiguous ones stay separate views. Returns (pairs, owner):
    keep ``owner`` alive while sending. Names in ``skip`` are left out of the layout and the result."""
    from weightsync.impl.transfer.base import meta_of
    from weightsync.impl.transfer.ipc import SharedBuffer
    from weightsync.impl.transfer.packing import flat_layout, flat_views

    skipped = set(skip)
    pairs = [(n, t) for n, t in make_tensors(round_) if n not in skipped]
    metas = [meta_of(n, t) for n, t in pairs]
    total, _ = flat_layout(metas)
    owner: Any = SharedBuffer(total) if shared else torch.empty(total, dtype=torch.uint8)
    flat = owner.tensor if shared else owner
    out = []
    for (name, t), v in zip(pairs, flat_views(flat, metas), strict=True):
        if t.is_contiguous():
            v.copy_(t)
            out.append((name, v))
        else:
            out.append((name, t))
    return out, owner


def update_info_for(pairs: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
    """vLLM 0.32's update_info of ``pairs`` (``extra``: weightsync's optional fields, e.g. ``verify``)."""
    return {
        "names": [n for n, _ in pairs],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
        "shapes": [list(t.shape) for _, t in pairs],
        **extra,
    }


def module_of(pairs: list[tuple[str, torch.Tensor]]) -> nn.Module:
    """An ``nn.Module`` whose ``named_parameters()`` are exactly ``pairs`` (dotted names become submodules),
    as a trainer's model would hold them."""
    root = nn.Module()
    for name, t in pairs:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t.contiguous().clone(), requires_grad=False))
    return root


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality: same dtype, shape and raw bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# ----------------------------------------------------------------------------------------- the harness


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def init_info(port: int, world_size: int, timeout_s: float = 20.0, **extra: Any) -> dict[str, Any]:
    """vLLM 0.32's init_info (``extra``: packing fields and weightsync's optional ones)."""
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "timeout_s": timeout_s,
        **extra,
    }


def _run_one(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        buf = io.BytesIO()
        torch.save(fn(*args), buf)  # plain bytes: no shared-memory handles cross the queue
        return ("ok", buf.getvalue())
    except BaseException as exc:  # report everything, including protocol errors
        attrs = {
            k: getattr(exc, k)
            for k in ("missing_ranks", "ranks", "phase", "seconds", "missing")
            if hasattr(exc, k)
        }
        return ("err", type(exc).__name__, str(exc), attrs, traceback.format_exc())


def _serve(slot: int, inq: Any, outq: Any) -> None:
    torch.set_num_threads(1)
    while True:
        job = inq.get()
        if job is None:
            return
        job_id, fn, args = job
        outq.put((job_id, slot, *_run_one(fn, args)))


class _Pool:
    """Spawned worker processes reused across tests (spawning and importing torch costs seconds each)."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.inq = [ctx.Queue() for _ in range(n)]
        self.outq = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(i, self.inq[i], self.outq), daemon=True) for i in range(n)
        ]
        for p in self.procs:
            p.start()
        self.job = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)

    def run(
        self, roles: list[tuple[Callable[..., Any], tuple[Any, ...]]], deadline_s: float
    ) -> dict[int, Any]:
        self.job += 1
        for i, (fn, args) in enumerate(roles):
            self.inq[i].put((self.job, fn, args))
        results: dict[int, tuple[Any, ...]] = {}
        end = time.monotonic() + deadline_s
        while len(results) < len(roles) and time.monotonic() < end:
            try:
                item = self.outq.get(timeout=max(0.05, min(1.0, end - time.monotonic())))
            except queue.Empty:
                if not self.alive():
                    break
                continue
            if item[0] == self.job:
                results[item[1]] = item[2:]
        return results


_POOL: _Pool | None = None
POOL_SIZE = 3


def run_roles(
    roles: list[tuple[Callable[..., Any], tuple[Any, ...]]], deadline_s: float = 60.0
) -> list[tuple[Any, ...]]:
    """Run each ``(fn, args)`` in its own (pooled, spawned) process; one result tuple per role, in order.

    A role that does not report within ``deadline_s`` is reported as ``("hung", ...)`` and the pool is
    killed (the next call spawns a fresh one), so no test can hang.
    """
    global _POOL
    assert len(roles) <= POOL_SIZE
    if _POOL is None or not _POOL.alive():
        if _POOL is not None:
            _POOL.kill()
        _POOL = _Pool(POOL_SIZE)
    results = _POOL.run(roles, deadline_s)
    if len(results) < len(roles):
        _POOL.kill()
        _POOL = None
    out = []
    for i in range(len(roles)):
        r = results.get(i, ("hung", f"role {i} reported nothing within {deadline_s} s"))
        if r[0] == "ok":
            r = ("ok", torch.load(io.BytesIO(r[1]), weights_only=True))
        out.append(r)
    return out


def reset_pool() -> None:
    """Kill the pooled processes (the next :func:`run_roles` spawns fresh ones): after roles that changed
    their process (e.g. grafted vLLM's classes), so no later role inherits that."""
    global _POOL
    if _POOL is not None:
        _POOL.kill()
        _POOL = None


def ok(result: tuple[Any, ...]) -> Any:
    """The value of an ``("ok", value)`` result, or fail showing the child's traceback."""
    assert result[0] == "ok", result[-1] if result[0] == "err" else result
    return result[1]


def err(result: tuple[Any, ...], type_name: str) -> tuple[str, dict[str, Any]]:
    """(message, attributes) of an error result of type ``type_name``."""
    assert result[0] == "err", f"expected {type_name}, got {result}"
    assert result[1] == type_name, f"expected {type_name}, got {result[1]}: {result[2]}\n{result[-1]}"
    return result[2], result[3]


def iter_pairs(pairs: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from pairs


@contextlib.contextmanager
def secret_env(token: str | None) -> Iterator[None]:
    """This process's deployment secret is ``token`` (None: none) inside the block (the pool's processes are reused)."""
    saved = {k: os.environ.pop(k, None) for k in (TOKEN_ENV, TOKEN_FILE_ENV)}
    if token is not None:
        os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
