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
   (:meth:`weightsync.impl.trainer.Trainer.trainer_step`);
4. the controller runs ``pause(mode) -> start_weight_update -> update_weights`` (the trainer sends
   concurrently, packed) ``-> finish_weight_update(weight_version="step-i") -> resume``
   (:func:`weightsync.impl.engine.controller.update_round`, resume in a ``finally``). The trainer is
   vLLM 0.32's API over weightsync's transports
   (:class:`~weightsync.impl.transfer.trainer.BroadcastTrainerEngine` /
   :class:`~weightsync.impl.transfer.trainer.IPCTrainerEngine`, ``trainer_init(init_info, client=...,
   source=...)``) with the checked engine client as its client; its source declares the checkpoint
   tensors up front and streams them bucket by bucket. With ``keep`` the
   requests of batch ``i + 1`` still in flight are frozen and finish after resume under the new weights
   (``clear_cache=True``: their KV is recomputed); with ``abort`` they end with ``finish_reason="abort"`` and
   the next step trains on the finished samples only;
5. checks: every rank reports ``weight_version`` ``"step-i"`` (``"step-0"`` after the initial sync); on the
   fixed probe prompts every
   engine's logits equal the trainer's (``torch.equal`` in float32; otherwise the max abs difference is
   reported).

The runtime checker is on by default: :class:`~weightsync.impl.checked.CheckedEngine` wraps the client,
checks every controller call against the spec table of every rank and records the JSONL trace that
``weightsync replay`` validates.

Failure handling: every wait has a deadline (``timeout_s``). When an engine process dies (e.g. the test-only
``kill_rank_during_update`` hook SIGKILLs one in the middle of an update), the demo notices within 0.1 s,
the trainer's send and the surviving engines fail with their transport errors within ``timeout_s``, and the
result names the dead rank (``ok`` false, ``error``).

Engine-side adapter (a thin layer, since the engine exposes no probe query): the engines' transfer worker is
:func:`demo_broadcast_worker` / :func:`demo_ipc_worker`, a :class:`DemoWorker` around the real
:class:`~weightsync.impl.transfer.worker.WeightTransferWorker`. After each ``finish_weight_update`` it writes
the engine's probe logits to a file the trainer compares with its own; its ``init_info`` may carry the
demo-only keys ``demo_probe_dir`` and ``demo_kill`` (added by the client adapter to the trainer's
``init_info``), stripped before the real worker sees it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pathlib
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.rl_task import EOS_ID, DigitPatternTask, Prompt, Sample
from weightsync.impl.transfer.base import ParallelInfo
from weightsync.impl.transfer.worker import WeightTransferWorker
from weightsync.spec.errors import WeightSyncError
from weightsync.spec.rank import version_order

__all__ = [
    "DemoConfig",
    "DemoUsageError",
    "DemoWorker",
    "EngineDiedError",
    "demo_broadcast_worker",
    "demo_ipc_worker",
    "render_summary",
    "run_demo",
]

KILL_ENV = "WEIGHTSYNC_DEMO_KILL_RANK"
"""Test-only: ``"R"`` or ``"R:S"`` makes the CLI kill engine rank R in the middle of sync S (default 1)."""

TRANSPORTS = {"broadcast": "nccl", "ipc": "ipc"}
"""Demo transport name -> registered weight-transfer backend."""
_CPU_WIRE = {"nccl": "gloo for CPU tensors", "ipc": "CPU shared memory"}
"""What each backend runs on for the demo's CPU tensors (shown in the header)."""


class DemoUsageError(WeightSyncError, ValueError):
    """Bad demo input (unknown transport/mode/variant, bad ``--model`` directory, non-positive sizes).

    The CLI maps it to exit code 2.
    """


class EngineDiedError(WeightSyncError):
    """An engine process exited while the demo needed it.

    Attributes:
        ranks: the dead DP ranks.
        phase: what the demo was waiting for (e.g. ``"update_weights"``).
        exitcodes: rank -> process exit code (negative: killed by that signal).
    """

    def __init__(self, ranks: list[int], phase: str, exitcodes: dict[int, int | None], pids: dict[int, int]):
        self.ranks = ranks
        self.phase = phase
        self.exitcodes = exitcodes
        parts = []
        for r in ranks:
            code = exitcodes.get(r)
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-code).name}"
                    parts.append(f"engine rank {r} (pid {pids.get(r)}) died, {how}")
                    continue
            parts.append(f"engine rank {r} (pid {pids.get(r)}) died, exit code {code}")
        super().__init__(f"{'; '.join(parts)}, during {phase}")


# ==================================================================================== engine-side adapter


class _KillSwitchModel:
    """A model proxy whose ``load_weights`` SIGKILLs this process after the first loaded bucket when armed.

    Only the test-only kill hook uses it; otherwise every call goes straight to the model.
    """

    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self.armed = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self._model.load_weights(weights)
        if self.armed:  # mid-update: one bucket loaded, the rest still on the wire
            os.kill(os.getpid(), signal.SIGKILL)
        return loaded

    def checkpoint_weight_names(self) -> set[str]:
        return self._model.checkpoint_weight_names()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self._model.named_parameters()

    def process_weights_after_loading(self) -> None:
        self._model.process_weights_after_loading()

    def __getattr__(self, name: str) -> Any:  # checkpoint_weight_dtypes and anything else
        return getattr(self._model, name)


class DemoWorker:
    """The engines' weight-transfer worker in the demo: the real worker plus the probe and kill hooks.

    Args:
        model: the engine's reference LM.
        dp_index: the engine's DP index.
        backend: ``"nccl"`` (broadcast over gloo on CPU) or ``"ipc"`` (CPU shared memory).

    ``init_info`` may carry ``demo_probe_dir`` (after every finished round the engine writes its probe logits
    to ``<dir>/rank<dp_index>-round<k>.pt``, ``k`` = completed rounds) and ``demo_kill``
    (``{"rank": r, "round": k}``: rank ``r`` kills itself with SIGKILL after loading the first bucket of round
    ``k``). Both are removed before the real worker parses ``init_info``.
    """

    def __init__(self, model: CausalLM, dp_index: int, backend: str) -> None:
        self.model = model
        self.dp_index = dp_index
        self._proxy = _KillSwitchModel(model)
        kwargs: dict[str, Any] = {"device": "cpu"} if backend == "ipc" else {}
        self.inner = WeightTransferWorker(
            self._proxy, backend, ParallelInfo(dp_index=dp_index), name=f"engine {dp_index} worker", **kwargs
        )
        self.probe_dir: str | None = None
        self.kill: dict[str, int] | None = None
        self.rounds_started = 0

    @property
    def weight_version(self) -> int:
        """Completed rounds."""
        return self.inner.weight_version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Strip the demo keys, then join the transfer group (see the real worker for errors)."""
        info = dict(init_info)
        probe = info.pop("demo_probe_dir", None)
        kill = info.pop("demo_kill", None)
        self.inner.init_weight_transfer_engine(info)
        self.probe_dir = str(probe) if probe else None
        self.kill = {"rank": int(kill["rank"]), "round": int(kill["round"])} if kill else None

    def start_weight_update(self) -> None:
        """Open a round (the real worker's ``start_weight_update``)."""
        self.inner.start_weight_update()
        self.rounds_started += 1

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive the round's weights (arming the kill switch when this is the chosen rank and round)."""
        k = self.kill
        self._proxy.armed = k is not None and k["rank"] == self.dp_index and k["round"] == self.rounds_started
        self.inner.update_weights(update_info)

    def fail_round(self) -> None:
        """The round failed (the engine's table moved the rank to ``failed``): the real worker abandons it."""
        self.inner.fail_round()

    def fail_init(self) -> None:
        """The init failed: the real worker must be initialised again."""
        self.inner.fail_init()

    def finish_weight_update(self) -> None:
        """Close the round, then write this engine's probe logits (when ``demo_probe_dir`` was given)."""
        self.inner.finish_weight_update()
        if self.probe_dir is None:
            return
        from weightsync.impl.trainer import probe_prompt_tokens

        with torch.no_grad():
            logits = [t.detach().cpu() for t in self.model.probe_logits(probe_prompt_tokens())]
        path = pathlib.Path(self.probe_dir) / f"rank{self.dp_index}-round{self.inner.weight_version}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(logits, tmp)
        os.replace(tmp, path)


def demo_broadcast_worker(model: CausalLM, dp_index: int) -> DemoWorker:
    """Engine transfer factory (``EngineConfig.transfer="weightsync.impl.demo:demo_broadcast_worker"``)."""
    return DemoWorker(model, dp_index, "nccl")


def demo_ipc_worker(model: CausalLM, dp_index: int) -> DemoWorker:
    """Engine transfer factory for the IPC transport (CPU shared memory)."""
    return DemoWorker(model, dp_index, "ipc")


# ======================================================================================= client adapter


class _Guard:
    """Pass-through of the engine client whose controller calls fail fast when an engine process dies.

    Each call runs in a helper thread; the caller polls the engines' liveness every 50 ms and raises
    :class:`EngineDiedError` (naming the rank) instead of waiting for the client's own reply deadline.
    Calls without a timeout get ``timeout``; ``init_weight_transfer_engine`` adds ``init_extra`` (the demo
    keys) to the trainer's ``init_info``.
    """

    _WATCHED = frozenset(
        {
            "pause",
            "resume",
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        }
    )

    def __init__(self, client: Any, timeout: float | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self.init_extra: dict[str, Any] = {}
        self.on_pause_done: Callable[[], None] | None = None

    def dead(self) -> dict[int, int | None]:
        """DP rank -> exit code of every engine process that is no longer alive."""
        out: dict[int, int | None] = {}
        for r, p in enumerate(self.client.procs[1 : 1 + self.client.dp_size]):
            if not p.is_alive():
                out[r] = p.exitcode
        return out

    def pids(self) -> dict[int, int]:
        return {r: int(p.pid or -1) for r, p in enumerate(self.client.procs[1 : 1 + self.client.dp_size])}

    def raise_if_dead(self, phase: str) -> None:
        """Raise :class:`EngineDiedError` if an engine process exited."""
        d = self.dead()
        if d:
            raise EngineDiedError(sorted(d), phase, d, self.pids())

    def _watch(self, phase: str, fn: Callable[[], Any]) -> Any:
        box: list[Any] = []
        err: list[BaseException] = []

        def run() -> None:
            try:
                box.append(fn())
            except BaseException as exc:
                err.append(exc)

        th = threading.Thread(target=run, name=f"weightsync-demo-{phase}", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.05)
            if th.is_alive():
                self.raise_if_dead(phase)
        if err:
            self.raise_if_dead(phase)  # a dead peer explains the error better than its symptom
            raise err[0]
        return box[0] if box else None

    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None) -> None:
        self._watch("pause", lambda: self.client.pause(mode, clear_cache, self._t(timeout)))
        if self.on_pause_done is not None:
            self.on_pause_done()

    def resume(self, timeout: float | None = None) -> None:
        self._watch("resume", lambda: self.client.resume(self._t(timeout)))

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        info = {**init_info, **self.init_extra}
        t = self._t(timeout)
        self._watch(
            "init_weight_transfer_engine", lambda: self.client.init_weight_transfer_engine(info, timeout=t)
        )

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        t = self._t(timeout)
        self._watch("start_weight_update", lambda: self.client.start_weight_update(timeout=t))

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        t = self._t(timeout)
        self._watch("update_weights", lambda: self.client.update_weights(update_info, timeout=t))

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        t = self._t(timeout)
        self._watch(
            "finish_weight_update",
            lambda: self.client.finish_weight_update(weight_version, monotonic=monotonic, timeout=t),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


# ============================================================================================ the loop


@dataclass
class DemoConfig:
    """Settings of one demo run.

    Attributes:
        ranks: DP engine ranks (>= 1).
        steps: trainer steps; one weight sync follows each (plus the initial sync).
        transport: ``"broadcast"`` (registered as ``nccl``; gloo on CPU) or ``"ipc"`` (CPU shared memory).
        mode: pause mode of every sync: ``"keep"``, ``"abort"`` or ``"wait"``.
        model_dir: a local Hugging Face checkpoint (config.json + safetensors), or None for the default
            policy built from ``seed``.
        seed: seeds the model init, the task's prompt draws and the per-request sampling seeds.
        variant: protocol variant the engines and the checker run.
        timeout_s: deadline of every collective, rendezvous, controller call and rollout wait, seconds.
        trace: JSONL trace path (None: ``traces/demo-<time>-<pid>.jsonl`` under the working directory).
        check: run the runtime checker (CheckedEngine) and record the trace.
        prompts_per_step, group_size: rollout batch = prompts x samples per prompt (GRPO groups).
        temperature: sampling temperature of the engines (the trainer's log-probs use the same).
        lr: Adam learning rate of the trainer; clip_eps: its PPO clip range.
        overlap_prompts: prompts of the next rollout batch submitted *before* the trainer step (generated
            concurrently with it, on the previous weights); the rest are submitted after it and are in flight
            when the sync pauses the engines. None: half of ``prompts_per_step``.
        sync_interval: K, the engines' DP sync all-reduce cadence in steps (vLLM's 32).
        bucket_bytes: packed buffer size B in bytes; packed_num_buffers: pipelined buffers.
        clear_cache: the pause's ``clear_cache`` (keep: recompute frozen requests' KV with new weights).
        kill_rank_during_update: test-only fault injection: this DP rank SIGKILLs itself after loading the
            first bucket of sync ``kill_at_sync`` (0 = the initial sync).
        kill_at_sync: see above.
    """

    ranks: int = 2
    steps: int = 20
    transport: str = "broadcast"
    mode: str = "keep"
    model_dir: str | None = None
    seed: int = 0
    variant: str = "two-phase-epoch"
    timeout_s: float = 60.0
    trace: str | None = None
    check: bool = True
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    lr: float = 2e-3
    clip_eps: float = 0.2
    overlap_prompts: int | None = None
    sync_interval: int = 32
    bucket_bytes: int = 4 << 20
    packed_num_buffers: int = 2
    clear_cache: bool = True
    kill_rank_during_update: int | None = None
    kill_at_sync: int = 1

    def validate(self) -> None:
        """Raise :class:`DemoUsageError` naming the first bad setting."""
        from weightsync.spec.rank import get_variant

        if self.ranks < 1:
            raise DemoUsageError(f"--ranks must be >= 1, got {self.ranks}")
        if self.steps < 0:
            raise DemoUsageError(f"--steps must be >= 0, got {self.steps}")
        if self.transport not in TRANSPORTS:
            raise DemoUsageError(f"--transport {self.transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if self.mode not in ("keep", "abort", "wait"):
            raise DemoUsageError(f"--mode {self.mode!r}: choose one of keep, abort, wait")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise DemoUsageError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise DemoUsageError("prompts_per_step and group_size must be >= 1")
        if self.bucket_bytes < 1 or self.packed_num_buffers < 1:
            raise DemoUsageError("bucket_bytes and packed_num_buffers must be >= 1")
        try:
            get_variant(self.variant)
        except ValueError as exc:
            raise DemoUsageError(str(exc)) from None
        if self.kill_rank_during_update is not None and not 0 <= self.kill_rank_during_update < self.ranks:
            raise DemoUsageError(f"kill rank {self.kill_rank_during_update} outside [0, {self.ranks})")


@dataclass
class SyncRecord:
    """Figures of one weight sync (one row of the demo's table).

    Attributes:
        sync: 0 for the initial sync, then the trainer step that produced the weights.
        weight_version: the version every rank reports afterwards (``"step-<sync>"``; None if they
            disagree).
        weight_versions: each rank's reported version.
        bytes: payload bytes the trainer sent (each engine receives all of them).
        buckets: packed buckets per engine.
        seconds: the update phase (update_weights concurrently with the trainer's send), seconds.
        round_seconds: pause -> resume, seconds.
        gbps: ``bytes / seconds / 1e9``.
        pause_s, start_s, finish_s, resume_s: per-phase seconds.
        kept_in_flight: requests unfinished when the pause completed (keep: frozen, finish after resume).
        kept_mid_generation: of those, requests that had already generated tokens (tokens on both sides of
            the sync).
        aborted: requests the pause aborted (abort mode).
        max_logit_diff: max abs difference of probe logits, engine vs trainer, over ranks and prompts.
        logits_equal: ``torch.equal`` held for every rank and probe prompt.
        reward_mean: mean reward of the samples of the trainer step that produced these weights.
    """

    sync: int
    weight_version: str | None
    weight_versions: list[str]
    bytes: int
    buckets: int
    seconds: float
    round_seconds: float
    gbps: float
    pause_s: float
    start_s: float
    finish_s: float
    resume_s: float
    kept_in_flight: int
    kept_mid_generation: int
    aborted: int
    max_logit_diff: float
    logits_equal: bool
    reward_mean: float | None


@dataclass
class _Batch:
    prompts: dict[str, Prompt] = field(default_factory=dict)
    streams: list[Any] = field(default_factory=list)


def _default_trace_path() -> pathlib.Path:
    d = pathlib.Path("traces")
    d.mkdir(parents=True, exist_ok=True)
    return d / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _load_trainer_model(cfg: DemoConfig) -> Any:
    from weightsync.impl.trainer import build_default_model, load_hf_model

    if cfg.model_dir is None:
        return build_default_model(cfg.seed)
    try:
        return load_hf_model(cfg.model_dir)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DemoUsageError(f"--model {cfg.model_dir}: {exc}") from None


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
    model = _load_trainer_model(cfg)
    return _Run(cfg, model, emit, t_start).run()


class _Run:
    """State of one demo run (see :func:`run_demo`)."""

    def __init__(
        self, cfg: DemoConfig, model: Any, emit: Callable[[str, dict[str, Any]], None], t_start: float
    ) -> None:
        from weightsync.impl.trainer import Trainer, TrainerConfig

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

    def _wait_started(self, guard: _Guard, streams: list[Any]) -> None:
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

    def _wait(self, guard: _Guard, b: _Batch) -> list[Sample]:
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

    # ------------------------------------------------------------------ probes
    def _probe(self, probe_dir: pathlib.Path, version: int) -> tuple[float, bool]:
        from weightsync.impl.trainer import trainer_probe_logits

        with _threads(1):  # the engines run one intra-op thread: same kernels, same reduction order
            ref = trainer_probe_logits(self.model)
        worst = 0.0
        equal = True
        deadline = time.monotonic() + self.cfg.timeout_s
        for r in range(self.cfg.ranks):
            path = probe_dir / f"rank{r}-round{version}.pt"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"engine rank {r} wrote no probe logits for version {version}")
                time.sleep(0.01)
            got = torch.load(path, weights_only=True)
            for a, b in zip(ref, got, strict=True):
                equal = equal and a.shape == b.shape and torch.equal(a, b)
                worst = max(worst, float((a.float() - b.float()).abs().max().item()))
        return worst, equal

    # ------------------------------------------------------------------ one sync
    def _sync(
        self,
        engine: Any,
        guard: _Guard,
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
        diff, equal = self._probe(probe_dir, index + 1)
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
        """Keep mode: every request of ``b`` ends with its full length (or EOS), never aborted, and the
        tokens it produced before the sync carry the old version, those after it the new one."""
        if b is None or self.cfg.mode != "keep":
            return
        for s in b.streams:
            if not s.done.is_set():
                continue  # counted as lost by _wait
            full = len(s.tokens) == self.task.max_new_tokens or (s.tokens and s.tokens[-1] == EOS_ID)
            order = [version_order(v) for v in s.versions]
            monotone = all(x <= y for x, y in itertools.pairwise(order))
            if s.finish_reason == "abort" or not full or not monotone:
                self.kept_bad += 1

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        from weightsync.impl.checked import CheckedEngine
        from weightsync.impl.engine.client import DPEngineClient, free_port
        from weightsync.impl.engine.core import EngineConfig
        from weightsync.impl.models.config import LMConfig
        from weightsync.impl.trainer import iter_checkpoint_weights, save_config
        from weightsync.impl.transfer.base import meta_of
        from weightsync.impl.transfer.packing import plan_buckets
        from weightsync.impl.transfer.trainer import (
            BroadcastTrainerEngine,
            IPCTrainerEngine,
            IPCTrainerInitInfo,
            ParamMeta,
            TrainerInitInfo,
        )

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
            transfer=f"weightsync.impl.demo:demo_{'ipc' if cfg.transport == 'ipc' else 'broadcast'}_worker",
            max_batch=cfg.prompts_per_step * cfg.group_size,
        )
        weights = list(iter_checkpoint_weights(self.model))
        metas = [meta_of(n, t) for n, t in weights]
        nbytes = sum(m.nbytes for m in metas)
        buckets = len(plan_buckets([m.nbytes for m in metas], cfg.bucket_bytes, True))
        model = self.model

        class CheckpointSource:
            """The trainer's checkpoint tensors as a WeightSource: declared up front, streamed per bucket."""

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(m.name, m.dtype, m.shape) for m in metas]

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
        guard: _Guard | None = None
        try:
            client = DPEngineClient(ecfg, start_timeout_s=max(90.0, cfg.timeout_s)).start()
            guard = _Guard(client, cfg.timeout_s)
            guard.on_pause_done = self._on_pause_done
            engine = guard
            if cfg.check:
                self.trace_path = pathlib.Path(cfg.trace) if cfg.trace else _default_trace_path()
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
                tr = BroadcastTrainerEngine.trainer_init(
                    TrainerInitInfo(**tinfo, group_backend="gloo"),  # the demo's tensors live on the CPU
                    client=engine,
                    source=CheckpointSource(),
                )
            else:
                tr = IPCTrainerEngine.trainer_init(
                    IPCTrainerInitInfo(**tinfo, device="cpu"), client=engine, source=CheckpointSource()
                )

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
                        with _threads(1):
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

    @staticmethod
    def _round_failed(guard: _Guard, rank: int) -> bool:
        """Whether engine ``rank`` is in the table's ``failed`` state (False if it cannot answer)."""
        try:
            return bool(guard.client.call_rank(rank, "get_state").result(10.0)["state"] == "failed")
        except Exception:
            return False

    def _describe_failure(self, exc: BaseException, guard: _Guard | None, trainer: Any) -> str:
        """One message naming the dead rank (if any), the trainer's error and the surviving engines' errors."""
        parts: list[str] = []
        dead: dict[int, int | None] = guard.dead() if guard is not None else {}
        if dead and guard is not None:
            self.dead = sorted(dead)
            parts.append(str(EngineDiedError(self.dead, _phase_of(exc), dead, guard.pids())))
            parts.append("(transfer rank r + 1 is engine DP rank r; rank 0 is the trainer)")
        else:
            parts.append(f"{type(exc).__name__}: {exc}")
        if guard is not None:
            alive = [r for r in range(self.cfg.ranks) if r not in dead]
            if dead:  # the surviving ranks fail their round within the timeout too (state `failed`)
                deadline = time.monotonic() + self.cfg.timeout_s + 5.0
                # ... and so does the trainer's send (its own deadline): wait for both
                while time.monotonic() < deadline and not (
                    all(self._round_failed(guard, r) for r in alive)
                    and (trainer is None or getattr(trainer, "send_error", None) is not None)
                ):
                    time.sleep(0.05)
            for r, f in sorted(guard.client.failures.items()):
                parts.append(f"engine rank {r} failed in {f.phase}: {f.error}")
            for r in alive:
                if r not in guard.client.failures and self._round_failed(guard, r):
                    err = guard.client.call_rank(r, "round_error").result(10.0)
                    parts.append(f"engine rank {r} failed its round (state failed): {err}")
        e = getattr(trainer, "send_error", None)
        if e is not None:
            parts.append(f"trainer send failed: {type(e).__name__}: {e}")
        return "; ".join(parts)

    def _result(self, error: str | None, engine_violations: list[str]) -> dict[str, Any]:
        cfg = self.cfg
        # every request ends finished or aborted; one still unfinished here (after the waits) is lost
        self.requests = len(self.streams)
        self.aborted = sum(1 for s in self.streams if s.done.is_set() and s.finish_reason == "abort")
        self.lost = sum(1 for s in self.streams if not s.done.is_set())
        self.finished = self.requests - self.aborted - self.lost
        rs = self.records
        rewards = [r for r in self.rewards if r is not None]
        versions_ok = (
            all(r.weight_version == f"step-{i}" for i, r in enumerate(rs)) and len(rs) == cfg.steps + 1
        )
        max_diff = max((r.max_logit_diff for r in rs), default=None)
        checks = {
            "completed": error is None and len(rs) == cfg.steps + 1,
            "no_lost_requests": self.lost == 0,
            "weight_versions_agree": versions_ok,
            "logits_match": bool(rs) and (all(r.logits_equal for r in rs) if self.exact else True),
            "kept_requests_finished": self.kept_bad == 0 and (cfg.mode != "keep" or self.aborted == 0),
            "checker_clean": not engine_violations,
        }
        result: dict[str, Any] = {
            "ok": all(checks.values()),
            "checks": checks,
            "error": error,
            "dead_ranks": self.dead,
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


def _phase_of(exc: BaseException) -> str:
    if isinstance(exc, EngineDiedError):
        return exc.phase
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EngineDiedError):
        return cause.phase
    return str(getattr(exc, "phase", "the run"))


# =========================================================================================== rendering


#: The per-sync table: (header, width). Figures are explained in :class:`SyncRecord`.
COLUMNS: tuple[tuple[str, int], ...] = (
    ("sync", 7),
    ("version", 7),
    ("MB", 5),
    ("buckets", 7),
    ("update s", 8),
    ("GB/s", 5),
    ("pause ms", 8),
    ("kept (mid-gen)", 14),
    ("aborted", 7),
    ("logit diff", 10),
    ("reward", 6),
)


def _console(console: Any = None) -> Any:
    from rich.console import Console

    if console is not None:
        return console
    con = Console()
    if not con.is_terminal:  # piped or captured: wide enough for the table (rich assumes 80 columns)
        con = Console(width=max(con.width, 112))
    return con


def _table(show_header: bool, title: str | None = None) -> Any:
    from rich.table import Table

    t = Table(show_header=show_header, box=None, pad_edge=False, title=title, title_justify="left")
    for name, w in COLUMNS:
        t.add_column(name, justify="right", min_width=w, no_wrap=True)
    return t


def render_summary(result: dict[str, Any], console: Any = None, table: bool = True) -> None:
    """Print the per-sync table (unless ``table`` is false) and the final summary of a :func:`run_demo`
    result with ``rich``."""
    con = _console(console)
    if table:
        t = _table(True, "weight syncs")
        for r in result["records"]:
            t.add_row(*_row(r))
        con.print(t)
    _print_summary(result, con)


def _row(r: dict[str, Any]) -> list[str]:
    versions = r["weight_versions"]
    ver = str(r["weight_version"]) if r["weight_version"] is not None else "/".join(map(str, versions)) + " !"
    kept = f"{r['kept_in_flight']} ({r['kept_mid_generation']})"
    diff = "0.0 exact" if r["logits_equal"] else f"{r['max_logit_diff']:.1e}"
    reward = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.3f}"
    return [
        "initial" if r["sync"] == 0 else str(r["sync"]),
        ver,
        f"{r['bytes'] / 1e6:.1f}",
        str(r["buckets"]),
        f"{r['seconds']:.3f}",
        f"{r['gbps']:.2f}",
        f"{r['pause_s'] * 1e3:.0f}",
        kept,
        str(r["aborted"]),
        diff,
        reward,
    ]


def _print_summary(result: dict[str, Any], con: Any) -> None:
    ok = result["ok"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    con.print(
        f"steps {result['steps']}  syncs {result['syncs']}  requests {result['requests']} "
        f"(finished {result['finished_requests']}, aborted {result['aborted_requests']}, "
        f"lost {result['lost_requests']}, kept in flight across syncs {result['kept_in_flight']})"
    )
    con.print(
        f"reward first {fmt(result['reward_first'])} -> last {fmt(result['reward_last'])}"
        f" (final policy rollouts {fmt(result['reward_final'])})   "
        f"max logit diff {result['max_logit_diff']}   weight versions {result['weight_versions']}"
    )
    if result["trace"]:
        con.print(f"trace: {result['trace']}", highlight=False)
        con.print(f"check it against the model: weightsync replay {result['trace']}", highlight=False)
    failed = [k for k, v in result["checks"].items() if not v]
    if result["error"]:
        con.print(f"[bold red]error:[/] {result['error']}", highlight=False)
    verdict = "[bold green]all checks passed[/]" if ok else f"[bold red]FAILED[/] ({', '.join(failed)})"
    con.print(f"{verdict} in {result['seconds']:.1f} s")


class DemoRenderer:
    """Live rendering for people: a progress bar over trainer steps and one table row per sync as it lands.

    Use as ``run_demo(cfg, on_event=renderer)`` inside ``with DemoRenderer() as renderer``.
    """

    def __init__(self, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = _console(console)
        self.progress = Progress(
            TextColumn("[bold]RL steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task: Any = None

    def __enter__(self) -> DemoRenderer:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "start":
            self.console.print(
                f"trainer: {data['architecture']}, {data['parameters'] / 1e6:.2f} M parameters in "
                f"{data['tensors']} tensors, {data['dtype']}, {data['bytes'] / 1e6:.1f} MB per sync",
                highlight=False,
            )
            self.console.print(
                f"engines: {data['ranks']} DP ranks, transport {data['transport']} (registered as "
                f"{data['backend']!r}; {_CPU_WIRE[data['backend']]}), "
                f"pause mode {data['mode']}, variant {data['variant']}",
                highlight=False,
            )
            self.task = self.progress.add_task("steps", total=data["steps"], info="starting engines")
        elif kind == "step" and self.task is not None:
            r = data["reward_mean"]
            info = f"reward {r:.3f}" if r is not None else "no finished samples"
            self.progress.update(self.task, info=f"step {data['step']}: {info}, syncing")
        elif kind == "sync":
            self._print_row(data)
            if self.task is not None:
                if data["sync"] > 0:
                    self.progress.advance(self.task)
                self.progress.update(self.task, info=f"synced {data['weight_version']}")

    def _print_row(self, r: dict[str, Any]) -> None:
        t = _table(show_header=r["sync"] == 0)
        t.add_row(*_row(r))
        self.console.print(t)


__all__ += ["DemoRenderer", "SyncRecord"]


def demo_command(args: Any) -> int:
    """The ``weightsync demo`` command (``args`` from the CLI parser); returns the exit code.

    0: every check held; 1: a check failed or the run failed (the error names a dead rank); 2: bad input
    (unknown transport, bad ``--model`` directory...). ``--json`` prints one JSON object on stdout and no
    progress; otherwise a progress bar, one table row per sync and a summary. The test-only environment
    variable :data:`KILL_ENV` (``"R"`` or ``"R:S"``) kills engine rank R in the middle of sync S.
    """
    import json
    import sys

    cfg = DemoConfig(
        ranks=int(args.ranks),
        steps=int(args.steps),
        transport=str(args.transport),
        mode=str(args.mode),
        model_dir=args.model,
        seed=int(args.seed),
        variant=str(args.variant),
        timeout_s=float(args.timeout),
        trace=args.trace,
        check=not bool(args.no_check),
    )
    try:
        kill = os.environ.get(KILL_ENV, "").strip()
        if kill:
            rank, _, at = kill.partition(":")
            try:
                cfg.kill_rank_during_update, cfg.kill_at_sync = int(rank), int(at or 1)
            except ValueError:
                raise DemoUsageError(f"{KILL_ENV}={kill!r}: expected RANK or RANK:SYNC") from None
        if args.json:
            out = run_demo(cfg)
        else:
            with DemoRenderer() as renderer:
                out = run_demo(cfg, renderer)
            render_summary(out, renderer.console, table=False)
    except DemoUsageError as exc:
        if args.json:
            sys.stdout.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        else:
            sys.stderr.write(f"weightsync demo: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(out, sort_keys=True, default=str) + "\n")
    return 0 if out["ok"] else 1


__all__ += ["KILL_ENV", "demo_command"]
