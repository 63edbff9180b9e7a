"""The demo's settings, per-sync record and errors (``weightsync demo``, see :mod:`weightsync.demo.loop`)."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import signal
import time
from dataclasses import dataclass

from weightsync.spec.errors import WeightSyncError
from weightsync.spec.states import PauseMode


def default_trace_path() -> pathlib.Path:
    """A fresh trace file under ``traces/`` for the demo's CheckedEngine."""
    d = pathlib.Path("traces")
    d.mkdir(parents=True, exist_ok=True)
    return d / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


__all__ = [
    "KILL_ENV",
    "TRANSPORTS",
    "DemoConfig",
    "DemoUsageError",
    "EngineDiedError",
    "RLRunConfig",
    "SyncRecord",
    "default_trace_path",
]

KILL_ENV = "WEIGHTSYNC_DEMO_KILL_RANK"
"""Test-only: ``"R"`` or ``"R:S"`` makes the CLI kill engine rank R in the middle of sync S (default 1)."""

TRANSPORTS = {"broadcast": "nccl", "ipc": "ipc"}
"""Demo transport name -> registered weight-transfer backend."""


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


@dataclass
class RLRunConfig:
    """The settings every RL demo loop shares (``weightsync demo``'s on the reference engine,
    :class:`DemoConfig`, and on a real vLLM, :class:`weightsync.vllm_tools.demo.VllmDemoConfig`).

    Attributes:
        steps: trainer steps, each followed by a sync (>= 0; the initial sync is checked too).
        mode: pause mode of every sync (a :class:`~weightsync.spec.states.PauseMode` value).
        seed: seeds the model init, the task's prompt draws and the per-request sampling seeds.
        prompts_per_step, group_size: rollout batch = prompts x samples per prompt (GRPO groups).
        lr: Adam learning rate of the trainer.
        timeout_s: deadline of every collective, rendezvous, controller call and rollout wait, seconds.
        trace: trace path (None: a fresh file under ``traces/`` in the working directory).
    """

    steps: int = 20
    mode: str = "keep"
    seed: int = 0
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 2e-3
    timeout_s: float = 60.0
    trace: str | None = None

    def validate(self) -> None:
        """Raise :class:`DemoUsageError` (a ``ValueError``) naming the first bad shared setting."""
        if self.steps < 0:
            raise DemoUsageError(f"steps must be >= 0, got {self.steps}")
        if self.mode not in {m.value for m in PauseMode}:
            raise DemoUsageError(f"mode {self.mode!r}: choose one of {', '.join(m.value for m in PauseMode)}")
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise DemoUsageError(
                f"prompts_per_step and group_size must be >= 1, got {self.prompts_per_step}, {self.group_size}"
            )
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise DemoUsageError(f"timeout_s must be a positive number of seconds, got {self.timeout_s}")


@dataclass
class DemoConfig(RLRunConfig):
    """Settings of one demo run on the reference engine (the shared ones: :class:`RLRunConfig`).

    Attributes:
        ranks: DP engine ranks (>= 1).
        transport: ``"broadcast"`` (registered as ``nccl``; gloo on CPU) or ``"ipc"`` (CPU shared memory).
        model_dir: a local Hugging Face checkpoint (config.json + safetensors), or None for the default
            policy built from ``seed``.
        variant: protocol variant the engines and the checker run.
        trace: (shared) JSONL trace path; None: ``traces/demo-<time>-<pid>.jsonl``.
        check: run the runtime checker (CheckedEngine) and record the trace.
        temperature: sampling temperature of the engines (the trainer's log-probs use the same).
        clip_eps: the trainer's PPO clip range.
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
    transport: str = "broadcast"
    model_dir: str | None = None
    variant: str = "two-phase-epoch"
    check: bool = True
    temperature: float = 1.0
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
        super().validate()
        if self.transport not in TRANSPORTS:
            raise DemoUsageError(f"--transport {self.transport!r}: choose one of {', '.join(TRANSPORTS)}")
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
