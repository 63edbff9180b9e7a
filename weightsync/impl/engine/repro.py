"""Replay a model counterexample on real processes (``weightsync repro VARIANT``).

The model's shortest counterexample (``weightsync check --variant V --ranks 2``) is a list of labelled
steps of its product graph. :func:`compile_counterexample` turns its plain ``labels`` / ``records`` into
the step language of a *holding router*: a DP cluster whose client holds every message -- engine-bound
(front-end input, controller input, the coordinator's wave socket), coordinator-bound (the front-end's
FIRST_REQ, a rank's wave_complete / start_wave) and the coordinator's stats to the front-end -- until the
schedule releases it, and whose engines take an acting step only with a permit (the step gate), so the
interleaving of the counterexample is forced on real processes, one model step to one real action:

=========================================  =====================================================================
model step                                  router step
=========================================  =====================================================================
front-end sends ADD to rank i               ``("add", i)``: ADD held; FIRST_REQ held if the front-end believes
                                            the engines idle
rank i receives M                           ``("deliver", i, socket, event)``: release the oldest held message
                                            on (i, socket), wait until rank i fired ``event``
rank i steps (and enters a collective)      ``("step", i)``: one permit, wait for the acting STEP
ranks complete collective K                 ``("done", K)``: wait until every rank fired ``K_done``
coordinator receives M from P               ``("coord", P)``: release it (P = -1: front-end), wait for the ack
controller fans out CALL (first rank)       ``("call", CALL)``: wait for the previous call's return, then
                                            start CALL on every rank (its messages are held per rank)
front-end applies pause/resume              ``("fe", CALL)``: the front-end call, delivered to every rank
trainer enters weight_broadcast             ``("send",)``: the trainer's send, in the background
front-end refreshes stats                   ``("refresh",)``: adopt the coordinator's latest held stats
=========================================  =====================================================================

Every wait is bounded (``step_s``). A step that does not happen within it (a reply that never comes, an
event that does not happen under a fixed protocol) is skipped and the run *diverges*: from then on steps
are no longer gated (messages stay held and are released in the schedule's order). After the schedule
every message flows freely and the controller completes its cycle (pause -> start -> update with the
trainer's send -> finish -> resume, from wherever the schedule left it). The outcome is ``reproduced`` when
a rank failed in a collective (one-sided or mismatched, caught by the collective timeout), ``completed``
when the controller's calls returned and every request finished, ``not reproduced`` otherwise.

``two-phase-epoch`` runs every buggy variant's schedule. The hand-written schedules (:data:`SCHEDULES`,
older step language: ``release``, ``await``, ``round``, ``join``, ``stats``, ``call_rank``) remain only as a
fallback when no model counterexample is given; results say which was used (``schedule_source``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.impl.engine.client import COORD, SOCKETS, DPEngineClient, RequestStream, free_port
from weightsync.impl.engine.core import EngineConfig, tiny_config
from weightsync.impl.engine.messages import TransitionRecord
from weightsync.impl.models.sampling import SamplingParams
from weightsync.spec.rank import get_variant

Step = tuple[Any, ...]

#: The controller's cycle, in order (the model's controller phases).
CYCLE = ("pause", "start_weight_update", "update_weights", "finish_weight_update", "resume")

#: Hand-written fallback schedules (the older step language), used only without a model counterexample.
SCHEDULES: dict[str, list[Step]] = {
    # blog scenario: engine 0 mid-step waits for engine 1, which runs the update and enters the broadcast
    "front-end-pause": [
        ("add", 0),
        ("release", 0, "front"),
        ("await", 0, "step"),  # rank 0 is in the forward collective, waiting for rank 1
        ("call", "pause"),
        ("release", 1, "control"),
        ("release", 0, "control"),  # queued behind rank 0's step
        ("join",),  # front-end pause returns at once
        ("call_rank", 1, "start_weight_update"),  # internal LB: the first answer returns
        ("release", 1, "control"),
        ("join",),
        ("send",),  # the trainer starts broadcasting
        ("call_rank", 1, "update_weights"),
        ("release", 1, "control"),
        ("await", 1, "update_weights"),  # rank 1 is in the weight broadcast
        ("call_rank", 0, "start_weight_update"),
        ("release", 0, "control"),
        ("join",),
        ("call_rank", 0, "update_weights"),
        ("release", 0, "control"),
        ("join",),
        ("call", "finish_weight_update"),
        ("release", 0, "control"),
        ("release", 1, "control"),
        ("join",),
        ("call", "resume"),
    ],
    # issue #36594: both pause on the idle fast path, then a queued START_DP_WAVE re-arms engine 1
    "idle-fast-path": [
        ("add", 0),
        ("round",),
        ("release", 0, "control"),  # pause
        ("release", 1, "control"),  # pause
        ("release", 0, "control"),  # start
        ("release", 1, "control"),  # start
        ("release", 0, "control"),  # update: rank 0 enters the broadcast
        ("await", 0, "update_weights"),
        ("release", 1, "wave"),  # the stale START_DP_WAVE
        ("await", 1, "START_DP_WAVE"),
    ],
    # PR #36608: rank 0 pauses (idle) and ignores waves; rank 1 gets work and waits for it forever
    "ignore-wave": [
        ("add", 1),
        ("round",),
        ("release", 0, "control"),  # pause on rank 0 only
        ("await", 0, "pause"),
        ("release", 1, "front"),  # rank 1's request
        ("await", 1, "step"),
        ("release", 0, "wave"),
        ("await", 0, "START_DP_WAVE"),
    ],
    # PR #39366 as shipped: ADD and resume travel on different FIFOs; rank 1 drops the wave while still
    # verified; after the resume barrier the rank holding the request steps alone
    "two-phase": [
        ("call", "pause"),
        ("release", 0, "control"),
        ("release", 1, "control"),
        ("join",),
        ("stats",),  # the coordinator processed wave_complete; the front-end saw its stats
        ("add", 0),
        ("release", 1, "wave"),
        ("await", 1, "START_DP_WAVE"),
        ("call", "resume"),
        ("release", 0, "control"),
        ("release", 1, "control"),
        ("join",),
        ("release", 0, "front"),
        ("await", 0, "ADD"),
    ],
}

EXPECTED: dict[str, str] = {
    "front-end-pause": "reproduced",
    "idle-fast-path": "reproduced",
    "ignore-wave": "reproduced",
    "two-phase": "reproduced",
    "two-phase-epoch": "completed",
}
BUGGY = tuple(v for v, r in EXPECTED.items() if r == "reproduced")


def _message_socket(message: str) -> tuple[str, str]:
    """(socket, rank event) of a message as the model's records print it."""
    if message.startswith("ADD("):
        return "front", "ADD"
    if message.startswith("START_DP_WAVE("):
        return "wave", "START_DP_WAVE"
    call = message.split("(", 1)[0].split(" ", 1)[0]
    return "control", call


def compile_counterexample(cx: Mapping[str, Any]) -> list[Step]:
    """The router steps of a model counterexample (``labels`` and ``records`` as plain lists/dicts, as
    :func:`weightsync.model.check.check` returns them). See the module docstring for the mapping.

    Raises:
        ValueError: a label the router does not know, or labels and records of different lengths.
    """
    labels = [list(x) for x in cx["labels"]]
    records = [dict(x) for x in cx["records"]]
    if len(labels) != len(records):
        raise ValueError(f"{len(labels)} labels but {len(records)} records")
    out: list[Step] = []
    phase = ""
    for lab, rec in zip(labels, records, strict=True):
        kind = lab[0]
        if kind == "send":
            out.append(("add", int(lab[1])))
        elif kind == "recv":
            sock, event = _message_socket(str(rec["message"]))
            out.append(("deliver", int(lab[1]), sock, event))
        elif kind == "step":
            out.append(("step", int(lab[1])))
        elif kind == "done":
            out.append(("done", str(lab[1])))
        elif kind == "coord":
            out.append(("coord", int(lab[1])))
        elif kind == "fan":
            call = str(lab[1])
            if call != phase or int(lab[2]) < 0:
                out.append(("call", call))
            phase = call
        elif kind == "fe":
            phase = str(lab[1])
            out.append(("fe", phase))
        elif kind == "trainer":
            out.append(("send",))
        elif kind == "refresh":
            out.append(("refresh",))
        else:
            raise ValueError(f"unknown model label {lab!r}")
    return out


@dataclass
class ReproResult:
    """Outcome of one schedule on real processes (the JSON of ``weightsync repro``)."""

    variant: str
    schedule: str
    result: str
    seconds: float
    ranks: list[int]
    collectives: dict[int, str]
    errors: dict[int, str] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    source: str = "hand-written"
    counterexample: list[str] = field(default_factory=list)
    diverged_at: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "variant": self.variant,
            "schedule": self.schedule,
            "schedule_source": self.source,
            "result": self.result,
            "seconds": round(self.seconds, 3),
            "ranks": self.ranks,
            "collectives": {str(k): v for k, v in self.collectives.items()},
            "errors": {str(k): v for k, v in self.errors.items()},
            "diverged_at": self.diverged_at,
            "counterexample": self.counterexample,
            "steps": self.steps,
        }


def _acting_step(t: TransitionRecord) -> bool:
    return t.event == "step" and (bool(t.effects) or t.before != t.after)


class _Run:
    """One schedule on a live cluster (the router's interpreter)."""

    def __init__(
        self,
        client: DPEngineClient,
        variant: str,
        mode: str,
        uinfo: dict[str, Any],
        send: Callable[[], None],
        timeout_s: float,
        step_s: float,
        deadline: float,
    ) -> None:
        self.client = client
        self.front_end_pause = get_variant(variant).pause_in_front_end
        self.mode = mode
        self.uinfo = uinfo
        self.send_fn = send
        self.timeout_s = timeout_s
        self.step_s = step_s
        self.deadline = deadline
        self.log: list[str] = []
        self.streams: list[RequestStream] = []
        self.bg: list[threading.Thread] = []
        self.bg_err: list[str] = []
        self.call: threading.Thread | None = None  # the controller's current call
        self.phase = ""
        self.stuck = False  # a controller call never returned: no further calls
        self.trainer_sent = False
        self.cycle_started = False
        self.gated = True
        self.diverged_at: int | None = None
        self.index = 0
        n = client.dp_size
        self.cursor = [len(client.transitions)] * n
        for r in range(n):
            client.set_step_gate(r, 0)

    # -- helpers
    def background(self, fn: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except Exception as exc:
                self.bg_err.append(f"{type(exc).__name__}: {exc}")

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.bg.append(t)
        return t

    def diverge(self, why: str) -> None:
        self.log.append(f"{why} (skipped)")
        if self.diverged_at is None:
            self.diverged_at = self.index + 1
            self.open_gates()
            self.log.append("the run diverges from the schedule: steps are no longer gated")

    def open_gates(self) -> None:
        if self.gated:
            self.gated = False
            for r in range(self.client.dp_size):
                self.client.set_step_gate(r, -1)

    def wait(self, pred: Callable[[], bool], what: str, timeout: float | None = None) -> bool:
        """Wait until ``pred()`` (evaluated once per wake-up; it may consume) or a rank failed."""
        t = self.step_s if timeout is None else timeout
        t = max(0.05, min(t, self.deadline - time.monotonic()))
        hit: list[bool] = []

        def check() -> bool:
            if pred():
                hit.append(True)
                return True
            return bool(self.client.failures)

        try:
            self.client.wait_for(check, t, what)
        except TimeoutError:
            return False
        return bool(hit)

    def fired(self, r: int, match: Callable[[TransitionRecord], bool]) -> Callable[[], bool]:
        """A predicate: rank ``r`` fired a matching transition after its cursor (advanced past it)."""

        def pred() -> bool:
            ts = self.client.transitions
            for i in range(self.cursor[r], len(ts)):
                t = ts[i]
                if t.rank == r and match(t):
                    self.cursor[r] = i + 1
                    return True
            return False

        return pred

    def start_call(self, method: str) -> None:
        """The controller's next call, after the previous one returned (a real controller waits)."""
        if self.stuck:
            self.log.append(f"controller call {method} not issued (an earlier call never returned)")
            return
        if self.call is not None and self.call.is_alive():
            prev = self.call
            if not self.wait(lambda: not prev.is_alive(), f"{self.phase} to return"):
                self.diverge(f"controller call {self.phase} had not returned")
                self.wait(lambda: not prev.is_alive(), f"{self.phase} to return", 3 * self.timeout_s)
            if prev.is_alive():
                self.stuck = True
                self.log.append(f"controller call {self.phase} never returned: {method} not issued")
                return
        c, t, kw = self.client, 3 * self.timeout_s, {}
        fn: Callable[[], Any]
        if method == "pause":
            fn = lambda: c.pause(self.mode, timeout=t)  # noqa: E731
        elif method == "resume":
            fn = lambda: c.resume(timeout=t)  # noqa: E731
        else:
            if method == "update_weights":
                kw = {"update_info": self.uinfo}
            fn = lambda: c.fan_out(method, t, **kw)  # noqa: E731
        self.call = self.background(fn)
        self.phase = method
        shown = f"pause({self.mode})" if method == "pause" else method
        self.log.append(f"controller calls {shown}" + (" (held per rank)" if self.client.hold else ""))

    def front_end_call(self, method: str) -> None:
        """front-end-pause: pause/resume is a flag in the front-end and returns at once."""
        if method == "pause":
            self.client.pause(self.mode)
        else:
            self.client.resume()

    def deliver(self, r: int, sock: str, event: str) -> None:
        key = (r, sock)
        if not self.wait(lambda: self.client.has_held(*key), f"a held message for rank {r} on {sock}"):
            self.diverge(f"nothing held for rank {r} on {sock}")
            return
        msg = self.client.release(r, sock)
        txt = f"rank {r} receives {type(msg).__name__}{_brief(msg)} on {sock}"
        if self.wait(self.fired(r, lambda t: t.event == event), f"rank {r} {event}"):
            t = self.client.transitions[self.cursor[r] - 1]
            self.log.append(f"{txt}: {t.guard}, {t.before['state']}->{t.after['state']}")
        else:
            self.diverge(f"{txt}, but rank {r} did not handle it")

    # -- one step
    def do(self, step: Step) -> None:
        c = self.client
        op = step[0]
        if op == "add":
            r = int(step[1])
            self.streams.append(
                c.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4), rank=r)
            )
            self.log.append(f"front-end sends a request to rank {r} (ADD held; FIRST_REQ held if idle)")
        elif op == "deliver":
            self.deliver(int(step[1]), str(step[2]), str(step[3]))
        elif op == "step":
            r = int(step[1])
            if self.gated:
                c.set_step_gate(r, 1)
            if self.wait(self.fired(r, _acting_step), f"rank {r} to step"):
                t = c.transitions[self.cursor[r] - 1]
                self.log.append(f"rank {r} steps{' and enters ' + t.collective if t.collective else ''}")
            else:
                if self.gated:
                    c.set_step_gate(r, 0)
                self.diverge(f"rank {r} did not step")
        elif op == "done":
            kind = str(step[1])
            ok = all(
                self.wait(self.fired(r, lambda t: t.event == f"{kind}_done"), f"rank {r} {kind}_done")
                for r in range(c.dp_size)
            )
            if ok:
                self.log.append(f"ranks complete {kind}")
            else:
                self.diverge(f"{kind} did not complete")
        elif op == "coord":
            src = int(step[1])
            who = "front-end" if src < 0 else f"rank {src}"
            if not self.wait(lambda: c.has_held(src, COORD), f"a message from {who} to the coordinator"):
                self.diverge(f"nothing held from {who} to the coordinator")
                return
            acks = c.coord_acks
            msg = c.release(src, COORD)
            if self.wait(lambda: c.coord_acks > acks, "the coordinator"):
                self.log.append(f"coordinator receives {type(msg).__name__}{_brief(msg)} from {who}")
            else:
                self.diverge(f"coordinator did not acknowledge {type(msg).__name__}")
        elif op == "call":
            self.start_call(str(step[1]))
        elif op == "fe":
            method = str(step[1])
            if self.front_end_pause:  # the flag in the front-end; the ranks only record the call
                self.front_end_call(method)
                self.phase = method
                self.log.append(f"front-end applies {method} (returns at once)")
            else:
                self.start_call(method)
            for r in range(c.dp_size):
                self.deliver(r, "control", method)
        elif op == "send":
            self.background(self.send_fn)
            self.trainer_sent = True
            self.log.append("trainer starts trainer_send_weights")
        elif op == "refresh":
            c.refresh()
            self.log.append(f"front-end refreshes stats: wave {c.current_wave}, running {c.engines_running}")
        else:
            self.legacy(step)

    def legacy(self, step: Step) -> None:
        """The hand-written schedules' steps (fallback)."""
        c = self.client
        op = step[0]
        if op == "round":
            self.open_gates()
            self.cycle_in_background(list(CYCLE))
            self.log.append("controller starts pause -> start -> update || send -> finish -> resume")
        elif op == "join":
            call = self.call
            ok = call is None or self.wait(lambda: not call.is_alive(), "controller call", 3 * self.step_s)
            self.log.append("controller call returned" if ok else "join timed out")
        elif op == "stats":

            def synced() -> bool:
                top = max(int(v.get("current_wave", 0)) for v in c.rank_vars)
                return c.current_wave >= top and not c.engines_running

            ok = self.wait(synced, "coordinator stats")
            self.log.append(
                f"front-end sees coordinator stats: wave {c.current_wave}, idle"
                if ok
                else "coordinator stats not in sync (skipped)"
            )
        elif op == "call_rank":
            r, method = int(step[1]), str(step[2])
            kw: dict[str, Any] = {"update_info": self.uinfo} if method == "update_weights" else {}
            fut = c.call_rank(r, method, **kw)
            self.call = self.background(lambda: fut.result(3 * self.timeout_s))
            self.log.append(f"controller calls {method} on rank {r}")
        elif op == "release":
            r, sock = int(step[1]), str(step[2])
            if self.wait(lambda: c.has_held(r, sock), "held message"):
                msg = c.release(r, sock)
                self.log.append(f"rank {r} receives {type(msg).__name__}{_brief(msg)} on {sock}")
            else:
                self.log.append(f"nothing held for rank {r} on {sock} (skipped)")
        elif op == "await":
            r, ev = int(step[1]), str(step[2])
            ok = self.wait(self.fired(r, lambda t: t.event == ev and (ev != "step" or bool(t.effects))), ev)
            self.log.append(f"rank {r} fired {ev}" if ok else f"rank {r} did not fire {ev} (skipped)")
        else:
            raise ValueError(f"unknown schedule step {step!r}")

    # -- after the schedule
    def finish_cycle(self) -> None:
        """Let every message flow and complete the controller's cycle from where the schedule left it."""
        c = self.client
        self.open_gates()
        c.set_hold(False)
        c.release_all()
        self.log.append("all held messages released; steps ungated")
        rest = list(CYCLE[CYCLE.index(self.phase) + 1 :]) if self.phase in CYCLE else []
        if self.cycle_started:  # a hand-written 'round' runs the whole cycle already
            rest = []
        if self.phase == "update_weights" and not self.trainer_sent:
            self.background(self.send_fn)
            self.trainer_sent = True
            self.log.append("trainer starts trainer_send_weights")
        if rest:
            self.log.append("controller completes its cycle: " + " -> ".join(rest))

        self.cycle_in_background(rest)

    def cycle_in_background(self, methods: list[str]) -> None:
        """The controller's calls ``methods`` in order, each after the previous returned (background)."""
        c = self.client
        self.cycle_started = self.cycle_started or methods == list(CYCLE)

        def cycle() -> None:
            for m in methods:
                prev = self.call
                if prev is not None:
                    prev.join(3 * self.timeout_s)
                    if prev.is_alive():
                        return
                if self.bg_err or c.failures:  # a real controller stops at a failed call
                    self.log.append(f"controller stops before {m}: an earlier call failed")
                    return
                if self.front_end_pause and m in ("pause", "resume"):
                    self.front_end_call(m)
                    continue
                self.start_call(m)
                if m == "update_weights" and not self.trainer_sent:
                    self.trainer_sent = True
                    self.send_fn()

        self.background(cycle)


def run_schedule(
    variant: str,
    schedule: str,
    steps: list[Step] | None = None,
    timeout_s: float = 5.0,
    step_s: float = 1.5,
    budget_s: float = 50.0,
    mode: str = "abort",
    source: str | None = None,
    counterexample: list[str] | None = None,
) -> ReproResult:
    """Run ``steps`` (default: the hand-written ``SCHEDULES[schedule]``) under ``variant`` on 2 DP ranks.

    Args:
        variant: protocol variant the engines run.
        schedule: name of the schedule (reported; the variant whose counterexample it is).
        steps: router steps (see :func:`compile_counterexample`).
        timeout_s: collective timeout of every DP collective and transfer, seconds.
        step_s: how long one step waits for what it expects, seconds.
        budget_s: overall deadline after startup, seconds.
        mode: the pause mode of the controller's pause calls.
        source: ``"model"`` or ``"hand-written"`` (reported; default: hand-written iff ``steps`` is None).
        counterexample: the model's numbered steps (reported).
    """
    from weightsync.impl.engine.weights import random_weights, update_info_for
    from weightsync.impl.models.causal_lm import CausalLM
    from weightsync.impl.transfer.broadcast import BroadcastTrainer

    t0 = time.monotonic()
    src = source or ("hand-written" if steps is None else "model")
    steps = list(SCHEDULES[schedule] if steps is None else steps)
    mcfg = tiny_config()
    cfg = EngineConfig(
        dp_size=2, model=mcfg, variant=variant, sync_interval=2, collective_timeout_s=timeout_s
    )
    client = DPEngineClient(replace(cfg, dp_port=free_port()), hold=True)
    trainer_box: list[BroadcastTrainer] = []
    try:
        client.start()
        # set up the transfer group with messages flowing freely
        client.set_hold(False)
        info: dict[str, Any] = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 3,
            "timeout_s": timeout_s,
            "group_backend": "gloo",  # the engines' weights live on the CPU
        }
        # the trainer (rank 0, hosting the store) outlives the engines' deadline, as a real one would
        tinfo = dict(info, timeout_s=timeout_s + 10)
        th = threading.Thread(target=lambda: trainer_box.append(BroadcastTrainer(tinfo)))
        th.start()
        client.init_weight_transfer_engine(info, timeout=timeout_s + 10)
        th.join(timeout_s + 10)
        trainer = trainer_box[0]
        ws = random_weights(CausalLM(mcfg), 1)
        uinfo = update_info_for(ws)
        with client._lock:  # the schedule starts from quiet engines and a front-end in sync
            client.set_hold(True)
        if src == "hand-written":  # the older schedules: free steps, coordinator traffic not held
            client.hold_coord = False
        run = _Run(
            client,
            variant,
            mode,
            uinfo,
            lambda: trainer.send(ws),
            timeout_s,
            step_s,
            time.monotonic() + budget_s,
        )
        if src == "hand-written":
            run.open_gates()
        for k, step in enumerate(steps):
            if client.failures or time.monotonic() > run.deadline:
                break
            run.index = k
            run.do(step)
        if not client.failures:
            run.finish_cycle()
        end = time.monotonic() + min(budget_s, 3 * timeout_s + 10)
        while time.monotonic() < end:
            if client.failures:
                break
            client.release_all()
            if not any(t.is_alive() for t in run.bg) and all(s.done.is_set() for s in run.streams):
                break
            time.sleep(0.02)
        if client.failures:
            time.sleep(0.5)  # let the other ranks' timeouts land too
        fails = dict(client.failures)
        collectives: dict[int, str] = {}
        errors: dict[int, str] = {}
        for r, f in sorted(fails.items()):
            collectives[r] = (
                (f"{f.collective}#{f.coll_seq}" if f.coll_seq >= 0 else f.collective)
                if f.collective
                else (f.peers.get(r) or f.phase)
            )
            errors[r] = f.error.splitlines()[0][:300]
            for q, what in f.peers.items():
                collectives.setdefault(int(q), what)
        if fails:
            result = "reproduced"
            for r in sorted(fails):
                run.log.append(f"rank {r} failed in {collectives[r]}: {errors[r]}")
        elif (
            not any(t.is_alive() for t in run.bg)
            and not run.bg_err
            and all(s.done.is_set() for s in run.streams)
        ):
            result = "completed"
        else:
            result = "not reproduced"
        if run.bg_err:
            errors[-1] = run.bg_err[0][:300]
        ranks = sorted(collectives) if fails else list(range(client.dp_size))
        return ReproResult(
            variant,
            schedule,
            result,
            time.monotonic() - t0,
            ranks,
            collectives,
            errors,
            run.log,
            src,
            list(counterexample or []),
            run.diverged_at,
        )
    finally:
        for tr in trainer_box:
            tr.close()
        client.shutdown(timeout_s=timeout_s + 2)


def _brief(msg: Any) -> str:
    if hasattr(msg, "request"):
        return f"({msg.request.req_id}, wave={msg.wave})"
    for attr in ("method", "wave"):
        if hasattr(msg, attr):
            v = getattr(msg, attr)
            ex = getattr(msg, "exclude", None)
            return f"({v})" if ex is None else f"(wave={v}, exclude={ex})"
    return ""


def schedules_for(variant: str) -> list[str]:
    """The schedules ``weightsync repro VARIANT`` runs: the variant's own counterexample, or every buggy
    variant's for ``two-phase-epoch``.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in EXPECTED:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(EXPECTED)}")
    return [variant] if variant in BUGGY else list(BUGGY)


def repro(
    variant: str,
    counterexamples: Mapping[str, Mapping[str, Any]] | None = None,
    timeout_s: float = 5.0,
    only: list[str] | None = None,
) -> list[ReproResult]:
    """``weightsync repro VARIANT``: run each schedule of :func:`schedules_for` on real processes.

    Args:
        variant: the variant the engines run.
        counterexamples: schedule name -> the model's counterexample record (``labels``, ``records``,
            ``steps``, ``mode``), compiled with :func:`compile_counterexample`; a schedule without one
            falls back to its hand-written form (``schedule_source: "hand-written"``).
        timeout_s: collective timeout, seconds.
        only: run only these schedules.

    Raises:
        ValueError: unknown variant or schedule.
    """
    names = schedules_for(variant)
    if only is not None:
        bad = [n for n in only if n not in names]
        if bad:
            raise ValueError(f"schedule(s) {bad} not among {names}")
        names = [n for n in names if n in only]
    out: list[ReproResult] = []
    for name in names:
        cx = (counterexamples or {}).get(name)
        if cx is not None:
            out.append(
                run_schedule(
                    variant,
                    name,
                    compile_counterexample(cx),
                    timeout_s=timeout_s,
                    mode=str(cx.get("mode", "abort")),
                    source="model",
                    counterexample=[str(x) for x in cx.get("steps", [])],
                )
            )
        else:
            out.append(run_schedule(variant, name, timeout_s=timeout_s, source="hand-written"))
    return out


__all__ = [
    "BUGGY",
    "CYCLE",
    "EXPECTED",
    "SCHEDULES",
    "SOCKETS",
    "ReproResult",
    "compile_counterexample",
    "repro",
    "run_schedule",
    "schedules_for",
]
