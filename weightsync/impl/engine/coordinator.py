"""The DP coordinator process: ``current_wave`` / ``engines_running`` and START_DP_WAVE broadcasts.

Rules (reference section 5 table; vLLM ``v1/engine/coordinator.py``):

- FIRST_REQ(exclude, wave) from a front-end: if not running, set running; if the wave is stale
  (``wave < current_wave``) drop the exclusion; broadcast START_DP_WAVE(current_wave, exclude).
- wave_complete=w from engine rank 0: if ``current_wave <= w``: ``current_wave = w + 1``, running = False.
- start_wave=w from an engine: if ``w > current_wave`` or (``w == current_wave`` and not running): adopt w,
  set running, broadcast START_DP_WAVE(w, exclude=sender).
- Every change publishes stats (current_wave, engines_running) to the front-ends.

This module imports no torch, so the process starts fast.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

from weightsync.impl.engine.messages import FirstReq, StartDPWave, StartWave, Stats, WaveComplete


@dataclass
class CoordinatorState:
    """The coordinator's variables (vLLM names). ``latches``: the variant's
    :attr:`~weightsync.spec.rank.Variant.coordinator_latches` (FIRST_REQ sets engines_running; vLLM 0.32
    ``v1/engine/coordinator.py:363-375`` does not: only the engines' reports move it). ``excludes``: the
    variant's :attr:`~weightsync.spec.rank.Variant.first_req_exclusion`."""

    current_wave: int = 0
    engines_running: bool = False
    latches: bool = True
    excludes: bool = True


def handle(state: CoordinatorState, msg: Any) -> list[StartDPWave]:
    """Apply one message to ``state``; return the START_DP_WAVE messages to broadcast (pure logic)."""
    if isinstance(msg, FirstReq):
        if not state.engines_running:
            exclude = -1 if msg.wave < state.current_wave or not state.excludes else msg.exclude
            state.engines_running = state.latches
            return [StartDPWave(state.current_wave, exclude)]
        return []
    if isinstance(msg, WaveComplete):
        if state.current_wave <= msg.wave:
            state.current_wave = msg.wave + 1
            state.engines_running = False
        return []
    if isinstance(msg, StartWave):
        if msg.wave > state.current_wave or (msg.wave == state.current_wave and not state.engines_running):
            state.current_wave = msg.wave
            state.engines_running = True
            return [StartDPWave(msg.wave, msg.sender)]
        return []
    raise TypeError(f"coordinator: unexpected message {msg!r}")


def run_coordinator(
    front_in: Any,
    engine_in: list[Any],
    wave_out: list[Any],
    stats_out: Any,
    stop: Any,
    poll_s: float = 0.001,
    ack: bool = False,
    latches: bool = True,
    excludes: bool = True,
) -> None:
    """Process entry point: poll FIRST_REQ (front-end) and wave_complete/start_wave (engines) until ``stop``.

    Args:
        front_in: front-end -> coordinator FIFO.
        engine_in: one FIFO per engine (engine -> coordinator).
        wave_out: one FIFO per engine (coordinator -> engine wave socket).
        stats_out: coordinator -> front-end FIFO of :class:`Stats`.
        stop: a ``multiprocessing.Event``.
        poll_s: sleep between idle polls, seconds.
        ack: publish stats after every message handled, changed or not (``weightsync repro`` uses them as
            acknowledgements; START_DP_WAVE broadcasts are queued before the stats).
        latches, excludes: see :class:`CoordinatorState`.
    """
    st = CoordinatorState(latches=latches, excludes=excludes)
    stats_out.put(Stats(st.current_wave, st.engines_running))
    k = 0
    while not stop.is_set():
        busy = False
        sources = [front_in, *engine_in]
        k = (k + 1) % len(sources)
        for i in range(len(sources)):
            q = sources[(k + i) % len(sources)]
            while True:
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    break
                busy = True
                before = (st.current_wave, st.engines_running)
                for out in handle(st, msg):
                    for wq in wave_out:
                        wq.put(out)
                if ack or (st.current_wave, st.engines_running) != before:
                    stats_out.put(Stats(st.current_wave, st.engines_running))
        if not busy:
            time.sleep(poll_s)
