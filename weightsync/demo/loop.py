"""``weightsync demo``: an asynchronous RL loop syncing a causal LM from a trainer into DP engines (issue 5).

Processes: the trainer is this process (a Hugging Face ``LlamaForCausalLM``/``Qwen2ForCausalLM``); the
front-end client spawns one DP coordinator and ``ranks`` engine-core processes
(:class:`~weightsync.impl.engine.client.DPEngineClient`). The engines build the reference
:class:`~weightsync.impl.models.CausalLM` from the trainer's ``config.json`` with **zero weights** and get
every weight through the transfer engines (``nccl`` broadcast over gloo, or ``ipc`` shared memory); they never
read a checkpoint. An initial sync (sync 0) loads the trainer's initial weights before any request is served.

The loop (one iteration per trainer step ``i = 1..steps``):

1. wait for rollout batch ``i`` (``prompts_per_step`` prompts x ``group_size`` samples, temperature sampling,
   one seed per request) and score it with the task's verifiable reward;
2. submit rollout batch ``i + 1`` to the engines -- it is in flight during steps 3 and 4;
3. the trainer computes a GRPO update from batch ``i``'s samples and the engines' log-probabilities
   (:meth:`weightsync.demo.trainer.Trainer.trainer_step`);
4. the controller runs ``pause(mode) -> start_weight_update -> update_weights`` (the trainer sends
   concurrently, packed) ``-> finish_weight_update(weight_version="step-i") -> resume``
   (:func:`weightsync.impl.engine.controller.update_round`: it resumes only on a complete set of weights,
   never after weights started moving in a failed round; the spec's controller policy ``one_round``). The
   trainer is vLLM 0.32's API over weightsync's transports
   (:class:`~weightsync.impl.transfer.trainer.BroadcastTrainerEngine` /
   :class:`~weightsync.impl.transfer.trainer.IPCTrainerEngine`, ``trainer_init(init_info, client=...,
   source=...)``) with the checked engine client as its client; its source declares the checkpoint
   tensors up front and streams them bucket by bucket. With ``keep`` the
   requests of batch ``i + 1`` still in flight are frozen and finish after resume under the new weights
   (``clear_cache=True``: their KV is recomputed); with ``abort`` they end with ``finish_reason="abort"`` and
   the next step trains on the finished samples only;
5. checks: every rank reports ``weight_version`` ``"step-i"`` (``"step-0"`` after the initial sync); on the
   fixed probe prompts every engine's logits equal the trainer's (``torch.equal`` in float32; otherwise the
   max abs difference is reported).

The runtime checker is on by default: :class:`~weightsync.impl.checked.CheckedEngine` wraps the client, checks
every controller call against every rank's spec table and records the trace ``weightsync replay`` validates.

Failure handling: every wait has a deadline (``timeout_s``). When an engine process dies (e.g. the test-only
``kill_rank_during_update`` hook SIGKILLs one in the middle of an update), the demo notices within 0.1 s,
the trainer's send and the surviving engines fail with their transport errors within ``timeout_s``, and the
result names the dead rank (``ok`` false, ``error``).

The engine-side hooks are :mod:`weightsync.demo.worker`, the client adapter :mod:`weightsync.demo.guard`,
the checks :mod:`weightsync.demo.checks` and the rendering :mod:`weightsync.demo.render`.
"""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightsync.demo.checks import (
    aborts_in_flight,
    demo_checks,
    describe_failure,
    kept_violations,
    probe_diff,
    torch_threads,
)
from weightsync.demo.config import TRANSPORTS, DemoConfig, DemoUsageError, SyncRecord, default_trace_path
from weightsync.demo.guard import ClientGuard
from weightsync.demo.rl_task import EOS_ID, DigitPatternTask, Prompt, Sample
from weightsync.demo.trainer import load_trainer_model
from weightsync.spec.errors import WeightSyncError

__all__ = ["run_demo"]


@dataclass
class _Batch:
    prompts: dict[str, Prompt] = field(default_factory=dict)
    streams: list[Any] = field(default_factory=list)


def run_demo(
    cfg: DemoConfig, on_event: Callable[[str, dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the demo loop (see the module docstring) and return its figures.

    Args:
        cfg: the settings.
        on_event: called as ``on_event(kind, data)`` for progress rendering: ``"start"`` (model and cluster
            figures), ``"sync"`` (a :class:`SyncRecord` as a dict), ``"step"`` (trainer metrics) and
            ``"done"`` (the result).

    Returns:
        One JSON-able dict: ``ok`` (every check held), ``checks`` (name -> bool), ``steps``, ``syncs``,
        ``lost_requests``, ``aborted_requests``, ``kept_in_flight``, ``requests``, ``max_logit_diff``,
        ``reward_first``, ``reward_last``, ``rewards`` (per step), ``reward_final`` (rollouts after the last
        sync), ``seconds``, ``weight_versions`` (per rank, at the end), ``trace``, ``records`` (one per sync),
        ``error`` (None or the failure, naming a dead rank), ``dead_ranks`` and the run's settings.

    Raises:
        DemoUsageError: bad settings or a bad ``model_dir`` (before any process starts).
    """
    cfg.validate()
    emit = on_event or (lambda kind, data: None)
    t_start = time.perf_counter()
    model = load_trainer_model(cfg)
    return _Run(cfg, model, emit, t_start).run()


class _Run:
    """State of one demo run (see :func:`run_demo`)."""

    def __init__(
        self, cfg: DemoConfig, model: Any, emit: Callable[[str, dict[str, Any]], None], t_start: float
    ) -> None:
        from weightsync.demo.trainer import Trainer, TrainerConfig

        self.cfg = cfg
        self.model = model
        self.emit = emit
        self.t_start = t_start
        self.task = DigitPatternTask(seed=cfg.seed)
        self.trainer = Trainer(
            model, self.task, TrainerConfig(lr=cfg.lr, temperature=cfg.temperature, clip_eps=cfg.clip_eps)
        )
        self.dtype = next(model.parameters()).dtype
        self.exact = self.dtype == torch.float32
        self.records: list[SyncRecord] = []
        self.rewards: list[float | None] = []
        self.step_metrics: list[dict[str, float]] = []
        self.streams: list[Any] = []  # every request sent, as its RequestStream
        self.requests = self.finished = self.aborted = self.lost = 0
        self.kept_bad = 0  # keep mode: a kept request that did not finish with all its tokens
        self.errors: list[str] = []
        self.dead: list[int] = []
        #: the engines were admitted by the authenticated rendezvous (the deployment's secret on both sides)
        self.authenticated = False
        self.reward_final: float | None = None
        self.trace_path: pathlib.Path | None = None
        self._req_seq = 0
        self._inflight: _Batch | None = None
        self._pause_snapshot: tuple[int, int, int] = (0, 0, 0)

    # ------------------------------------------------------------------ rollouts
    def _submit(self, client: Any, prompts: list[Prompt], b: _Batch | None = None) -> _Batch:
        """Send ``group_size`` requests per prompt (one sampling seed each); append them to ``b``."""
        from weightsync.impl.models.sampling import SamplingParams

        b = b if b is not None else _Batch()
        for p in prompts:
            for _ in range(self.cfg.group_size):
                self._req_seq += 1
                params = SamplingParams(
                    temperature=self.cfg.temperature,
                    max_new_tokens=self.task.max_new_tokens,
                    seed=self.cfg.seed * 1_000_003 + self._req_seq,
                    stop_token_ids=(EOS_ID,),
                )
                s = client.add_request(list(p.tokens), params, req_id=f"r{self._req_seq}")
                b.prompts[s.req_id] = p
                b.streams.append(s)
                self.streams.append(s)
        return b

    def _wait_started(self, guard: ClientGuard, streams: list[Any]) -> None:
        """Wait (at most ``min(timeout_s, 10)`` s) until every rank serving one of ``streams`` has produced a
        token for one of them, so the sync that follows catches them mid-generation."""
        ranks = {s.rank for s in streams}
        deadline = time.monotonic() + min(self.cfg.timeout_s, 10.0)
        while time.monotonic() < deadline:
            started = {s.rank for s in streams if s.tokens or s.done.is_set()}
            if started >= ranks:
                return
            guard.raise_if_dead("rollouts")
            time.sleep(0.002)

    def _wait(self, guard: ClientGuard, b: _Batch) -> list[Sample]:
        """Wait for every request of ``b`` (deadline ``timeout_s``); return the finished samples."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while any(not s.done.is_set() for s in b.streams) and time.monotonic() < deadline:
            guard.raise_if_dead("rollouts")
            if guard.client.failures:
                r, f = next(iter(sorted(guard.client.failures.items())))
                raise WeightSyncError(f"engine rank {r} failed in {f.phase}: {f.error}")
            time.sleep(0.005)
        out: list[Sample] = []
        for s in b.streams:
            if s.done.is_set() and s.finish_reason != "abort":
                out.append(
                    Sample(
                        prompt=b.prompts[s.req_id],
                        completion_tokens=list(s.tokens),
                        logprobs=list(s.logprobs),
                        weight_version=s.versions[0] if s.versions else "default",
                    )
                )
        return out

    def _on_pause_done(self) -> None:
        b = self._inflight
        if b is None:
            self._pause_snapshot = (0, 0, 0)
            return
        kept = [s for s in b.streams if not s.done.is_set()]
        aborted = sum(1 for s in b.streams if s.done.is_set() and s.finish_reason == "abort")
        mid = sum(1 for s in kept if s.tokens)
        self._pause_snapshot = (len(kept), mid, aborted)

    # ------------------------------------------------------------------ one sync
    def _sync(
        self,
        engine: Any,
        guard: ClientGuard,
        trainer: Any,
        nbytes: int,
        buckets: int,
        probe_dir: pathlib.Path,
        index: int,
        reward: float | None,
    ) -> SyncRecord:
        from weightsync.impl.engine.controller import update_round

        t0 = time.perf_counter()
        times = update_round(
            engine,
            trainer,
            mode=self.cfg.mode,
            clear_cache=self.cfg.clear_cache,
            timeout=self.cfg.timeout_s,
            weight_version=f"step-{index}",
        )
        round_s = time.perf_counter() - t0
        kept, mid, aborted = self._pause_snapshot
        versions = guard.client.get_weight_versions()
        same = len(set(versions)) == 1
        diff, equal = probe_diff(self.model, probe_dir, index + 1, self.cfg.ranks, self.cfg.timeout_s)
        rec = SyncRecord(
            sync=index,
            weight_version=versions[0] if same else None,
            weight_versions=versions,
            bytes=nbytes,
            buckets=buckets,
            seconds=times.update_s,
            round_seconds=round_s,
            gbps=nbytes / times.update_s / 1e9 if times.update_s > 0 else 0.0,
            pause_s=times.pause_s,
            start_s=times.start_s,
            finish_s=times.finish_s,
            resume_s=times.resume_s,
            kept_in_flight=kept,
            kept_mid_generation=mid,
            aborted=aborted,
            max_logit_diff=diff,
            logits_equal=equal,
            reward_mean=reward,
        )
        self.records.append(rec)
        self.emit("sync", asdict(rec))
        return rec

    def _check_kept(self, b: _Batch | None) -> None:
        """A mode that keeps requests in flight (wait, keep): count the requests of ``b`` that did not finish
        properly (:func:`kept_violations`)."""
        if b is not None and not aborts_in_flight(self.cfg.mode):
            self.kept_bad += kept_violations(b.streams, self.task.max_new_tokens)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        from weightsync.demo.trainer import iter_checkpoint_weights, save_config
        from weightsync.impl.checked import CheckedEngine
        from weightsync.impl.engine.client import DPEngineClient, free_port
        from weightsync.impl.engine.config import EngineConfig
        from weightsync.impl.models.config import LMConfig
        from weightsync.impl.transfer import trainer as tx
        from weightsync.impl.transfer.base import meta_of
        from weightsync.impl.transfer.packing import plan_buckets

        cfg = self.cfg
        backend = TRANSPORTS[cfg.transport]
        tmp = tempfile.TemporaryDirectory(prefix="weightsync-demo-")
        probe_dir = pathlib.Path(tmp.name) / "probes"
        probe_dir.mkdir()
        lm_cfg = LMConfig.from_json_file(save_config(self.model, tmp.name))
        ecfg = EngineConfig(
            dp_size=cfg.ranks,
            model=lm_cfg,
            variant=cfg.variant,
            sync_interval=cfg.sync_interval,
            init_seed=None,  # zero weights: everything arrives through the transfer engines
            collective_timeout_s=cfg.timeout_s,
            transfer=f"weightsync.demo.worker:demo_{'ipc' if cfg.transport == 'ipc' else 'broadcast'}_worker",
            max_batch=cfg.prompts_per_step * cfg.group_size,
        )
        weights = list(iter_checkpoint_weights(self.model))
        metas = [meta_of(n, t) for n, t in weights]
        nbytes = sum(m.nbytes for m in metas)
        buckets = len(plan_buckets([m.nbytes for m in metas], cfg.bucket_bytes, True))
        model = self.model

        class CheckpointSource:
            """The trainer's checkpoint tensors as a WeightSource: declared up front, streamed per bucket."""

            def metadata(self) -> list[tx.ParamMeta]:
                return [tx.ParamMeta(m.name, m.dtype, m.shape) for m in metas]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter_checkpoint_weights(model)

        del weights  # the source streams them afresh every round
        self.emit(
            "start",
            {
                "ranks": cfg.ranks,
                "transport": cfg.transport,
                "backend": backend,
                "mode": cfg.mode,
                "variant": cfg.variant,
                "parameters": sum(m.numel for m in metas),
                "tensors": len(metas),
                "bytes": nbytes,
                "dtype": str(self.dtype).removeprefix("torch."),
                "architecture": lm_cfg.architecture,
                "steps": cfg.steps,
            },
        )
        client: Any = None
        engine: Any = None
        tr: Any = None
        error: str | None = None
        guard: ClientGuard | None = None
        try:
            client = DPEngineClient(ecfg, start_timeout_s=max(90.0, cfg.timeout_s)).start()
            guard = ClientGuard(client, cfg.timeout_s)
            guard.on_pause_done = self._on_pause_done
            engine = guard
            if cfg.check:
                self.trace_path = pathlib.Path(cfg.trace) if cfg.trace else default_trace_path()
                self.trace_path.parent.mkdir(parents=True, exist_ok=True)
                engine = CheckedEngine(guard, trace_path=self.trace_path)
            # ---- transfer group: the trainer hosts the store (rank 0) while every engine joins
            guard.init_extra["demo_probe_dir"] = str(probe_dir)
            if cfg.kill_rank_during_update is not None:
                guard.init_extra["demo_kill"] = {
                    "rank": cfg.kill_rank_during_update,
                    "round": cfg.kill_at_sync + 1,
                }
            tinfo: dict[str, Any] = {
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "world_size": 1 + cfg.ranks,
                "packed": True,
                "packed_buffer_size_bytes": cfg.bucket_bytes,
                "packed_num_buffers": cfg.packed_num_buffers,
                "timeout_s": cfg.timeout_s,
                "rank": 0,
            }
            if backend == "nccl":
                tr = tx.BroadcastTrainerEngine.trainer_init(
                    tx.TrainerInitInfo(**tinfo, group_backend="gloo"),  # the demo's tensors live on the CPU
                    client=engine,
                    source=CheckpointSource(),
                )
            else:
                tr = tx.IPCTrainerEngine.trainer_init(
                    tx.IPCTrainerInitInfo(**tinfo, device="cpu"), client=engine, source=CheckpointSource()
                )

            self.authenticated = tr.authenticated
            # ---- sync 0: the engines' initial weights, before any request is served
            try:
                self._sync(engine, guard, tr, nbytes, buckets, probe_dir, 0, None)
                half = cfg.prompts_per_step // 2 if cfg.overlap_prompts is None else cfg.overlap_prompts
                batch: _Batch | None = None
                if cfg.steps > 0:
                    batch = self._submit(client, self.task.batch(cfg.prompts_per_step))
                for step in range(1, cfg.steps + 1):
                    assert batch is not None
                    samples = self._wait(guard, batch)
                    self._check_kept(batch)
                    # the next rollouts: the first half overlaps the trainer step, the second half is
                    # submitted after it and is in flight (mid-generation) when the sync pauses the engines
                    prompts = self.task.batch(cfg.prompts_per_step)
                    nxt = self._submit(client, prompts[:half])
                    self._inflight = nxt
                    reward: float | None = None
                    if samples:
                        with torch_threads(1):
                            m = self.trainer.trainer_step(samples)
                        self.step_metrics.append(m)
                        reward = m["reward_mean"]
                    self.rewards.append(reward)
                    self.emit("step", {"step": step, "reward_mean": reward, "samples": len(samples)})
                    n0 = len(nxt.streams)
                    self._submit(client, prompts[half:], nxt)
                    self._wait_started(guard, nxt.streams[n0:])
                    self._sync(engine, guard, tr, nbytes, buckets, probe_dir, step, reward)
                    batch, self._inflight = nxt, None
                if batch is not None:  # rollouts of the final policy (in flight during the last sync)
                    final = self._wait(guard, batch)
                    self._check_kept(batch)
                    if final:
                        self.reward_final = sum(
                            self.task.reward(s.prompt, s.completion_tokens) for s in final
                        ) / len(final)
            except BaseException as exc:
                error = self._describe_failure(exc, guard, tr)
                if not isinstance(exc, Exception):
                    raise
        except DemoUsageError:
            raise
        except Exception as exc:
            if error is None:
                error = self._describe_failure(exc, guard, tr)
        finally:
            if client is not None and guard is not None and not guard.dead():
                with contextlib.suppress(Exception):
                    if error is None:
                        # Stop tracing only once every rank left the wave: a rank that stopped tracing while
                        # its peers still step would leave them completing DP collectives it never entered
                        # in the trace (replay rejects that as an unmatched collective).
                        client.wait_for(
                            lambda: all(not v.get("engines_running", False) for v in client.rank_vars),
                            cfg.timeout_s,
                            "every rank idle",
                        )
                    client.trace_to(None)  # close the engines' trace files
            # engines first: the trainer hosts the store their transfer engines are connected to
            if client is not None:
                client.shutdown()
            if tr is not None:
                with contextlib.suppress(Exception):
                    tr.shutdown()
            tmp.cleanup()
        return self._result(error, list(getattr(engine, "violations", []) or []))

    def _describe_failure(self, exc: BaseException, guard: ClientGuard | None, trainer: Any) -> str:
        """One message naming the dead rank (if any) and every error (:func:`describe_failure`)."""
        msg, dead = describe_failure(exc, guard, trainer, self.cfg.ranks, self.cfg.timeout_s)
        if dead:
            self.dead = dead
        return msg

    def _result(self, error: str | None, engine_violations: list[str]) -> dict[str, Any]:
        cfg = self.cfg
        # every request ends finished or aborted; one still unfinished here (after the waits) is lost
        self.requests = len(self.streams)
        self.aborted = sum(1 for s in self.streams if s.done.is_set() and s.finish_reason == "abort")
        self.lost = sum(1 for s in self.streams if not s.done.is_set())
        self.finished = self.requests - self.aborted - self.lost
        rs = self.records
        rewards = [r for r in self.rewards if r is not None]
        max_diff = max((r.max_logit_diff for r in rs), default=None)
        checks = demo_checks(
            cfg,
            rs,
            error=error,
            lost=self.lost,
            aborted=self.aborted,
            kept_bad=self.kept_bad,
            exact=self.exact,
            violations=engine_violations,
        )
        result: dict[str, Any] = {
            "ok": all(checks.values()),
            "checks": checks,
            "error": error,
            "dead_ranks": self.dead,
            "authenticated": self.authenticated,
            "steps": len(self.rewards),
            "syncs": len(rs),
            "requests": self.requests,
            "finished_requests": self.finished,
            "lost_requests": self.lost,
            "aborted_requests": self.aborted,
            "kept_in_flight": sum(r.kept_in_flight for r in rs),
            "max_logit_diff": max_diff,
            "exact_dtype": self.exact,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "reward_final": self.reward_final,
            "rewards": self.rewards,
            "train": [
                {k: m[k] for k in ("step", "reward_mean", "loss", "clip_frac", "approx_kl", "num_samples")}
                for m in self.step_metrics
            ],
            "seconds": time.perf_counter() - self.t_start,
            "weight_versions": rs[-1].weight_versions if rs else [],
            "trace": str(self.trace_path) if self.trace_path is not None else None,
            "checker_violations": engine_violations,
            "records": [asdict(r) for r in rs],
            "ranks": cfg.ranks,
            "transport": cfg.transport,
            "mode": cfg.mode,
            "variant": cfg.variant,
            "seed": cfg.seed,
            "model": cfg.model_dir or "default (LlamaForCausalLM, seed-built)",
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        self.emit("done", result)
        return result
