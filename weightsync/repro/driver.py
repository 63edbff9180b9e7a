"""The reference engine's schedule driver: what a compiled model step looks like, and the driver that makes
each rank event happen when the schedule says and observes what the engines did (rules in
:mod:`weightsync.repro.engine`, which runs it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from weightsync.impl.engine.client import COORD, DPEngineClient, RequestStream
from weightsync.impl.engine.messages import (
    AbortMsg,
    AddMsg,
    FirstReq,
    StartDPWave,
    StartWave,
    Stats,
    TransitionRecord,
    UtilityCall,
    WaveComplete,
)
from weightsync.impl.models.sampling import SamplingParams
from weightsync.spec.calls import PHASE_CALL, TRAINER_COLLECTIVE, Phase
from weightsync.spec.controller import (
    ONE_ROUND_ARGS,
    CtrlVars,
    controller_event,
    controller_next,
    controller_table,
)
from weightsync.spec.errors import TransferTimeoutError
from weightsync.spec.states import Collective

#: The controller phase of each call name (the inverse of the spec's :data:`PHASE_CALL`).
PHASE_OF_CALL: dict[str, Phase] = {c: Phase(p) for p, c in PHASE_CALL.items()}
Channel = tuple[int, str]


class ScheduleStep(Protocol):
    """One compiled model step, as :class:`weightsync.repro.schedule.Action` gives it (see there)."""

    @property
    def step(self) -> int: ...
    @property
    def label(self) -> list[Any]: ...
    @property
    def text(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def arg(self) -> Any: ...
    @property
    def channel(self) -> Channel: ...
    @property
    def message(self) -> tuple[Any, ...]: ...
    @property
    def fired(self) -> list[tuple[int, str, str, dict[str, Any]]]: ...
    @property
    def vars_after(self) -> dict[int, dict[str, Any]]: ...
    @property
    def channels(self) -> dict[Channel, list[tuple[Any, ...]]]: ...
    @property
    def coord(self) -> tuple[int, bool]: ...
    @property
    def front(self) -> tuple[int, bool]: ...
    @property
    def trainer(self) -> str: ...


class ModelEnd(Protocol):
    """Where the model's run ends, as :class:`weightsync.repro.schedule.FinalState` gives it (see there)."""

    @property
    def blocked(self) -> dict[int, str]: ...
    @property
    def vars(self) -> dict[int, dict[str, Any]]: ...
    @property
    def channels(self) -> dict[Channel, list[tuple[Any, ...]]]: ...
    @property
    def trainer(self) -> str: ...


def wire(msg: Any, req_index: Mapping[str, int]) -> tuple[Any, ...]:
    """An engine message in the plain form the schedule compares (:func:`weightsync.repro.schedule.wire`);
    ``req_index`` maps request ids to the model's request numbers.

    Raises:
        TypeError: not a message of the protocol.
    """
    if isinstance(msg, AddMsg):
        return ("ADD", req_index.get(msg.request.req_id, -1), msg.wave)
    if isinstance(msg, AbortMsg):
        return ("ABORT", req_index.get(msg.req_id, -1))
    if isinstance(msg, StartDPWave):
        return ("START_DP_WAVE", msg.wave, msg.exclude)
    if isinstance(msg, UtilityCall):
        return (msg.method,)
    if isinstance(msg, FirstReq):
        return ("FIRST_REQ", msg.exclude, msg.wave)
    if isinstance(msg, WaveComplete):
        return ("wave_complete", msg.wave)
    if isinstance(msg, StartWave):
        return ("start_wave", msg.wave, msg.sender)
    raise TypeError(f"not a protocol message: {msg!r}")


def acting(t: TransitionRecord) -> bool:
    """Whether a transition is one the model has: every one but an idle loop pass (a step that changes
    nothing and has no effects), which the model omits, and which the engine's step gate lets through
    (``GatedEngineCore.may_step``)."""
    return not (t.event == "step" and not t.effects and t.before == t.after)


#: the error a collective's (or a transfer's) deadline raises, by name as engines report it
TIMEOUT = TransferTimeoutError.__name__


class ScheduleDriver:
    """One schedule on a live cluster: the driver and its observations
    (:func:`weightsync.repro.engine.run_schedule` creates it and drives it step by step)."""

    def __init__(
        self,
        client: DPEngineClient,
        mode: str,
        clear_cache: bool,
        tokens: int,
        uinfo: dict[str, Any],
        send: Callable[[], None],
        timeout_s: float,
        step_s: float,
        deadline: float,
        say: Callable[[str], None],
    ) -> None:
        self.c = client
        self.mode = mode
        self.clear_cache = clear_cache
        self.tokens = tokens
        self.uinfo = uinfo
        self.send_fn = send
        self.timeout_s = timeout_s
        self.step_s = step_s
        self.deadline = deadline
        self.say = say
        self.n = client.dp_size
        self.req_index: dict[str, int] = {}
        self.streams: list[RequestStream] = []
        self.call: threading.Thread | None = None  # the controller's current call
        self.phase = ""
        self.errors: dict[str, str] = {}
        self.trainer: threading.Thread | None = None
        self.cycle: threading.Thread | None = None
        with client._lock:
            self.start = len(client.transitions)
            self.start_vars = {r: dict(v) for r, v in enumerate(client.rank_vars)}
        self.scan = [self.start] * self.n  # next transition index to look at, per rank
        self.consumed: list[list[TransitionRecord]] = [[] for _ in range(self.n)]
        for r in range(self.n):
            client.set_step_gate(r, 0)

    # -- observations
    def left(self, t: float) -> float:
        return max(0.05, min(t, self.deadline - time.monotonic()))

    def _peek(self, r: int) -> TransitionRecord | None:
        ts = self.c.transitions
        i = self.scan[r]
        while i < len(ts):
            t = ts[i]
            if t.rank == r and acting(t):
                self.scan[r] = i
                return t
            i += 1
        self.scan[r] = i
        return None

    def next_record(self, r: int, timeout: float) -> TransitionRecord | None:
        """Rank ``r``'s next acting transition (consumed), waiting up to ``timeout`` seconds."""
        got: list[TransitionRecord] = []

        def pred() -> bool:
            t = self._peek(r)
            if t is not None:
                got.append(t)
                self.scan[r] += 1
                return True
            return r in self.c.failures

        try:
            self.c.wait_for(pred, self.left(timeout), f"rank {r}'s next transition")
        except TimeoutError:
            return None
        if got:
            self.consumed[r].append(got[0])
            return got[0]
        return None

    def held(self) -> dict[Channel, list[tuple[Any, ...]]]:
        with self.c._lock:
            return {k: [wire(m, self.req_index) for m in q] for k, q in self.c.held.items() if q}

    def held_head(self, ch: Channel) -> tuple[Any, ...] | None:
        with self.c._lock:
            q = self.c.held.get(ch)
            return wire(q[0], self.req_index) if q else None

    def failed(self) -> str:
        return "; ".join(
            f"rank {r} failed in {f.phase}: {f.error[:160]}" for r, f in sorted(self.c.failures.items())
        )

    def expect_fired(self, a: ScheduleStep) -> str:
        """Every row the step fires, as the ranks' next acting transitions (see the module docstring)."""
        for r, ev, guard, after in a.fired:
            t = self.next_record(r, self.step_s)
            if t is None:
                return f"rank {r} fired no {ev} [{guard}] within {self.step_s:.1f} s" + (
                    f" ({self.failed()})" if self.c.failures else ""
                )
            if (t.event, t.guard) != (ev, guard):
                return f"rank {r} fired {t.event} [{t.guard}], the model {ev} [{guard}]"
            why = diff_vars(t.after, after)
            if why:
                return f"rank {r} after {ev} [{guard}]: {why}"
        for r in sorted({f[0] for f in a.fired}):
            want = a.vars_after.get(r, {})
            for _ in range(4):  # an outcome a row's effect causes (a worker's finish)
                if not diff_vars(self.consumed[r][-1].after, want):
                    break
                t = self.next_record(r, self.step_s)
                if t is None:
                    return f"rank {r} after step {a.step}: {diff_vars(self.consumed[r][-1].after, want)}"
            else:
                return f"rank {r} after step {a.step}: {diff_vars(self.consumed[r][-1].after, want)}"
        return ""

    def expect_channels(self, model: Mapping[Channel, list[tuple[Any, ...]]], exact: bool) -> str:
        """Every channel's held messages start with (``exact``: are) the model's, within ``step_s``."""
        last: list[str] = []

        def ok() -> bool:
            real = self.held()
            last.clear()
            for ch in sorted(set(real) | set(model)):
                want, got = model.get(ch, []), real.get(ch, [])
                if got[: len(want)] != want or (exact and len(got) != len(want)):
                    last.append(f"{_ch(ch)}: held {got}, the model {want}")
            return not last

        deadline = time.monotonic() + self.left(self.step_s)
        while not ok():
            if time.monotonic() >= deadline:
                return "; ".join(last)
            time.sleep(0.02)
        return ""

    # -- driver actions
    def background(self, fn: Callable[[], Any], errors: str) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except Exception as exc:
                self.errors[errors] = f"{type(exc).__name__}: {exc}"[:300]

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def previous_returned(self, timeout: float) -> str:
        prev = self.call
        if prev is None:
            return ""
        prev.join(self.left(timeout))
        if prev.is_alive():
            return f"the controller's {self.phase} has not returned (the model's controller has every reply)"
        if "controller" in self.errors:
            return f"the controller's {self.phase} failed: {self.errors['controller']}"
        return ""

    def start_call(self, method: str) -> None:
        """The controller's call ``method`` (a :data:`PHASE_CALL` name) in the background: pause and resume
        through the client's own calls, the weight calls fanned out (``update_weights`` with the round's
        update info)."""
        c, t = self.c, 3 * self.timeout_s
        own: dict[Phase, Callable[[], Any]] = {
            Phase.PAUSE: lambda: c.pause(self.mode, clear_cache=self.clear_cache, timeout=t),
            Phase.RESUME: lambda: c.resume(timeout=t),
            Phase.UPDATE: lambda: c.fan_out(method, t, update_info=self.uinfo),
        }
        fn = own.get(PHASE_OF_CALL[method], lambda: c.fan_out(method, t))
        self.call = self.background(fn, "controller")
        self.phase = method

    def start_trainer(self) -> None:
        if self.trainer is None:
            self.trainer = self.background(self.send_fn, "trainer")

    def do(self, a: ScheduleStep) -> str:
        """Drive one step; returns why it was not followed ("" when it was)."""
        c = self.c
        why = ""
        if a.kind == "add":
            rid = f"req-{a.message[1]}"
            self.req_index[rid] = int(a.message[1])
            self.streams.append(
                c.add_request(
                    [1, 2, 3],
                    SamplingParams(temperature=0.0, max_new_tokens=self.tokens),
                    req_id=rid,
                    rank=a.rank,
                )
            )
        elif a.kind == "call":
            why = self.previous_returned(self.step_s)
            if not why:
                self.start_call(str(a.arg))
                if a.trainer == "weight_broadcast":
                    self.start_trainer()
                for r, *_ in a.fired:  # a call the model delivers at once
                    why = why or self.release((r, "control"), (str(a.arg),))
        elif a.kind == "fe":
            (c.pause(self.mode, clear_cache=self.clear_cache) if a.arg == "pause" else c.resume())
            self.phase = str(a.arg)
            for r, *_ in a.fired:
                why = why or self.release((r, "control"), (str(a.arg),), wait=True)
        elif a.kind == "release":
            why = self.release(a.channel, a.message)
        elif a.kind == "step":
            c.set_step_gate(a.rank, 1)
        elif a.kind == "coord":
            acks = c.coord_acks
            why = self.release(a.channel, a.message)
            if not why:
                try:
                    c.wait_for(lambda: c.coord_acks > acks, self.left(self.step_s), "the coordinator")
                except TimeoutError:
                    why = f"the coordinator did not handle {a.message}"
                stats: Stats | None = c._held_stats
                got = None if stats is None else (stats.current_wave, stats.engines_running)
                if not why and got != a.coord:
                    why = f"the coordinator's (current_wave, engines_running) is {got}, the model's {a.coord}"
        elif a.kind == "refresh":
            c.refresh()
            got = (c.current_wave, c.engines_running)
            if got != a.front:
                why = f"the front-end believes (current_wave, engines_running) {got}, the model {a.front}"
        elif a.kind != "observe":
            raise ValueError(f"step {a.step}: unknown step kind {a.kind!r}")
        if not why:
            why = self.expect_fired(a)
        if a.kind == "step" and why:
            c.set_step_gate(a.rank, 0)
        if not why and a.kind == "add":
            front = (c.current_wave, c.engines_running)
            if front != a.front:
                why = f"the front-end believes (current_wave, engines_running) {front}, the model {a.front}"
        if not why:
            why = self.expect_channels(a.channels, exact=False)
        if not why and c.failures:
            why = self.failed()
        return why

    def release(self, ch: Channel, want: tuple[Any, ...], wait: bool = False) -> str:
        head = self.held_head(ch)
        if head is None and wait:
            end = time.monotonic() + self.left(self.step_s)
            while head is None and time.monotonic() < end:
                time.sleep(0.02)
                head = self.held_head(ch)
        if head is None:
            return f"nothing held on {_ch(ch)}, the model's next message there is {want}"
        if head != want:
            return f"the next message held on {_ch(ch)} is {head}, the model's {want}"
        self.c.release(*ch)
        return ""

    def impossible(self, a: ScheduleStep) -> str:
        """The step the fix makes impossible: drive it and find it does not happen. Returns "" when it did
        not, else what happened instead."""
        c = self.c
        if a.kind == "call":
            return (
                "the controller's previous call returned" if not self.previous_returned(self.step_s) else ""
            )
        if a.kind in ("release", "coord"):
            head = self.held_head(a.channel)
            if head != a.message:
                return ""
            c.release(*a.channel)
        elif a.kind == "step":
            c.set_step_gate(a.rank, 1)
        elif a.kind == "refresh":
            c.refresh()
            return "" if (c.current_wave, c.engines_running) != a.front else "the front-end refreshed"
        elif a.kind == "add":
            return "the front-end sent the request"
        ranks = sorted({f[0] for f in a.fired})
        time.sleep(self.left(self.step_s))
        if a.kind == "step":
            c.set_step_gate(a.rank, 0)
        for r in ranks:
            t = self._peek(r)
            if t is not None:
                return f"rank {r} fired {t.event} [{t.guard}]"
        return ""

    # -- after the schedule
    def flow(self) -> None:
        """Let every message flow and every rank step freely."""
        c = self.c
        for r in range(self.n):
            c.set_step_gate(r, -1)
        c.set_hold(False)
        c.release_all()

    def finish_cycle(self) -> None:
        """The controller completes its cycle from where the schedule left it: the spec's controller table
        (:mod:`weightsync.spec.controller`, policy ``one_round``, as
        :func:`~weightsync.impl.engine.controller.update_round` runs it) from the phase of the schedule's
        last call, each call after the previous one returned; a call that has not returned is ``WAITING``
        (no row: the controller stops), one that raised is ``FAILED`` (the table's failure rows)."""
        table = controller_table()  # this client's pause and resume are its own calls, whatever the variant
        start = CtrlVars(state=PHASE_OF_CALL.get(self.phase, Phase.IDLE), cycles_started=1)

        def cycle() -> None:
            v = start
            while True:
                prev = self.call
                if prev is not None:
                    prev.join(3 * self.timeout_s + 5)
                answered = prev is None or not prev.is_alive()
                event = controller_event(v.phase, answered, "controller" in self.errors)
                nxt = controller_next(table, v, event, ONE_ROUND_ARGS)  # update_round's policy
                if nxt is None or nxt[0].effects != ("fan_out",):
                    return  # the controller waits, or the table's round is over (end_round / raise_*)
                _, v = nxt
                call = PHASE_CALL[v.phase]
                self.say(f"the controller completes its cycle: {call}")
                self.start_call(call)
                if TRAINER_COLLECTIVE.get(v.phase) is Collective.WEIGHT_BROADCAST:
                    self.start_trainer()

        self.cycle = self.background(cycle, "controller")

    def records(self) -> dict[int, list[TransitionRecord]]:
        out: dict[int, list[TransitionRecord]] = {r: [] for r in range(self.n)}
        with self.c._lock:
            for t in self.c.transitions[self.start :]:
                if acting(t):
                    out[t.rank].append(t)
        return out

    def events(self) -> dict[str, list[str]]:
        return {
            str(r): [
                f"{t.event} [{t.guard}] -> {t.after.get('state')}/w{t.after.get('current_wave')}"
                for t in rr[-6:]
            ]
            for r, rr in self.records().items()
        }


#: Variables the model and the engine spell differently: the model's versions are round numbers, the
#: engine's vLLM 0.32's string labels ("default" at start; this controller's finish names none).
_NOT_COMPARED = frozenset({"weight_version"})


def diff_vars(got: Mapping[str, Any], want: Mapping[str, Any]) -> str:
    """The compared variables where the engine's ``got`` differs from the model's ``want``, for people."""
    bad = {k: (got.get(k), v) for k, v in want.items() if k not in _NOT_COMPARED and got.get(k) != v}
    return ", ".join(f"{k}: engine {g!r}, model {w!r}" for k, (g, w) in bad.items())


def _ch(ch: Channel) -> str:
    r, name = ch
    if name == COORD:
        return "front-end -> coordinator" if r < 0 else f"rank {r} -> coordinator"
    return f"rank {r} {name}"


__all__ = [
    "PHASE_OF_CALL",
    "TIMEOUT",
    "Channel",
    "ModelEnd",
    "ScheduleDriver",
    "ScheduleStep",
    "acting",
    "diff_vars",
    "wire",
]
