"""The DP coordinator process: runs the spec's coordinator table (:mod:`weightsync.spec.coordinator`).

The rules (FIRST_REQ, wave_complete, start_wave; vLLM ``v1/engine/coordinator.py``) are rows of
:func:`weightsync.spec.coordinator.coordinator_table`; this module only moves messages: it decodes each
one into a :class:`~weightsync.spec.coordinator.CoordEvent` with its arguments, fires the table, sends the
START_DP_WAVE broadcasts the row produced to every engine and publishes stats when the row says so.

This module imports no torch, so the process starts fast.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.impl.engine.messages import FirstReq, StartDPWave, StartWave, Stats, WaveComplete
from weightsync.impl.engine.tracing import message_dict, open_trace
from weightsync.spec.coordinator import (
    PUBLISH,
    CoordEvent,
    CoordVars,
    Table,
    coordinator_fire,
    coordinator_table,
)


@dataclass
class CoordinatorState:
    """The coordinator process's table (from the variant's
    :attr:`~weightsync.spec.rank.Variant.coordinator_latches` and
    :attr:`~weightsync.spec.rank.Variant.first_req_exclusion`) and its variables."""

    table: Table = field(default_factory=coordinator_table)
    vars: CoordVars = field(default_factory=CoordVars)

    @property
    def current_wave(self) -> int:
        """vLLM's ``current_wave``."""
        return self.vars.current_wave

    @property
    def engines_running(self) -> bool:
        """vLLM's ``engines_running``."""
        return self.vars.engines_running


def decode(msg: Any) -> tuple[CoordEvent, dict[str, int]]:
    """The table event and arguments of one coordinator input message.

    Raises:
        TypeError: a message the coordinator does not read.
    """
    if isinstance(msg, FirstReq):
        return CoordEvent.FIRST_REQ, {"wave": msg.wave, "exclude": msg.exclude}
    if isinstance(msg, WaveComplete):
        return CoordEvent.WAVE_COMPLETE, {"wave": msg.wave}
    if isinstance(msg, StartWave):
        return CoordEvent.START_WAVE, {"wave": msg.wave, "sender": msg.sender}
    raise TypeError(f"coordinator: unexpected message {msg!r}")


def handle(state: CoordinatorState, msg: Any) -> tuple[list[StartDPWave], bool]:
    """Apply one message to ``state`` through the table; return the START_DP_WAVE messages to broadcast and
    whether to publish stats (pure logic).

    Raises:
        TypeError: as :func:`decode`.
    """
    event, args = decode(msg)
    fired = coordinator_fire(state.table, state.vars, event, args)
    state.vars = fired.after
    return [StartDPWave(w, x) for w, x in fired.broadcasts], PUBLISH in fired.transition.effects


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
    system_trace: str | None = None,
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
        system_trace: append a ``coord`` record per message handled to this system trace
            (:mod:`weightsync.impl.engine.tracing`), before its broadcasts are sent.
    """
    st = CoordinatorState(coordinator_table(latches, excludes))
    trace = open_trace(system_trace, "coord")
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
                before = st.vars
                broadcasts, publish = handle(st, msg)
                if trace is not None:
                    j = (k + i) % len(sources)
                    trace.write(
                        "coord",
                        source=j - 1,  # -1: the front-end, else the engine rank
                        msg=message_dict(msg),
                        before=before._asdict(),
                        after=st.vars._asdict(),
                        broadcasts=[[b.wave, b.exclude] for b in broadcasts],
                    )
                for out in broadcasts:
                    for wq in wave_out:
                        wq.put(out)
                if ack or publish:
                    stats_out.put(Stats(st.current_wave, st.engines_running))
        if not busy:
            time.sleep(poll_s)
