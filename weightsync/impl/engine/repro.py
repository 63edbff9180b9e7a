"""Replay a counterexample schedule on real processes (``weightsync repro VARIANT``).

A schedule is a list of steps over a DP cluster whose client holds every engine-bound message (front-end
input, controller input and the coordinator's wave socket) until the schedule releases it, so the
interleaving of the model's counterexample is forced on real processes:

- ``("add", rank)``: the front-end sends a request to ``rank`` (ADD held; FIRST_REQ reaches the coordinator,
  whose START_DP_WAVE is held per rank);
- ``("call", method)``: the controller starts a fan-out call in the background (its messages are held);
- ``("round",)``: the controller starts a whole update round (pause(abort), start, update with the trainer's
  send, finish, resume) in the background;
- ``("release", rank, socket)``: deliver the oldest held message (waits up to ``step_s`` for one to appear;
  skipped if none does: a later message may depend on a reply the variant never gives);
- ``("await", rank, event)``: wait up to ``step_s`` until ``rank`` fired ``event``;
- ``("join",)``: wait for the controller's background call;
- ``("stats",)``: wait until the front-end's coordinator stats show the ranks' wave and idle engines;
- ``("call_rank", rank, method)``, ``("send",)``: one call to one rank; the trainer's send.

After the steps every message flows freely. The outcome is ``reproduced`` when a rank failed in a DP
collective (a one-sided or mismatched collective, caught by the collective timeout), ``completed`` when the
controller's calls returned and every request finished, ``not reproduced`` otherwise.

The schedules (:data:`SCHEDULES`) are the shortest counterexamples of the four buggy variants written as
steps (blog DP=2 scenario, issue #36594, PR #36608's liveness failure, and the resume-time race of PR
#39366 as shipped). ``two-phase-epoch`` is run against every one of them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.impl.engine.client import SOCKETS, DPEngineClient, RequestStream, free_port
from weightsync.impl.engine.core import EngineConfig, tiny_config
from weightsync.impl.models.sampling import SamplingParams

Step = tuple[Any, ...]

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

    def as_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "variant": self.variant,
            "schedule": self.schedule,
            "result": self.result,
            "seconds": round(self.seconds, 3),
            "ranks": self.ranks,
            "collectives": {str(k): v for k, v in self.collectives.items()},
            "errors": {str(k): v for k, v in self.errors.items()},
            "steps": self.steps,
        }


def run_schedule(
    variant: str,
    schedule: str,
    steps: list[Step] | None = None,
    timeout_s: float = 4.0,
    step_s: float = 2.0,
    budget_s: float = 50.0,
) -> ReproResult:
    """Run ``schedule`` (a :data:`SCHEDULES` key, or explicit ``steps``) under ``variant`` on 2 DP ranks.

    Args:
        variant: protocol variant the engines run.
        schedule: name of the schedule (reported).
        steps: the steps (default ``SCHEDULES[schedule]``).
        timeout_s: collective timeout of every DP collective and transfer, seconds.
        step_s: how long a release/await step waits, seconds.
        budget_s: overall deadline after startup, seconds.
    """
    from weightsync.impl.engine.controller import update_round
    from weightsync.impl.engine.weights import SimpleBroadcastTrainer, random_weights
    from weightsync.impl.models.causal_lm import CausalLM

    t0 = time.monotonic()
    steps = list(SCHEDULES[schedule] if steps is None else steps)
    mcfg = tiny_config()
    cfg = EngineConfig(
        dp_size=2, model=mcfg, variant=variant, sync_interval=2, collective_timeout_s=timeout_s
    )
    client = DPEngineClient(replace(cfg, dp_port=free_port()), hold=True)
    log: list[str] = []
    streams: list[RequestStream] = []
    bg: list[threading.Thread] = []
    calls: list[threading.Thread] = []
    bg_err: list[str] = []
    trainer_box: list[SimpleBroadcastTrainer] = []
    try:
        client.start()
        # set up the transfer group with messages flowing freely
        client.set_hold(False)
        info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3}
        th = threading.Thread(
            target=lambda: trainer_box.append(SimpleBroadcastTrainer(info, timeout_s=timeout_s + 10))
        )
        th.start()
        client.init_weight_transfer_engine(info, timeout=timeout_s + 10)
        th.join(timeout_s + 10)
        trainer = trainer_box[0]
        client.set_hold(True)
        ws = random_weights(CausalLM(mcfg), 1)
        uinfo = SimpleBroadcastTrainer.update_info(ws)

        def background(fn: Any) -> None:
            def run() -> None:
                try:
                    fn()
                except Exception as exc:
                    bg_err.append(f"{type(exc).__name__}: {exc}")

            t = threading.Thread(target=run, daemon=True)
            t.start()
            bg.append(t)

        deadline = time.monotonic() + budget_s
        for step in steps:
            if client.failures:
                break
            op = step[0]
            if op == "add":
                streams.append(
                    client.add_request(
                        [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4), rank=step[1]
                    )
                )
                log.append(f"front-end sends a request to rank {step[1]}")
            elif op == "round":
                background(
                    lambda: update_round(
                        client, uinfo, lambda: trainer.send(ws), mode="abort", timeout=timeout_s * 3
                    )
                )
                log.append("controller starts pause(abort) -> start -> update || send -> finish -> resume")
            elif op == "call":
                method = step[1]
                if method == "pause":
                    background(lambda: client.pause("abort", timeout=timeout_s * 3))
                else:
                    background(lambda method=method: client.fan_out(method, timeout=timeout_s * 3))
                calls.append(bg[-1])
                log.append(f"controller calls {method}")
            elif op == "join":
                last = calls[-1] if calls else None
                if last is not None:
                    last.join(max(0.0, min(step_s * 3, deadline - time.monotonic())))
                ok = last is None or not last.is_alive()
                log.append("controller call returned" if ok else "join timed out")
            elif op == "stats":

                def synced() -> bool:
                    top = max(int(v.get("current_wave", 0)) for v in client.rank_vars)
                    return client.current_wave >= top and not client.engines_running

                try:
                    client.wait_for(synced, step_s, "coordinator stats")
                    log.append(f"front-end sees coordinator stats: wave {client.current_wave}, idle")
                except TimeoutError:
                    log.append("coordinator stats not in sync (skipped)")
            elif op == "send":
                background(lambda: trainer.send(ws))
                log.append("trainer starts trainer_send_weights")
            elif op == "call_rank":
                r, method = int(step[1]), str(step[2])
                kw: dict[str, Any] = {"update_info": uinfo} if method == "update_weights" else {}
                fut = client.call_rank(r, method, **kw)
                background(lambda fut=fut: fut.result(timeout_s * 3))
                calls.append(bg[-1])
                log.append(f"controller calls {method} on rank {r}")
            elif op == "release":
                r, sock = int(step[1]), str(step[2])

                def held(r: int = r, sock: str = sock) -> bool:
                    return client.has_held(r, sock)

                try:
                    client.wait_for(held, step_s, "held message")
                    msg = client.release(r, sock)
                    log.append(f"rank {r} receives {type(msg).__name__}{_brief(msg)} on {sock}")
                except TimeoutError:
                    log.append(f"nothing held for rank {r} on {sock} (skipped)")
            elif op == "await":
                r, ev = int(step[1]), str(step[2])

                def fired(r: int = r, ev: str = ev) -> bool:
                    return any(
                        t.rank == r and t.event == ev and (ev != "step" or bool(t.effects))
                        for t in client.transitions
                    )

                try:
                    client.wait_for(fired, step_s, f"rank {r} {ev}")
                    log.append(f"rank {r} fired {ev}")
                except TimeoutError:
                    log.append(f"rank {r} did not fire {ev} (skipped)")
        # let everything flow
        client.set_hold(False)
        client.release_all()
        log.append("all held messages released")
        end = time.monotonic() + min(budget_s, 3 * timeout_s + 10)
        while time.monotonic() < end:
            if client.failures:
                break
            client.release_all()
            if not any(t.is_alive() for t in bg) and all(s.done.is_set() for s in streams):
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
        elif not any(t.is_alive() for t in bg) and not bg_err and all(s.done.is_set() for s in streams):
            result = "completed"
        else:
            result = "not reproduced"
        if bg_err:
            errors[-1] = bg_err[0][:300]
        return ReproResult(variant, schedule, result, time.monotonic() - t0, [0, 1], collectives, errors, log)
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


def repro(variant: str, timeout_s: float = 4.0) -> list[ReproResult]:
    """``weightsync repro VARIANT``: the variant's own schedule, or every schedule for ``two-phase-epoch``.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in EXPECTED:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(EXPECTED)}")
    names = list(SCHEDULES) if variant not in SCHEDULES else [variant]
    return [run_schedule(variant, name, timeout_s=timeout_s) for name in names]


__all__ = ["EXPECTED", "SCHEDULES", "SOCKETS", "ReproResult", "repro", "run_schedule"]
