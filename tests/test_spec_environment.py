"""The DP coordinator and the API front-end are tables (weightsync/spec/coordinator.py, front_end.py) that
the model and the reference engine both run: the same random message sequences go through the model's
coordinator step and through a real coordinator process, and their START_DP_WAVE broadcasts and
``(current_wave, engines_running)`` must agree after every message. Those two comparisons are between two
interpreters of one table, so alone they could not catch a wrong row: both would agree on it. The
independent checks are the row-by-row tests against vLLM 0.32's source lines
(``test_table_follows_vllm_032``, ``test_front_end_table_follows_vllm_032``) and a message sequence whose
every outcome was computed by hand from those lines (``test_coordinator_on_a_hand_computed_trace``)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import threading
import time
from typing import Any

import pytest

from weightsync.impl.engine.coordinator import run_coordinator
from weightsync.impl.engine.messages import FirstReq, StartWave, Stats, WaveComplete
from weightsync.model.system import Bounds, Config, Coordinator, Model
from weightsync.spec.coordinator import (
    CoordEvent,
    CoordState,
    CoordVars,
    coordinator_fire,
    coordinator_table,
)
from weightsync.spec.rank import VARIANTS
from weightsync.spec.states import PauseMode

FLAGS = sorted({(v.coordinator_latches, v.first_req_exclusion) for v in VARIANTS.values()})
VARIANT_OF = {
    f: next(n for n, v in VARIANTS.items() if (v.coordinator_latches, v.first_req_exclusion) == f)
    for f in FLAGS
}
N = 2


def random_messages(rng: random.Random, n: int) -> list[Any]:
    """``n`` coordinator inputs: FIRST_REQ from the front-end, wave_complete from rank 0, start_wave from
    any rank, with waves around the coordinator's (stale, current and newer ones)."""
    out: list[Any] = []
    for _ in range(n):
        k = rng.randrange(3)
        wave = rng.randrange(5)
        if k == 0:
            out.append(FirstReq(exclude=rng.randrange(N), wave=wave))
        elif k == 1:
            out.append(WaveComplete(wave))
        else:
            out.append(StartWave(wave, sender=rng.randrange(N)))
    return out


def model_step(m: Model, coord: tuple[int, bool], msg: Any) -> tuple[tuple[int, bool], list[tuple[int, int]]]:
    """The model's coordinator step on ``msg``: its new ``(current_wave, engines_running)`` and the
    START_DP_WAVE messages it put on the ranks' wave FIFOs (one per rank, so rank 0's)."""
    s = m.initial()._replace(coord=Coordinator(*coord))
    if isinstance(msg, FirstReq):
        s = s._replace(coord_q=((("FIRST_REQ", msg.exclude, msg.wave),),))
        src = -1
    else:
        m_ = (
            ("wave_complete", msg.wave, 0)
            if isinstance(msg, WaveComplete)
            else ("start_wave", msg.wave, msg.sender)
        )
        src = 0 if isinstance(msg, WaveComplete) else msg.sender
        rk = s.ranks[src].with_outq((m_,))
        s = s._replace(ranks=(*s.ranks[:src], rk, *s.ranks[src + 1 :]))
    t = m._coord_recv(s, src, 0)
    per_rank = [[(x[1], x[2]) for x in r.inq[m.f_wave] if x[0] == "W"] for r in t.ranks]
    assert all(p == per_rank[0] for p in per_rank), per_rank  # a broadcast reaches every rank
    return (t.coord.current_wave, t.coord.engines_running), per_rank[0]


def _drain(q: Any) -> list[Any]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"latches={f[0]},excludes={f[1]}")
def test_model_and_coordinator_process_agree_on_random_sequences(flags: tuple[bool, bool]) -> None:
    latches, excludes = flags
    m = Model(Config(VARIANT_OF[flags], N, PauseMode.KEEP, "per-socket", Bounds()))
    ctx = mp.get_context("spawn")
    front_in, stats_out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    engine_in = [ctx.Queue() for _ in range(N)]
    wave_out = [ctx.Queue() for _ in range(N)]
    p = ctx.Process(
        target=run_coordinator,
        args=(front_in, engine_in, wave_out, stats_out, stop),
        kwargs={"ack": True, "latches": latches, "excludes": excludes},
        daemon=True,
    )
    p.start()
    try:
        first = stats_out.get(timeout=30)
        coord = (first.current_wave, first.engines_running)
        assert coord == (0, False)
        rng = random.Random(hash(flags) & 0xFFFF)
        kinds: set[str] = set()
        for k, msg in enumerate(random_messages(rng, 150)):
            want_coord, want_waves = model_step(m, coord, msg)
            if isinstance(msg, FirstReq):
                front_in.put(msg)
            else:
                engine_in[0 if isinstance(msg, WaveComplete) else msg.sender].put(msg)
            st: Stats = stats_out.get(timeout=10)  # ack=True: one Stats per message
            # each mp.Queue has its own feeder thread, so a broadcast put before the Stats may arrive after
            # it: wait for as many as the model sent, then take any extra that is already there (an extra
            # that arrives later shows up at a later message, or in the final check)
            got_waves = [
                [(w.wave, w.exclude) for w in [q.get(timeout=10) for _ in want_waves] + _drain(q)]
                for q in wave_out
            ]
            assert all(g == got_waves[0] for g in got_waves), got_waves
            got = ((st.current_wave, st.engines_running), got_waves[0])
            assert got == (want_coord, want_waves), f"message {k} {msg!r} from {coord}: process {got}, model"
            coord = want_coord
            kinds.add(f"{type(msg).__name__}:{bool(want_waves)}:{coord[1]}")
        time.sleep(0.5)
        assert [_drain(q) for q in wave_out] == [[]] * N and _drain(stats_out) == []
        # the sequence exercised broadcasts and silences of every message kind
        assert len(kinds) >= 5, kinds
    finally:
        stop.set()
        p.join(10)


def test_table_follows_vllm_032() -> None:
    """vLLM 0.32 (``v1/engine/coordinator.py:363-375, 432-461``), checked row by row."""
    t = coordinator_table(latches=False, excludes=False)
    idle, running = CoordVars(CoordState.IDLE, 3), CoordVars(CoordState.RUNNING, 3)
    # FIRST_REQ while idle: broadcast the current wave to every engine (the exclusion never matches in
    # 0.32), and do not latch
    f = coordinator_fire(t, idle, CoordEvent.FIRST_REQ, {"wave": 3, "exclude": 1})
    assert f.after == idle and f.broadcasts == ((3, -1),)
    assert coordinator_fire(t, running, CoordEvent.FIRST_REQ, {"wave": 3, "exclude": 1}).broadcasts == ()
    # wave_complete: advance past the reported wave unless it is older
    assert coordinator_fire(t, running, CoordEvent.WAVE_COMPLETE, {"wave": 3}).after == CoordVars(
        CoordState.IDLE, 4
    )
    assert coordinator_fire(t, running, CoordEvent.WAVE_COMPLETE, {"wave": 2}).after == running
    # start_wave: adopt a newer wave (or the current one while idle) and tell every engine but the sender
    f = coordinator_fire(t, idle, CoordEvent.START_WAVE, {"wave": 3, "sender": 1})
    assert f.after == running and f.broadcasts == ((3, 1),)
    assert coordinator_fire(t, running, CoordEvent.START_WAVE, {"wave": 3, "sender": 1}).broadcasts == ()
    f = coordinator_fire(t, running, CoordEvent.START_WAVE, {"wave": 5, "sender": 0})
    assert f.after == CoordVars(CoordState.RUNNING, 5) and f.broadcasts == ((5, 0),)
    assert coordinator_fire(t, idle, CoordEvent.START_WAVE, {"wave": 2, "sender": 0}).after == idle


#: (message, args) -> (engines_running, current_wave, START_DP_WAVE broadcasts as (wave, excluded rank)),
#: computed by hand from vLLM 0.32 ``v1/engine/coordinator.py:363-375, 432-461`` for a coordinator that
#: starts idle at wave 0: FIRST_REQ broadcasts to all while idle and never latches; wave_complete advances
#: past the reported wave unless it is older; start_wave adopts a newer wave (the current one while idle).
HAND_TRACE: list[tuple[CoordEvent, dict[str, int], tuple[bool, int, tuple[tuple[int, int], ...]]]] = [
    (CoordEvent.FIRST_REQ, {"wave": 0, "exclude": 1}, (False, 0, ((0, -1),))),
    (CoordEvent.START_WAVE, {"wave": 0, "sender": 0}, (True, 0, ((0, 0),))),
    (CoordEvent.FIRST_REQ, {"wave": 0, "exclude": 1}, (True, 0, ())),
    (CoordEvent.WAVE_COMPLETE, {"wave": 0}, (False, 1, ())),
    (CoordEvent.WAVE_COMPLETE, {"wave": 0}, (False, 1, ())),
    (CoordEvent.START_WAVE, {"wave": 1, "sender": 1}, (True, 1, ((1, 1),))),
    (CoordEvent.START_WAVE, {"wave": 3, "sender": 0}, (True, 3, ((3, 0),))),
    (CoordEvent.WAVE_COMPLETE, {"wave": 3}, (False, 4, ())),
    (CoordEvent.START_WAVE, {"wave": 2, "sender": 0}, (False, 4, ())),
    (CoordEvent.FIRST_REQ, {"wave": 2, "exclude": 0}, (False, 4, ((4, -1),))),
]


def test_coordinator_on_a_hand_computed_trace() -> None:
    t = coordinator_table(latches=False, excludes=False)
    v = CoordVars(CoordState.IDLE, 0)
    for k, (event, args, (running, wave, broadcasts)) in enumerate(HAND_TRACE):
        f = coordinator_fire(t, v, event, args)
        got = (f.after.state is CoordState.RUNNING, f.after.current_wave, f.broadcasts)
        assert got == (running, wave, broadcasts), (k, event, args)
        v = f.after


def test_latching_and_exclusion_flags() -> None:
    """Before issue #51476's fix FIRST_REQ latched engines_running; with a working exclusion its
    broadcast skips the target unless the request's wave is stale."""
    t = coordinator_table(latches=True, excludes=True)
    idle = CoordVars(CoordState.IDLE, 3)
    f = coordinator_fire(t, idle, CoordEvent.FIRST_REQ, {"wave": 3, "exclude": 1})
    assert f.after.engines_running and f.broadcasts == ((3, 1),)
    f = coordinator_fire(t, idle, CoordEvent.FIRST_REQ, {"wave": 2, "exclude": 1})
    assert f.broadcasts == ((3, -1),)  # stale: every engine takes it


def test_front_end_table_follows_vllm_032() -> None:
    """vLLM 0.32 ``v1/engine/core_client.py:1582-1593, 1540-1549, 1562-1565``: a request is stamped with the
    believed wave; FIRST_REQ only while the engines are believed idle, after which they are believed
    running; stats replace the belief; a closed front-end pause gate holds requests."""
    from weightsync.spec.front_end import FrontEvent, FrontState, FrontVars, front_end_fire

    idle = FrontVars(FrontState.IDLE, 4)
    tr, after = front_end_fire(idle, FrontEvent.SEND_REQUEST, {"target": 1})
    assert tr.effects == ("send_add", "send_first_req") and after == FrontVars(FrontState.RUNNING, 4)
    tr, after2 = front_end_fire(after, FrontEvent.SEND_REQUEST, {"target": 0})
    assert tr.effects == ("send_add",) and after2 == after
    _, st = front_end_fire(after, FrontEvent.STATS, {"wave": 5, "running": False})
    assert st == FrontVars(FrontState.IDLE, 5)
    _, gated = front_end_fire(st, FrontEvent.GATE, {})
    tr, held = front_end_fire(gated, FrontEvent.SEND_REQUEST, {"target": 0})
    assert tr.effects == ("hold_request",) and held == gated  # nothing sent, belief unchanged
    tr, opened = front_end_fire(held, FrontEvent.UNGATE, {})
    assert tr.effects == ("release_held",) and not opened.gated


class _FrontEndOnly:
    """The reference client's front-end half (``DPEngineClient._submit``, ``_front_stats``,
    ``_front_gate``) over recording queues instead of engine processes."""

    def __init__(self) -> None:
        from weightsync.impl.engine.client import DPEngineClient
        from weightsync.spec.front_end import FrontVars
        from weightsync.spec.rank import get_variant

        c = DPEngineClient.__new__(DPEngineClient)
        c.variant = get_variant("front-end-pause")
        c.front = FrontVars()
        c._lock = threading.RLock()
        c._trans_cv = threading.Condition(c._lock)
        c.rank_vars = [{} for _ in range(N)]
        c.transitions = []
        c._listeners = []
        c.hold = False
        c.hold_coord = False
        c._held_adds = []
        c._trace_front = None  # no system trace
        self.sent: list[tuple[str, int, Any, int]] = []
        c._send = lambda r, sock, msg: self.sent.append(("ADD", r, msg.request, msg.wave))  # type: ignore[method-assign]
        c._fe2coord = type(
            "Q", (), {"put": lambda _, m: self.sent.append(("FIRST_REQ", m.exclude, None, m.wave))}
        )()
        self.c = c


def test_model_and_client_front_end_agree_on_random_sequences() -> None:
    """The same random client traffic, coordinator stats and front-end pause gate go through the model's
    front-end (``Model._front`` / ``_send_request``) and the reference client's; the gate closes and opens
    through a rank row's ``front_end_gate`` / ``front_end_ungate`` effects (the model's ``_effect``, the
    client's ``_on_engine_msg``). They must send the same ADDs and FIRST_REQs (wave stamps included) and
    keep the same belief. Requests the gate holds: the client sends them when the gate opens, the model
    sends them then (it does not create them earlier)."""
    from weightsync.impl.engine.messages import Stats, TransitionRecord
    from weightsync.model.system.state import _ScratchState
    from weightsync.spec.front_end import FrontEvent
    from weightsync.spec.states import RankEvent, RankState

    m = Model(Config("front-end-pause", N, PauseMode.KEEP, "per-socket", Bounds(requests=10**6)))
    fe = _FrontEndOnly()
    rng = random.Random(7)
    s = m.initial()
    held: list[int] = []
    kinds: set[str] = set()

    def model_send(s: Any, i: int) -> tuple[Any, list[tuple[str, int, Any, int]]]:
        t = m._send_request(s, i)
        out = [("ADD", i, x[1], x[2]) for x in t.ranks[i].inq[m.f_add][len(s.ranks[i].inq[m.f_add]) :]]
        out += [("FIRST_REQ", x[1], None, x[2]) for x in t.coord_q[0][len(s.coord_q[0]) :]]
        return t, out

    for _ in range(400):
        k = rng.randrange(4)
        want: list[tuple[str, int, Any, int]] = []
        if k == 0:  # a client request for a random rank
            i = rng.randrange(N)
            req = s.front.next_request
            if "hold_request" in m._front(s.front, FrontEvent.SEND_REQUEST, target=i)[0]:
                held.append(i)
                s = s._replace(front=s.front._replace(next_request=req + 1))  # the request exists
            else:
                s, want = model_send(s, i)
            fe.c._submit(i, req)
        elif k == 1:  # coordinator stats
            wave, running = rng.randrange(5), rng.random() < 0.5
            _, front = m._front(s.front, FrontEvent.STATS, wave=wave, running=running)
            s = s._replace(front=front)
            fe.c._front_stats(Stats(wave, running))
        else:  # a rank fires front-end-pause's PAUSE or RESUME row, whose effects close or open the gate
            ev = FrontEvent.GATE if k == 2 else FrontEvent.UNGATE
            key = (RankState.RUNNING, RankEvent.PAUSE) if k == 2 else (RankState.VERIFIED, RankEvent.RESUME)
            row = m.table[key][0]
            scratch = _ScratchState(s)
            for eff in row.effects:  # the model runs the row's front-end effects (its replies: no call here)
                if eff.startswith("front_end_"):
                    m._effect(scratch, 0, eff, s.ranks[0].vars, -1)
            s = scratch.freeze()
            if ev is FrontEvent.UNGATE:
                first = s.front.next_request - len(held)
                for j, i in enumerate(held):  # the model sends the held requests now, in order
                    next_request = s.front.next_request
                    s = s._replace(front=s.front._replace(next_request=first + j))
                    s, out = model_send(s, i)
                    s = s._replace(front=s.front._replace(next_request=next_request))
                    want += out
                held = []
            rec = TransitionRecord(0, 0, key[1].value, {}, {}, {}, row.guard, row.effects, "", 0, 0.0, 0, 0)
            fe.c._on_engine_msg(0, rec)  # the client runs them from the rank's report
        got, fe.sent[:] = list(fe.sent), []
        assert got == want, f"event {k}: client sent {got}, model {want}"
        belief = (fe.c.front.current_wave, fe.c.front.engines_running, fe.c.front.gated)
        assert belief == (s.front.believed_wave, s.front.believed_running, s.front.gated)
        kinds.add(f"{k}:{len(want)}")
    assert len(kinds) >= 6, kinds
