"""Deliberately broken engine ranks for ``weightsync replay --self-test`` (never used in production).

Each class is an :class:`~weightsync.impl.engine.core.EngineCore` subclass that a cluster runs through
``EngineConfig.core``. Each breaks one behaviour the table does not see directly, the five of issue 12
plus corrupted weight bytes:

- :class:`AdvancesWhilePaused`: the scheduler ignores PAUSED_ALL (it reports work and advances running
  requests while every request should be frozen);
- :class:`DropsStartDPWave`: the rank drops a START_DP_WAVE before its table sees it;
- :class:`ClearCacheDoesNothing`: ``clear_cache`` keeps the running requests and their KV;
- :class:`NoWaveComplete`: rank 0 never sends ``wave_complete``;
- :class:`AbortAbortsNothing`: a pause(mode="abort") aborts no request;
- :class:`CorruptsWeights`: one byte of every received weight bucket is flipped (the checksum round of
  ``verify=True`` must catch it).

A broken rank writes a ``fault`` record (:meth:`~weightsync.impl.engine.tracing.StepTracer.fault`) whenever its fault changes what
the rank does, attributed to the model step it changes. Faults that would change nothing (a START_DP_WAVE
whose row is a no-op, a clear_cache with nothing running) are not injected, so the first fault record is
where the trace first departs from a healthy engine.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.impl.engine.config import EngineConfig, EngineQueues
from weightsync.impl.engine.core import EngineCore
from weightsync.impl.engine.messages import StartDPWave
from weightsync.impl.engine.scheduler import Scheduler
from weightsync.spec.rank import apply
from weightsync.spec.states import PauseState, RankEvent
from weightsync.spec.table import Fired


def _mark(core: EngineCore, what: str) -> None:
    """A ``fault`` record for the step the fault acts in (the one under way, else the next one)."""
    core.tracer.fault(what)


class _IgnoresPausedAll(Scheduler):
    """A scheduler that treats PAUSED_ALL as PAUSED_NEW: running requests keep advancing."""

    core: EngineCore

    def _honest(self) -> PauseState:
        return PauseState.PAUSED_NEW if self.pause_state is PauseState.PAUSED_ALL else self.pause_state

    def has_work(self) -> bool:
        real = super().has_work()
        saved, self.pause_state = self.pause_state, self._honest()
        try:
            lie = super().has_work()
        finally:
            self.pause_state = saved
        if lie != real:
            _mark(self.core, f"has_work={lie} under PAUSED_ALL with {len(self.running)} running")
        return lie

    def step(self) -> list[Any]:
        saved, self.pause_state = self.pause_state, self._honest()
        try:
            return super().step()
        finally:
            self.pause_state = saved


class AdvancesWhilePaused(EngineCore):
    """The scheduler advances running requests under PAUSED_ALL (a keep-mode pause that is not frozen)."""

    def __init__(self, cfg: EngineConfig, rank: int, queues: EngineQueues) -> None:
        super().__init__(cfg, rank, queues)
        self.sched.__class__ = _IgnoresPausedAll
        self.sched.core = self  # type: ignore[attr-defined]


class DropsStartDPWave(EngineCore):
    """Drops every START_DP_WAVE whose row would change the rank (after the socket saw it)."""

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StartDPWave):
            args = {**self._table_args(), "wave": msg.wave, "exclude": msg.exclude}
            tr = self.machine.select(RankEvent.START_DP_WAVE, args)
            v = self.machine.vars
            if tr is not None and (tr.effects or apply(v, tr, args) != v):
                _mark(self, f"dropped START_DP_WAVE(wave={msg.wave}, exclude={msg.exclude})")
                return
        super()._handle(msg)

    def _table_args(self) -> dict[str, Any]:
        return {"rank": self.rank, "dp_size": self.cfg.dp_size, "sync_interval": self.cfg.sync_interval}


class ClearCacheDoesNothing(EngineCore):
    """``clear_cache`` keeps running requests running on their old KV."""

    def _clear_cache(self, fired: Fired) -> None:
        if fired.after.clear_cache and self.sched.running:
            _mark(self, f"clear_cache kept {len(self.sched.running)} running request(s)")
            return
        super()._clear_cache(fired)


class NoWaveComplete(EngineCore):
    """Rank 0 never tells the coordinator that a wave completed."""

    def _to_coord(self, msg: Any) -> None:
        if type(msg).__name__ == "WaveComplete":
            _mark(self, f"wave_complete({msg.wave}) not sent")
            return
        super()._to_coord(msg)


class AbortAbortsNothing(EngineCore):
    """``abort_requests`` leaves every request in flight."""

    def _abort_requests(self, fired: Fired) -> None:
        if self.sched.waiting or self.sched.running:
            _mark(self, f"aborted nothing of {len(self.sched.waiting) + len(self.sched.running)} request(s)")
            return
        super()._abort_requests(fired)


class CorruptsWeights(EngineCore):
    """Flips the first byte of every weight bucket this rank receives, after the broadcast landed. The
    in-band bucket headers travel on the same group (:mod:`weightsync.impl.transfer.bucket_header`) and are
    left alone: a flipped header is a WireMismatchError before the payload, not corrupted weights."""

    def __init__(self, cfg: EngineConfig, rank: int, queues: EngineQueues) -> None:
        super().__init__(cfg, rank, queues)
        from weightsync.impl.transfer.broadcast import BroadcastGroup
        from weightsync.impl.transfer.bucket_header import HEADER_BYTES, MAGIC

        core = self
        original = BroadcastGroup.broadcast

        class _Corrupting:
            def __init__(self, work: Any, t: torch.Tensor) -> None:
                self.work, self.t = work, t

            def wait(self, *args: Any) -> Any:
                out = self.work.wait(*args)
                flat = self.t.view(torch.uint8).reshape(-1)
                header = flat.numel() == HEADER_BYTES and bytes(flat[: len(MAGIC)].tolist()) == MAGIC
                if flat.numel() and not header:
                    flat[0] ^= 0xFF
                    _mark(core, f"flipped a byte of a {self.t.numel()}-element weight bucket")
                return out

        def broadcast(group: BroadcastGroup, t: torch.Tensor) -> Any:
            return _Corrupting(original(group, t), t)

        BroadcastGroup.broadcast = broadcast  # type: ignore[method-assign,assignment]  # this process only


__all__ = [
    "AbortAbortsNothing",
    "AdvancesWhilePaused",
    "ClearCacheDoesNothing",
    "CorruptsWeights",
    "DropsStartDPWave",
    "NoWaveComplete",
]
