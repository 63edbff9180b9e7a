"""``weightsync bench vllm``, the trainer side: one sync round into a real ``AsyncLLM`` against two baselines.

The benchmark (its methods, statistics, verification and targets) is described in :mod:`weightsync.bench.vllm`,
which also computes the figures and renders them; the functions run in vLLM's worker are
:mod:`weightsync.vllm_tools.bench_worker`. This module starts the engine, runs the interleaved rounds and verifies
each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import vllm

from weightsync.bench.vllm import (
    DP_CONFIGS,
    FULL_MODEL,
    METHODS,
    QUICK_BUCKET_BYTES,
    QUICK_MODEL,
    RAW_KEY,
    REPEATS,
    RoundResult,
    combined,
    figures,
)
from weightsync.bench.workload import DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS
from weightsync.impl.engine.client import free_port
from weightsync.impl.transfer.base import InitInfo, dtype_name
from weightsync.impl.transfer.broadcast import BroadcastGroup, join_group
from weightsync.impl.transfer.packing import as_bytes, crc32
from weightsync.vllm.clients import AsyncLLMWeightSyncClient
from weightsync.vllm.trainer import WeightsyncBroadcastTrainer
from weightsync.vllm_tools.bench_worker import (
    PHASE,
    gloo_as_pynccl,
    vllm_packed_on_cpu,
    worker_load_stash,
    worker_raw,
    worker_recv_all,
    worker_recv_one,
    worker_reload_finish,
    worker_reload_start,
    worker_report,
    worker_setup,
    worker_side_finish,
    worker_side_start,
    worker_teardown,
    worker_vllm_packed,
)
from weightsync.vllm_tools.models import build_tiny_llama
from weightsync.vllm_tools.serving import LoopThread, connect_trainer, shutdown_async_llm, start_async_llm

T = TypeVar("T")
INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
#: glibc malloc settings the engine processes start with (each one the user exported is kept): allocations up
#: to 512 MiB come from the heap and freed memory is not returned to the kernel, so every round's
#: ``torch.empty_strided`` in vLLM's layerwise reload (``model_executor/model_loader/reload/meta.py:49-53``)
#: reuses pages already faulted in. With glibc's defaults (mmap above a threshold that adapts up to 32 MiB,
#: trim at 128 KiB) the same reload alternated between about 0.11 and 0.27 s from round to round, and the
#: ``reload_only`` round between 0.15 and 0.32 s, which made ``vs_limit`` a coin toss (1.06 in one run,
#: 0.59 in the next); with these settings ``reload_only`` measured 0.125-0.13 s in 4 of 5 rounds.
STEADY_ALLOCATOR: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(512 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30),
}


def _crcs(pairs: Iterator[tuple[str, torch.Tensor]]) -> dict[str, int]:
    return {n: crc32(as_bytes(t.detach().contiguous())) for n, t in pairs}


def _verify(
    rep: dict[str, Any], sent: dict[str, int], sizes: dict[str, int], raw: bool
) -> tuple[int, int, list[str]]:
    """One worker's report of a round against what was sent: bytes bit-exact, engine parameters compared,
    problems (module docstring of :mod:`weightsync.bench.vllm`)."""
    got: dict[str, int] = rep["digests"]
    good = [n for n, c in sent.items() if got.get(n) == c]
    problems = []
    if len(good) < len(sent):
        bad = [n for n in sent if n not in good]
        problems.append(f"{len(bad)} of {len(sent)} tensors not bit-exact on the engine (first: {bad[0]})")
    extra = sorted(set(got) - set(sent))
    if extra or (not raw and rep["loaded"] != len(sent)):
        problems.append(
            f"the engine loaded {rep['loaded']} tensors for {len(sent)} sent (extra: {extra[:3]})"
        )
    engine: dict[str, int] = {n: c for n, c in rep["engine"].items() if n in sent}
    wrong = sorted(n for n, c in engine.items() if c != sent[n])
    if wrong:
        problems.append(f"engine parameters differ from what was sent after the round: {wrong[:3]}")
    if not raw and not engine:
        problems.append("no engine parameter could be read back")
    return sum(sizes[n] for n in good), len(engine), problems


class _Bench:
    """The engine on its loop thread, the weightsync trainer, the baseline group and the methods."""

    def __init__(
        self, model_dir: Path, hf: torch.nn.Module, bucket: int, buffers: int, timeout_s: float, dp: int
    ):
        self.hf = hf
        self.dp = dp
        self.bucket, self.buffers = bucket, buffers
        self.params = [(n, p) for n, p in hf.named_parameters()]
        self.nbytes = {n: p.numel() * p.element_size() for n, p in self.params}
        self.model_bytes = sum(self.nbytes.values())
        self.timeout_s = timeout_s
        self.rounds = 0
        self.lt = LoopThread("bench-vllm-loop")
        self.loop = self.lt.loop
        self.llm: Any = None
        self.trainer: WeightsyncBroadcastTrainer | None = None
        self.group: BroadcastGroup | None = None
        self.worker_ready = False
        self.llm, self.start_s = start_async_llm(self.lt, model_dir, dp=dp, max_num_seqs=4)
        self.flat = torch.empty(self.model_bytes, dtype=torch.uint8)
        self.flat.fill_(0)
        client = AsyncLLMWeightSyncClient(self.llm, self.loop, timeout_s=timeout_s)
        tr = connect_trainer(
            self.llm,
            hf,
            client=client,
            packed_buffer_size_bytes=bucket,
            packed_num_buffers=buffers,
            timeout_s=timeout_s,
        )
        assert isinstance(tr, WeightsyncBroadcastTrainer)
        self.trainer = tr
        rinfo = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 1 + dp,
            "timeout_s": timeout_s,
            "group_backend": "gloo",
        }
        parsed = InitInfo.parse(rinfo)
        groups: list[BroadcastGroup] = []
        self.metas = [(n, dtype_name(p.dtype), list(p.shape)) for n, p in self.params]
        self.worker_pids = self._alongside(
            worker_setup, (rinfo, self.metas), lambda: groups.append(join_group(parsed, 0))
        )
        self.worker_ready = True
        self.group = groups[0]

    # ------------------------------------------------------------------------------------- plumbing
    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RuntimeError(f"bench vllm: {what} did not return within {timeout_s:g} s") from None

    def _all(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Coroutine[Any, Any, Any]:
        # every DP engine's workers (AsyncLLM.collective_rpc answers with the first engine's only:
        # v1/engine/core_client.py:1699-1701)
        coro: Coroutine[Any, Any, Any] = self.llm.engine_core.call_utility_all_async(
            "collective_rpc", fn, None, args, None
        )
        return coro

    @staticmethod
    def _flat(per_engine: list[list[Any]]) -> list[Any]:
        return [r for engine in per_engine for r in engine]

    def rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` in every worker of every DP engine; their results in DP order."""
        return self._flat(self._run(self._all(fn, args), self.timeout_s, fn.__name__))

    def _alongside(self, fn: Callable[..., Any], args: tuple[Any, ...], local: Callable[[], object]) -> Any:
        """Start ``fn`` in every worker, run ``local`` (the trainer's side of the same collective)
        meanwhile, then wait for the workers' replies (as an ad-hoc integration does with ``ray.get``);
        their results in DP order.

        Raises:
            the worker's error when it failed (chained to the trainer's, if that failed too); the
            trainer's error; RuntimeError when the worker does not answer within ``timeout_s``.
        """
        return self._flat(self._beside(self._all(fn, args), fn.__name__, local))

    def _beside(self, coro: Coroutine[Any, Any, T], what: str, local: Callable[[], object]) -> T:
        """:meth:`_alongside` for any coroutine on the engine's loop (``what`` names it in the timeout)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            local()
        except BaseException as exc:
            try:
                worker_exc = fut.exception(timeout=min(5.0, self.timeout_s))
            except concurrent.futures.TimeoutError:
                worker_exc = None
            if worker_exc is not None:
                raise worker_exc from exc
            raise
        try:
            return fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"bench vllm: {what} did not return within {self.timeout_s:g} s") from None

    def _broadcast(self, t: torch.Tensor) -> None:
        g = self.group
        assert g is not None
        g.wait(g.broadcast(as_bytes(t.detach())), PHASE)

    # -------------------------------------------------------------------------------------- methods
    def raw(self) -> None:
        self._alongside(worker_raw, (), lambda: self._broadcast(self.flat))

    def per_tensor(self) -> None:
        self.rpc(worker_reload_start)
        for name, p in self.params:
            meta = (name, dtype_name(p.dtype), list(p.shape))
            self._alongside(worker_recv_one, meta, functools.partial(self._broadcast, p))
        self.rpc(worker_reload_finish)

    def per_tensor_bare(self) -> None:
        self.rpc(worker_reload_start)
        metas = [(n, dtype_name(p.dtype), list(p.shape)) for n, p in self.params]

        def local() -> None:
            for _, p in self.params:
                self._broadcast(p)

        self._alongside(worker_recv_all, (metas,), local)
        self.rpc(worker_reload_finish)

    def vllm_packed(self) -> None:
        """vLLM 0.32's own packed path (module docstring of :mod:`weightsync.bench.vllm`)."""
        self.rpc(worker_reload_start)
        assert self.group is not None
        group = gloo_as_pynccl(self.group)

        def local() -> None:
            with vllm_packed_on_cpu() as pt:
                pt.packed_nccl_broadcast_producer(
                    iterator=iter(self.params),
                    group=group,
                    src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=self.bucket,
                    num_buffers=self.buffers,
                )

        self._alongside(worker_vllm_packed, (self.metas, self.bucket, self.buffers), local)
        self.rpc(worker_reload_finish)

    def fill_stash(self) -> None:
        """``reload_only``'s set-up, outside the timed window: the round's weights into every worker (a
        raw broadcast into its buffer, of which its stash is views)."""
        self._fill_flat()
        self.raw()

    def reload_only(self) -> None:
        """The weights already in the worker, through the same RPCs and reload bracket, no transfer."""
        self.rpc(worker_reload_start)
        self.rpc(worker_load_stash)
        self.rpc(worker_reload_finish)

    def side_by_side(self) -> None:
        """The transfer and the loading at once, uncoupled: ``raw``'s broadcast into a second buffer of each
        worker, received on a thread of its own, while the worker runs ``reload_only``'s three RPCs on
        the weights already in it (:func:`~weightsync.vllm_tools.bench_worker.worker_side_start`)."""

        async def rpcs() -> Any:
            await self._all(worker_side_start, ())
            await self._all(worker_load_stash, ())
            return await self._all(worker_side_finish, (self.timeout_s,))

        self._beside(rpcs(), "side_by_side", lambda: self._broadcast(self.flat))

    def weightsync(self) -> None:
        assert self.trainer is not None
        self.trainer.send_weights(weight_version=f"bench-{self.rounds}")

    def _fill_flat(self) -> None:
        off = 0
        for name, p in self.params:
            n = self.nbytes[name]
            self.flat[off : off + n].copy_(as_bytes(p.detach()))
            off += n

    # ------------------------------------------------------------------------------------ one round
    def round(self, method: str) -> RoundResult:
        """Negate the weights, send them with ``method`` inside a pause bracket, verify (module docstring)."""
        self.rounds += 1
        with torch.no_grad():
            for _, p in self.params:
                p.neg_()
        raw = method == "raw"
        if raw:
            self._fill_flat()
            sent = {RAW_KEY: crc32(self.flat)}
            sizes = {RAW_KEY: self.model_bytes}
        else:
            sent = _crcs(iter(self.params))
            sizes = self.nbytes
        fn: Callable[[], None] = getattr(self, method)
        if method in ("reload_only", "side_by_side"):
            self.fill_stash()
        self._run(self.llm.pause_generation(mode="keep"), self.timeout_s, "pause_generation")
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        self._run(self.llm.resume_generation(), self.timeout_s, "resume_generation")
        side = method == "side_by_side"
        reports = self.rpc(worker_report, raw, side)
        problems: list[str] = []
        if side:
            flat_crc = crc32(self.flat)
            problems += [
                f"worker {w}: the side-by-side transfer is not bit-exact"
                for w, rep in enumerate(reports)
                if rep.get("side_digest") != flat_crc
            ]
        good_bytes, checked = None, None
        for w, rep in enumerate(reports):
            ok_bytes, n_checked, wrong = _verify(rep, sent, sizes, raw)
            problems += [f"worker {w}: {p}" for p in wrong]
            good_bytes = ok_bytes if good_bytes is None else min(good_bytes, ok_bytes)
            checked = n_checked if checked is None else min(checked, n_checked)
        return RoundResult(
            seconds=seconds,
            reload_s=statistics.median(float(r["reload_s"]) for r in reports),
            load_s=statistics.median(float(r["load_s"]) for r in reports),
            bytes_verified=good_bytes or 0,
            engine_params_checked=checked or 0,
            ok=not problems and len(reports) == self.dp,
            problem="; ".join(problems) or ("" if len(reports) == self.dp else f"{len(reports)} reports"),
            timings=reports[0].get("timings", {}),
        )

    def close(self) -> None:
        """Tear everything down, best effort (each step bounded)."""
        steps: list[Callable[[], object]] = []
        if self.worker_ready:
            steps.append(lambda: self.rpc(worker_teardown))
        if self.trainer is not None:
            steps.append(self.trainer.shutdown)
        if self.group is not None:
            steps.append(self.group.close)
        if self.llm is not None:
            steps.append(lambda: shutdown_async_llm(self.llm, self.lt))
        for step in steps:
            with contextlib.suppress(Exception):
                step()
        self.lt.close()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _measure(
    bench: _Bench, reps: int, say: Callable[[str], None]
) -> tuple[dict[str, RoundResult], dict[str, list[RoundResult]]]:
    """One warm-up round per method, then ``reps`` interleaved repetitions (order rotated each time)."""
    warm = {m: bench.round(m) for m in METHODS}
    say("warm-up: " + ", ".join(f"{m} {r.seconds:.3f} s" for m, r in warm.items()))
    results: dict[str, list[RoundResult]] = {m: [] for m in METHODS}
    for rep in range(reps):
        k = rep % len(METHODS)
        order = METHODS[k:] + METHODS[:k]
        for m in order:
            results[m].append(bench.round(m))
        say(
            f"repetition {rep + 1}/{reps}: " + ", ".join(f"{m} {results[m][-1].seconds:.3f} s" for m in order)
        )
    return warm, results


def run_vllm_bench(
    quick: bool = False,
    repeats: int | None = None,
    bucket_bytes: int | None = None,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    timeout_s: float = 120.0,
    log: Callable[[str], None] | None = None,
    dp: tuple[int, ...] | None = None,
    steady_allocator: bool = True,
) -> dict[str, Any]:
    """Run the benchmark (:mod:`weightsync.bench.vllm`) and return its figures.

    Args:
        quick: the 6.5 MiB model, 1 MiB buckets, 2 repetitions and one engine worker (for tests).
        repeats: timed repetitions of every method (default 5; quick: 2).
        bucket_bytes: the packing buffer size of weightsync and of vLLM's packed path (default 64 MiB, the
            transfer bench's CPU default; quick: 1 MiB).
        num_buffers: their ``packed_num_buffers`` (default 2).
        timeout_s: deadline of every collective, RPC and rendezvous, seconds (the engine start gets 600 s).
        log: progress lines (e.g. ``print`` to stderr); None: silent.
        dp: the configurations, as numbers of DP engines of one worker each (default
            :data:`~weightsync.bench.vllm.DP_CONFIGS`; quick: ``(1,)``); one engine start each.
        steady_allocator: start the engines with :data:`STEADY_ALLOCATOR` (False: glibc's defaults); the
            values applied are reported as ``allocator``.

    Returns:
        :func:`~weightsync.bench.vllm.combined`: per configuration (``configurations``) and, at the top
        level, for the first: ``weightsync_gbps``, ``vllm_packed_gbps``, ``raw_gbps``, ``per_tensor_gbps``,
        ``per_tensor_bare_gbps``, ``reload_only_gbps`` (GB/s, medians; ``*_gbps_best`` from the fastest
        round), ``*_s`` (median seconds of every method, e.g. ``weightsync_s``, ``reload_only_s``),
        ``limit_s`` (max of ``raw_s`` and ``reload_only_s``), ``vs_vllm_packed``, ``vs_limit``
        (``limit_s / weightsync_s``), ``vs_side_by_side`` (``side_by_side_s / weightsync_s``),
        ``vs_limit_here`` (``limit_s`` / min(``side_by_side_s``, ``raw_s + reload_only_s``)), ``vs_raw``, ``vs_per_tensor``, ``vs_per_tensor_bare``, ``split``
        (the weightsync round's median time split on the first worker, seconds), ``reload_seconds``,
        ``verification`` (per method: rounds, rounds verified, bytes verified), ``methods``, ``targets``
        (every configuration's), ``targets_met``, ``targets_judged`` (False for ``quick``), ``verified``,
        ``ok``, ``loadavg``, ``loadavg_start``, ``vllm_version``, ``model_config`` and the settings.

    Raises:
        ValueError: ``repeats``, ``bucket_bytes``, ``num_buffers`` or an entry of ``dp`` not an integer >= 1,
            or ``timeout_s`` not a finite number > 0, before anything starts.
        RuntimeError: an engine did not start, or an RPC did not answer within ``timeout_s``.
        TransferTimeoutError / PeerFailedError: a collective of a baseline missed its deadline or failed;
            the weightsync round's own errors (``WeightsyncBroadcastTrainer.send_weights``).
    """
    reps = REPEATS[1] if quick else REPEATS[0]
    reps = reps if repeats is None else repeats
    bucket = (QUICK_BUCKET_BYTES if quick else DEFAULT_BUCKET_BYTES) if bucket_bytes is None else bucket_bytes
    configs = ((1,) if quick else DP_CONFIGS) if dp is None else tuple(dp)
    checks: list[tuple[str, object]] = [
        ("repeats", reps),
        ("bucket_bytes", bucket),
        ("num_buffers", num_buffers),
    ]
    checks += [("dp", v) for v in configs] or [("dp", None)]
    for what, v in checks:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"bench vllm: {what} must be an integer >= 1, got {v!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise ValueError(f"bench vllm: timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    say = log or (lambda _m: None)
    overrides = QUICK_MODEL if quick else FULL_MODEL
    loadavg_start = list(os.getloadavg())
    results: list[dict[str, Any]] = []
    allocator = {k: os.environ.get(k, v) for k, v in STEADY_ALLOCATOR.items()} if steady_allocator else {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="weightsync-bench-vllm-"))
        stack.enter_context(_env(INSECURE_ENV, "1"))
        for name, value in allocator.items():
            stack.enter_context(_env(name, value))
        model_dir = Path(tmp) / "llama"
        hf = build_tiny_llama(model_dir, **overrides)
        model_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        num_tensors = len(list(hf.parameters()))
        say(f"checkpoint: {model_bytes / 2**20:.1f} MiB in {model_dir}")
        for n in configs:
            bench: _Bench | None = None
            try:
                bench = _Bench(model_dir, hf, bucket, num_buffers, float(timeout_s), n)
                say(f"AsyncLLM (DP={n}) up in {bench.start_s:.1f} s (worker pids {bench.worker_pids})")
                warm, rounds = _measure(bench, reps, say)
                results.append(
                    figures(warm, rounds, quick=quick, dp=n, model_bytes=model_bytes, start_s=bench.start_s)
                )
            finally:
                if bench is not None:
                    bench.close()
    return combined(
        results,
        quick=quick,
        model_bytes=model_bytes,
        num_tensors=num_tensors,
        overrides=overrides,
        bucket=bucket,
        num_buffers=num_buffers,
        reps=reps,
        vllm_version=str(vllm.__version__),
        loadavg_start=loadavg_start,
    ) | {"allocator": allocator}


__all__ = ["run_vllm_bench"]
