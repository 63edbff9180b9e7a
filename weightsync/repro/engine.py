"""Drive the reference DP engine (real processes, gloo) through a model counterexample (``weightsync repro``).

The schedule is compiled elsewhere (:mod:`weightsync.repro.schedule`, from the model's labels and the states its
successor function gives along them; ``weightsync.cli`` glues the two): one step per model step, each
naming the driver action and what must be observed after it. This module imports no model: a step is
anything with the attributes of :class:`ScheduleStep`.

The cluster is a :class:`~weightsync.impl.engine.client.DPEngineClient` with ``hold=True``: every message
bound for an engine (front-end ADD, controller calls, the coordinator's START_DP_WAVE) and for the
coordinator (FIRST_REQ, a rank's wave_complete / start_wave) is held in the client until the schedule
releases it, the coordinator's stats reach the front-end only at a ``refresh``, and each engine takes an
acting step only with a permit (its step gate). So every rank event happens when the schedule says:

==================  ====================================================================================
step kind           driver action
==================  ====================================================================================
``add``             ``add_request(..., rank=i)`` (its ADD held; FIRST_REQ held if the front-end believes
                    the engines idle)
``call``            the controller's next call (after the previous one returned), held per rank; the
                    trainer's send with ``update_weights``
``fe``              the front-end's pause/resume (front-end-pause), its per-rank calls released at once
``release``         the oldest held message on (rank, channel), which must be the model's message
``step``            one step permit for the rank
``observe``         nothing: a collective completes on its own once every member entered it
``coord``           the oldest held message to the coordinator (which must be the model's); its stats
                    must be the model's coordinator
``refresh``         the front-end adopts the coordinator's stats (must equal the model's belief)
==================  ====================================================================================

**The oracle.** A step is *followed* when, within ``step_s``: each table row it fires shows up as the
rank's next acting transition with the same event and guard and the same variables after it (every
field of ``RankVars``); a rank the step moves further (a worker's outcome) reaches the model's variables;
and every channel's held messages start with the model's (a rank may already have emitted the message of
a collective that completes on its own). The first step that is not followed is ``diverged_at`` and ends
the schedule.

- Buggy variant: ``"reproduced"`` only when every step was followed (``diverged_at`` null), the held
  messages are exactly the model's final channels, and, after letting every message flow and every rank
  step freely, each rank ends where the model's final state has it (:func:`end_check`): a rank the model
  has blocked in collective K has K as its last transition's collective and leaves it only by K's timeout
  (an engine failure, or a weight-transfer timeout taken by the table's failure row); a rank the model
  has outside any collective fails not and takes no further acting transition; every rank has the model's
  final variables. The trainer likewise (blocked: its send times out or never returns). Anything else is
  ``"not reproduced"`` (or ``"diverged"``), with every difference in ``reason``.
- Fixed variant: the schedule is the buggy one compiled on the fix's model up to the step the fix makes
  impossible (``impossible_step``), then that step on the buggy model's terms. ``"completed"`` when the
  steps before it were followed, that step did not happen either (no record, no returned call within
  ``step_s``), and, after letting everything flow and the controller finish its cycle, every request
  finished, no rank failed and every rank is outside any collective. ``fix_rows`` (passed in) names the
  fix's rows that made the step impossible.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from weightsync.impl.engine.client import DPEngineClient, free_port
from weightsync.impl.engine.config import EngineConfig, tiny_config
from weightsync.repro.driver import (
    TIMEOUT,
    ModelEnd,
    ScheduleDriver,
    ScheduleStep,
)
from weightsync.repro.oracles import QUEUE_PROPERTIES, end_check, reproduce_queued, undrained_at_pause

#: The variants the reference engine runs, and the verdict ``weightsync repro`` expects of each.
EXPECTED: dict[str, str] = {
    "front-end-pause": "reproduced",
    "idle-fast-path": "reproduced",
    "ignore-wave": "reproduced",
    "two-phase": "reproduced",
    "two-phase-epoch": "completed",
}
BUGGY = tuple(v for v, r in EXPECTED.items() if r == "reproduced")
#: The engine core every repro rank runs: acting steps wait at a gate the driver opens.
GATED_CORE = "weightsync.repro.gated:GatedEngineCore"


@dataclass
class ReproResult:
    """The JSON of ``weightsync repro VARIANT``, for both engines (this module's and
    :mod:`weightsync.repro.vllm.run`).

    Attributes:
        variant: the variant the engines run.
        engine: ``"reference"`` or ``"vllm"``.
        fix: the fix the engines run (reference: the fixed variant, or None for a buggy one; vLLM: the
            patch, ``"epoch"``, or ``"none"``: the plugin's default fix turned off, vLLM as shipped).
        schedule: the variant whose model counterexample was driven.
        result: ``"reproduced"``, ``"completed"``, ``"not reproduced"`` or ``"diverged"``.
        followed_steps: steps followed (see the module docstring).
        diverged_at: the first step not followed (1-based), or None.
        ranks: where each rank ended: the collective it was blocked in ("" outside any).
        expected_ranks: the same, as the model's final state has it (buggy variants).
        trainer: where the trainer ended ("" when not in a collective); expected_trainer: the model's.
        seconds: wall time of the run.
        mode: pause mode.
        property: the property the counterexample violates.
        reason: why the verdict.
        steps: one entry per step driven (``step``, ``label``, ``model`` text, ``followed``, ``why``).
        fix_rows, impossible_step: see :func:`weightsync.repro.schedule.fix_divergence`.
        requests_finished: request id -> tokens generated (-1: unfinished).
        timeout_s: the collective timeout.
        errors: rank (or ``trainer`` / ``controller``) -> its error.
        events: each rank's last acting transitions.
        belief_stale_s: (a ``front_end_belief`` counterexample on vLLM) seconds the front-end kept
            believing the engines running after the last step (None otherwise).
    """

    variant: str
    engine: str
    fix: str | None
    schedule: str
    result: str
    followed_steps: int = 0
    diverged_at: int | None = None
    ranks: dict[str, str] = field(default_factory=dict)
    expected_ranks: dict[str, str] = field(default_factory=dict)
    trainer: str = ""
    expected_trainer: str = ""
    seconds: float = 0.0
    mode: str = "keep"
    property: str = ""
    reason: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    fix_rows: list[dict[str, Any]] = field(default_factory=list)
    impossible_step: int | None = None
    requests_finished: dict[str, int] = field(default_factory=dict)
    timeout_s: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)
    events: dict[str, list[str]] = field(default_factory=dict)
    belief_stale_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)


@dataclass
class Plan:
    """What to drive and what the model says of it (from :mod:`weightsync.repro.schedule`, glued by the CLI).

    Attributes:
        schedule: the variant whose counterexample ``steps`` is (reported).
        steps: the compiled steps (``compile_schedule`` / ``fix_schedule`` with ``engine="reference"``).
        end: the model's final state (a buggy variant; None for a fix, whose run must complete).
        fix_rows, impossible_step: the fix's divergence (:func:`weightsync.repro.schedule.fix_divergence`); with
            ``impossible_step`` the last step is that one and must not happen.
        prop: the property the counterexample violates (reported).
    """

    schedule: str
    steps: Sequence[ScheduleStep]
    end: ModelEnd | None = None
    fix_rows: Sequence[Mapping[str, Any]] = ()
    impossible_step: int | None = None
    prop: str = ""


def run_schedule(
    variant: str,
    plan: Plan | Callable[[], Plan],
    *,
    mode: str = "keep",
    clear_cache: bool = True,
    tokens: int = 2,
    sync_interval: int = 2,
    timeout_s: float = 5.0,
    step_s: float = 5.0,
    budget_s: float = 60.0,
    start_timeout_s: float = 150.0,
    log: Callable[[str], None] | None = None,
) -> ReproResult:
    """Drive 2 DP ranks of ``variant`` through ``plan``'s steps and judge the run (see the module docstring).

    Args:
        variant: the variant the engines run.
        plan: the :class:`Plan`, or a function computing it (the model's exploration), called in a thread
            while the engines start.
        mode, clear_cache: the controller's pause arguments (the model's).
        tokens: tokens each request generates (the model's ``Bounds.tokens``).
        sync_interval: the DP sync interval K (the model's).
        timeout_s: collective timeout of every DP collective and transfer, seconds.
        step_s: how long a step's observations may take, seconds.
        budget_s: deadline of the schedule and its end, after startup, seconds.
        start_timeout_s: how long the engines may take to start, seconds.
        log: progress lines.

    Raises:
        ValueError: ``variant`` is not one the reference engine runs, or a buggy variant's plan without
            ``end``, or a step of an unknown kind.
        TransferTimeoutError: the engines did not start within ``start_timeout_s``, or the transfer group
            did not form within the collective timeout.
        PeerFailedError: an engine failed while starting.
        RuntimeError: the trainer did not join the transfer group.
        Whatever ``plan()`` raises.
    """
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.impl.engine.weights import random_weights, update_info_for
    from weightsync.impl.models.causal_lm import CausalLM
    from weightsync.impl.transfer.broadcast import BroadcastTrainer

    if variant not in EXPECTED:
        raise ValueError(f"unknown variant {variant!r}; the reference engine runs {', '.join(EXPECTED)}")
    fixed = EXPECTED[variant] == "completed"
    say = log or (lambda _m: None)
    t0 = time.monotonic()
    res = ReproResult(variant, "reference", variant if fixed else None, "", "not reproduced", mode=mode)
    res.timeout_s = timeout_s
    mcfg = tiny_config()
    cfg = EngineConfig(
        dp_size=2, model=mcfg, variant=variant, sync_interval=sync_interval, collective_timeout_s=timeout_s
    )
    client = DPEngineClient(
        replace(cfg, dp_port=free_port(), core=cfg.core or GATED_CORE),
        hold=True,
        start_timeout_s=start_timeout_s,
    )
    trainer_box: list[BroadcastTrainer] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-repro-plan")
    planned = pool.submit(plan) if callable(plan) else None
    try:
        client.start()
        client.set_hold(False)  # set up the transfer group with messages flowing freely
        info: dict[str, Any] = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 3,
            "timeout_s": timeout_s,
            "group_backend": "gloo",  # the engines' weights live on the CPU
        }
        # the trainer (rank 0, hosting the store) outlives the engines' deadline, as a real one would
        tinfo = dict(info, timeout_s=timeout_s + 5)
        th = threading.Thread(target=lambda: trainer_box.append(BroadcastTrainer(tinfo)), daemon=True)
        th.start()
        client.init_weight_transfer_engine(info, timeout=timeout_s + 10)
        th.join(timeout_s + 10)
        if not trainer_box:
            raise RuntimeError("the trainer did not join the transfer group")
        trainer = trainer_box[0]
        ws = random_weights(CausalLM(mcfg), 1)
        p = planned.result() if planned is not None else plan
        assert isinstance(p, Plan)
        if not fixed and p.end is None:
            raise ValueError(f"{variant}: a buggy variant's run needs the model's final state (Plan.end)")
        res.schedule, res.property = p.schedule, p.prop
        res.fix_rows, res.impossible_step = [dict(r) for r in p.fix_rows], p.impossible_step
        if p.end is not None:
            res.expected_ranks = {str(r): k for r, k in sorted(p.end.blocked.items())}
            res.expected_trainer = p.end.trainer
        # the coordinator's first stats (published when it starts) must be in before the schedule: one that
        # came late would pass for the acknowledgement of the first message a ``coord`` step releases
        client.wait_for(lambda: client.coord_acks >= 1, start_timeout_s, "the coordinator's first stats")
        with client._lock:  # the schedule starts from quiet engines and a front-end in sync
            client.set_hold(True)
        run = ScheduleDriver(
            client,
            mode,
            clear_cache,
            tokens,
            update_info_for(ws),
            lambda: trainer.send(ws),
            timeout_s,
            step_s,
            time.monotonic() + budget_s,
            say,
        )
        say(f"engines up ({variant}); driving the {p.schedule} schedule ({len(p.steps)} steps)")
        _drive(run, p.steps, res, p.impossible_step)
        if fixed:
            _complete(run, res, p.impossible_step)
        else:
            assert p.end is not None
            _reproduce(run, res, p.end)
        res.errors.update({k: v for k, v in run.errors.items() if k not in res.errors})
        for r, f in sorted(client.failures.items()):  # a diverged run too: a rank that failed says why
            res.errors.setdefault(str(r), f"{f.phase}: {f.error.splitlines()[0][:300]}")
        res.events = run.events()
        return res
    finally:
        pool.shutdown(wait=True)
        for tr in trainer_box:
            tr.close()
        client.shutdown(timeout_s=2.0)  # then terminated: a rank may still sit in a failed collective
        res.seconds = round(time.monotonic() - t0, 3)


def _drive(
    run: ScheduleDriver, steps: Sequence[ScheduleStep], res: ReproResult, impossible: int | None
) -> None:
    entry: dict[str, Any]
    for a in steps:
        if time.monotonic() > run.deadline:
            why = "the run's deadline passed"
        elif a.step == impossible:
            happened = run.impossible(a)
            entry = {"step": a.step, "label": a.label, "model": a.text, "followed": False}
            if happened:
                entry["why"] = f"the fix's model has no such step, but {happened}"
                res.reason = entry["why"]
            else:
                entry["why"] = "impossible under the fix: it did not happen"
            res.steps.append(entry)
            res.diverged_at = a.step
            run.say(f"step {a.step}: {entry['why']}  [{a.text}]")
            return
        else:
            why = run.do(a)
        entry = {"step": a.step, "label": a.label, "model": a.text, "followed": not why}
        if why:
            entry["why"] = why
        res.steps.append(entry)
        run.say(f"step {a.step}: {'ok' if not why else 'DIVERGED: ' + why}  [{a.text}]")
        if why:
            res.diverged_at = a.step
            res.reason = why
            return
        res.followed_steps += 1


def _reproduce(run: ScheduleDriver, res: ReproResult, end: ModelEnd) -> None:
    c = run.c
    if res.diverged_at is not None:
        res.result = "diverged"
        res.ranks = {
            str(r): str(rr[-1].after.get("collective", "")) if rr else "" for r, rr in run.records().items()
        }
        return
    why = run.expect_channels(end.channels, exact=True)
    if why:
        res.reason = f"after the last step the held messages are not the model's final channels: {why}"
        return
    recs = run.records()
    after = {r: len(run.consumed[r]) for r in recs}
    extra = {
        r: [f"{t.event} [{t.guard}]" for t in rr[after[r] :]] for r, rr in recs.items() if rr[after[r] :]
    }
    if extra:
        res.reason = f"after the last step the ranks took transitions the model has not: {extra}"
        return
    if res.property in QUEUE_PROPERTIES:
        reproduce_queued(run, res, end)
        return
    run.say("every step followed; every message flows and every rank steps freely from here")
    run.flow()
    blocked = [r for r, k in end.blocked.items() if k]
    with contextlib.suppress(TimeoutError):  # the model's blocked ranks stay blocked until their timeout
        c.wait_for(
            lambda: all(r in c.failures or run._peek(r) is not None for r in blocked),
            run.left(2 * run.timeout_s + 5),
            "the blocked ranks' timeouts",
        )
    time.sleep(min(1.0, run.step_s))  # a rank the model has outside any collective: give it time to move
    ranks, bad = end_check(run.records(), after, dict(c.failures), end, run.start_vars)
    res.ranks = ranks
    for r, f in sorted(c.failures.items()):
        res.errors[str(r)] = f"{f.phase}: {f.error.splitlines()[0][:300]}"
    for r, rr in run.records().items():
        err = str(rr[after[r]].args.get("error", "")) if len(rr) > after[r] else ""
        if err and str(r) not in res.errors:
            res.errors[str(r)] = f"{rr[after[r]].event}: {err.splitlines()[0][:300]}"
    tr = run.trainer
    timed_out = run.errors.get("trainer", "").startswith(TIMEOUT)
    res.trainer = "weight_broadcast" if tr is not None and (tr.is_alive() or timed_out) else ""
    if res.trainer != end.trainer:
        bad.append(
            f"the trainer ended in {res.trainer or 'no collective'}, the model's in {end.trainer or 'none'}"
        )
    if bad:
        res.reason = "; ".join(bad)
        return
    res.result = "reproduced"
    res.reason = "every model step followed; " + "; ".join(
        f"rank {r} blocked in {k} until the {run.timeout_s:g} s collective timeout"
        if k
        else f"rank {r} outside any collective"
        for r, k in sorted(end.blocked.items())
    )


def _complete(run: ScheduleDriver, res: ReproResult, impossible: int | None) -> None:
    c = run.c
    if res.diverged_at is not None and res.diverged_at != impossible:
        res.result = "diverged"
        return
    if res.reason:  # the impossible step happened
        return
    if res.property in QUEUE_PROPERTIES and (why := undrained_at_pause(run)):
        res.reason = why
        return
    run.say("every message flows and every rank steps freely from here")
    run.flow()
    run.finish_cycle()

    def done() -> bool:
        calls = [t for t in (run.cycle, run.call, run.trainer) if t is not None]
        return bool(c.failures) or (
            all(not t.is_alive() for t in calls) and all(s.done.is_set() for s in run.streams)
        )

    with contextlib.suppress(TimeoutError):
        c.wait_for(done, run.left(3 * run.timeout_s + 10), "the cycle and every request")
    time.sleep(0.3)  # the last wave ends
    res.requests_finished = {
        s.req_id: len(s.tokens) if s.done.is_set() and s.finish_reason == "length" else -1
        for s in run.streams
    }
    recs = run.records()
    res.ranks = {str(r): str(rr[-1].after.get("collective", "")) if rr else "" for r, rr in recs.items()}
    for r, f in sorted(c.failures.items()):
        res.errors[str(r)] = f"{f.phase}: {f.error.splitlines()[0][:300]}"
    bad = [k for k in ("controller", "trainer") if k in run.errors]
    unfinished = [k for k, v in res.requests_finished.items() if v < 0]
    busy = [r for r, k in res.ranks.items() if k]
    if c.failures or bad or unfinished or busy:
        res.reason = (
            f"after the schedule: failures {sorted(c.failures)}, errors in {bad}, unfinished requests {unfinished}, "
            f"ranks still in a collective {busy}"
        )
        return
    res.result = "completed"
    rows = sorted({str(r["fix_row"]) for r in res.fix_rows if r.get("fix_row")})
    made = f"rows {', '.join(rows)}" if rows else "no row of it fired differently before: it has no such edge"
    where = (
        f"step {impossible} is impossible under the fix ({made})"
        if impossible is not None
        else "the fix's model follows every step"
    )
    drained = (
        "the pause returned with every request added before it finished; "
        if res.property in QUEUE_PROPERTIES
        else ""
    )
    res.reason = (
        f"{where}; {drained}after letting everything flow, every request finished ({len(run.streams)})"
    )


__all__ = ["BUGGY", "EXPECTED", "Plan", "ReproResult", "end_check", "run_schedule"]
