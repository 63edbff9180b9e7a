"""The resume-time race on a real vLLM 0.32 DP deployment (``weightsync repro vllm-0.32 --engine vllm``).

A tiny Mixtral (MoE, so the DP ranks run in lockstep: ``DPEngineCoreProc``, ``v1/engine/core.py:1473-1478``)
is served by a real ``AsyncLLM(data_parallel_size=2)`` on CPU, with vLLM's own coordinator. The model's
shortest counterexample for the variant (``weightsync check --variant vllm-0.32 --ranks 2``, one pause
mode) is compiled from its **labels and states** (the model's successor function replayed along the
labels, :func:`weightsync.model.check.replay_labels`; no step text is parsed) into driver actions, one per
model step, each followed by the observation that must appear:

==============================  ==========================================================================
model label                      driver action; observation that must follow
==============================  ==========================================================================
``send i``                       ``AsyncLLM.generate(..., data_parallel_rank=i)``; its ADD and (front-end
                                 believing the engines idle) its FIRST_REQ are held in the driver
``fan CALL -1``                  ``pause_generation(mode=...)`` / ``resume_generation()`` started; one
                                 utility message per rank held in the driver
``recv i f`` (ADD / call)        the oldest held message of that kind for rank i is sent; rank i records it
``recv i f`` (START_DP_WAVE)     utility ``weightsync_release`` to rank i; rank i records the wave
``step i``                       rank i records a forward (``has_work``, and whether it syncs)
``done K``                       every rank records the collective's completion
``coord i f`` / ``coord -1 f``   rank i's wave_complete / start_wave is already out: the coordinator's
                                 published belief reaches the front-end; FIRST_REQ: released, and the
                                 coordinator's START_DP_WAVE arrives (held) at the ranks it broadcast to
``refresh``                      the front-end's belief (``current_wave``, ``engines_running``) is the
                                 model's
==============================  ==========================================================================

Holding points (vLLM 0.32): the driver's per-rank input messages
(``AsyncMPClient._send_input_message``, ``core_client.py:1250``) and the front-end's FIRST_REQ
(``DPAsyncMPClient.add_request_async``, ``core_client.py:1592``); the engines' coordinator input through the
plugin's probe (:mod:`weightsync.vllm_tools.probe`, ``WEIGHTSYNC_VLLM_HOLD=START_DP_WAVE``). Every observation is
a record of the probe in vLLM's engine process: vLLM's own variables right after (or, for a forward or a
resume, right before) the event, compared field by field (:data:`COMPARED`) with the model's rank
variables after (before) the step.

Verdicts: ``"reproduced"`` when every step was followed (``diverged_at`` null), the ranks ended where the
model's final state has them (a rank inside a DP collective, its peers idle) and that rank's collective
raised the group's timeout (``distributed_timeout_seconds``, shortened) while no peer had entered a step.
``"completed"`` (with ``--fix epoch``: the fix installed in the engines, :mod:`weightsync.vllm_tools.fix`) when the
engines followed the fix's model (``vllm-0.32-epoch``) up to the step the fix makes impossible, that step
did not happen on the real engines either, the table rows that differ are named, and after releasing every
held message every request finished. Anything else: ``"diverged"`` or ``"not reproduced"``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.model.check import build_model
from weightsync.model.labels import replay_labels
from weightsync.model.system import Model
from weightsync.repro.engine import ReproResult
from weightsync.repro.fixed import FIX_VARIANT, fix_divergence, fix_schedule
from weightsync.repro.schedule import (
    CALL_METHOD,
    COMPARED,
    Action,
    compile_schedule,
    model_counterexample,
)
from weightsync.repro.vllm.belief import BELIEF_PROPERTIES, _after_a_publish, _finish_belief
from weightsync.repro.vllm.driver import (
    _blocked,
    _brief,
    _Driver,
    _idle,
    _line,
    _Observer,
    _state,
    _until,
    record_end,
)
from weightsync.repro.vllm.queued import QUEUED_PROPERTIES, finish_queued
from weightsync.vllm_tools.fix import OFF
from weightsync.vllm_tools.serving import LoopThread, shutdown_async_llm, start_async_llm

# --------------------------------------------------------------------------------------------- the driver


def run_vllm_repro(
    variant: str = "vllm-0.32",
    fix: str | None = None,
    mode: str = "keep",
    timeout_s: int = 30,
    step_s: float = 20.0,
    workdir: str | None = None,
    log: Callable[[str], None] | None = None,
    of: str | None = None,
) -> ReproResult:
    """Drive a real ``AsyncLLM(data_parallel_size=2)`` of a tiny Mixtral through the model's shortest
    counterexample of ``variant`` in ``mode`` (see the module docstring). ``timeout_s``: the DP group's
    collective timeout (seconds; vLLM's ``distributed_timeout_seconds`` and
    ``cpu_distributed_timeout_seconds``); ``step_s``: how long each observation may take; ``of``: drive
    the counterexample of this property (:data:`BELIEF_PROPERTIES` or None: the most specific one).

    Raises:
        ValueError: ``fix`` is not a known fix, ``variant`` is not a vLLM 0.32 variant, or ``of`` is a
            property whose end state this driver cannot observe (with ``fix``: any ``of``).
        RuntimeError: the model has no counterexample for ``variant`` (nothing to drive).
    """
    if variant != "vllm-0.32":
        raise ValueError(
            f"--engine vllm drives vLLM 0.32 as shipped: variant must be vllm-0.32, got {variant!r}"
        )
    if fix is not None and fix not in FIX_VARIANT:
        raise ValueError(f"--fix {fix!r}: the fixes are {', '.join(FIX_VARIANT)}")
    if of is not None and (of not in DRIVEN_PROPERTIES or fix is not None):
        raise ValueError(
            f"--property {of!r}: the vLLM driver observes the end states of {', '.join(DRIVEN_PROPERTIES)} "
            "(as shipped; the fix's tests are the patch series' own) and, by default, of a one-sided collective"
        )
    say = log or (lambda _m: None)
    t0 = time.monotonic()
    cx = model_counterexample(variant, mode, of)
    labels = [list(x) for x in cx["labels"]]
    buggy = build_model(variant, 2, mode)
    target = build_model(FIX_VARIANT[fix], 2, mode) if fix else buggy
    texts = list(cx.get("steps", []))
    if fix:  # the fix's model up to the step it makes impossible, then that step on the buggy model's terms
        actions, div = fix_schedule(buggy, target, labels, texts)
    else:
        actions, div = compile_schedule(buggy, labels, texts), {"impossible_step": None, "fix_rows": []}
    impossible = div["impossible_step"]
    res = ReproResult(
        variant, "vllm", fix or OFF, variant, "not reproduced", mode=mode, property=str(cx["property"])
    )
    res.timeout_s = timeout_s
    res.fix_rows = list(div["fix_rows"])
    res.impossible_step = impossible
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-repro-") as tmp:
        work = Path(workdir or tmp)
        events = work / "events"
        gate = step_s if res.property in QUEUED_PROPERTIES else 0.0
        served = _serve(work, events, fix, timeout_s, say, gate)
        try:
            _drive(served, actions, events, res, step_s, impossible, say)
            _finish(served, events, res, buggy, labels, impossible, timeout_s, step_s, say)
        finally:
            served.close()
    res.seconds = round(time.monotonic() - t0, 3)
    return res


class _Served:
    def __init__(self, llm: Any, loop: LoopThread) -> None:
        self.llm = llm
        self.lt = loop
        self.driver = _Driver(llm, loop)
        self.outputs: dict[str, Any] = {}

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the engines may be dead already (the hang's timeout)
            shutdown_async_llm(self.llm, self.lt)
        self.lt.close()


def _serve(
    work: Path,
    events: Path,
    fix: str | None,
    timeout_s: int,
    say: Callable[[str], None],
    add_waits_s: float = 0.0,
) -> _Served:
    from weightsync.vllm_tools import fix as fix_mod
    from weightsync.vllm_tools import probe
    from weightsync.vllm_tools.models import build_tiny_mixtral

    model_dir = work / "tiny-mixtral"
    build_tiny_mixtral(model_dir)
    os.environ[probe.ENV_EVENTS] = str(events)
    os.environ[probe.ENV_HOLD] = "START_DP_WAVE"
    if add_waits_s:  # the schedule's rank takes its ADD and the pause after it with no step between
        os.environ[probe.ENV_ADD_WAITS] = str(add_waits_s)
    if fix:
        fix_mod.patched_sources()  # fails here, with the reason, before any engine starts
        if fix == fix_mod.DEFAULT_FIX:  # the plugin installs it by default: the path a user's engines take
            os.environ.pop(fix_mod.ENV_FIX, None)
        else:
            os.environ[fix_mod.ENV_FIX] = fix
    else:  # vLLM as shipped: the plugin's default fix is turned off for this run
        os.environ[fix_mod.ENV_FIX] = fix_mod.OFF
        removed = fix_mod.uninstall()  # an earlier engine in this process may have grafted the front-end
        if removed:
            say(f"took out of this process the {len(removed)} attributes an earlier engine's plugin grafted")
        say(
            f"vLLM as shipped: the plugin's resume-epoch fix is off for this run ({fix_mod.ENV_FIX}={fix_mod.OFF})"
        )
    lt = LoopThread("vllm-repro-loop")
    try:
        llm, start_s = start_async_llm(
            lt,
            model_dir,
            dp=2,
            max_num_seqs=4,
            distributed_timeout_seconds=timeout_s,
            cpu_distributed_timeout_seconds=timeout_s,
        )
    finally:
        for k in (probe.ENV_EVENTS, probe.ENV_HOLD, probe.ENV_ADD_WAITS, fix_mod.ENV_FIX):
            os.environ.pop(k, None)
    say(f"AsyncLLM(data_parallel_size=2) of a tiny Mixtral up in {start_s:.1f} s")
    return _Served(llm, lt)


def _compare(a: Action, rank: int, rec: dict[str, Any]) -> str:
    want = a.model_vars.get(rank)
    if want is None:
        return ""
    got = {k: rec["vllm"][k] for k in COMPARED}
    bad = {k: (got[k], want[k]) for k in COMPARED if got[k] != want[k]}
    if not bad:
        return ""
    return ", ".join(f"{k}: vLLM {g}, model {w}" for k, (g, w) in bad.items())


def _drive(
    served: _Served,
    actions: list[Action],
    events: Path,
    res: ReproResult,
    step_s: float,
    impossible: int | None,
    say: Callable[[str], None],
) -> None:
    d = served.driver
    llm = served.llm
    obs = _Observer(events, 2)
    calls: list[Any] = []
    from vllm import SamplingParams

    for a in actions:
        why = ""
        if a.kind == "add":
            if res.property in BELIEF_PROPERTIES:  # the next periodic publish about 5 s away
                why = _after_a_publish(d, step_s)
            rid = f"req-{len(served.outputs)}"
            served.outputs[rid] = []
            before = len(d.first_req)

            async def gen(rid: str = rid, rank: int = a.rank) -> None:
                sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
                async for out in llm.generate(
                    {"prompt_token_ids": [1, 5, 6]}, sp, rid, data_parallel_rank=rank
                ):
                    served.outputs[rid].append(out)

            calls.append(d.spawn(gen()))
            want_first = before + int(a.arg["first_req"])
            ok = _until(functools.partial(_added, d, a.rank, want_first), step_s)
            why = why or (
                ""
                if ok
                else (
                    f"the ADD (and FIRST_REQ: {a.arg['first_req']}) did not reach the driver's hold "
                    f"(held: {sorted(d.held)}, FIRST_REQ {len(d.first_req)}, generate: {_state(calls[-1])})"
                )
            )
        elif a.kind == "call":
            method = CALL_METHOD[a.arg]
            coro = llm.pause_generation(mode=res.mode) if a.arg == "pause" else llm.resume_generation()
            calls.append(d.spawn(coro))
            ok = _until(functools.partial(_held_everywhere, d, method), step_s)
            why = "" if ok else f"{method} did not reach the driver's hold for every rank"
        elif a.kind == "send":
            d.release(a.rank, a.arg)
        elif a.kind == "release":
            try:
                d.utility(a.rank, "weightsync_release", timeout=step_s)
            except Exception as exc:
                why = f"weightsync_release on rank {a.rank}: {type(exc).__name__}: {exc}"
        elif a.kind == "coord" and a.arg == "FIRST_REQ":
            d.release_first_req()
        elif a.kind in ("coord", "refresh"):  # the coordinator's published belief, as the front-end holds it
            ok = _until(functools.partial(_front_end_at, d, a.coord), step_s)
            why = (
                ""
                if ok
                else (
                    f"the front-end's (current_wave, engines_running) is "
                    f"({d.client.current_wave}, {d.client.engines_running}), the model's coordinator {a.coord}"
                )
            )
        for rank, ev, fields in a.expect if not why else []:
            rec = obs.wait(rank, ev, fields, step_s)
            if rec is None:
                why = f"rank {rank} recorded no {ev} {fields} within {step_s:.0f} s"
            elif "unexpected" in rec:
                got = rec["unexpected"]
                why = f"rank {rank} recorded {got['ev']} {_brief(got)}, the model expects {ev} {fields}"
            else:
                why = _compare(a, rank, rec)
                if why:
                    why = f"rank {rank} after {ev}: {why}"
            if why:
                break
        entry = {"step": a.step, "label": a.label, "model": a.text, "followed": not why}
        if why:
            entry["why"] = why
        res.steps.append(entry)
        say(f"step {a.step}: {'ok' if not why else 'DIVERGED: ' + why}  [{a.text}]")
        if why:
            res.diverged_at = a.step
            res.reason = why
            return
        res.followed_steps += 1
    served.__dict__["calls"] = calls


#: the properties ``--property`` may name on vLLM as shipped (each with its own end-state oracle)
DRIVEN_PROPERTIES = BELIEF_PROPERTIES + QUEUED_PROPERTIES


def _added(d: _Driver, rank: int, first_reqs: int) -> bool:
    return d.count(rank, "ADD") >= 1 and len(d.first_req) >= first_reqs


def _held_everywhere(d: _Driver, method: str) -> bool:
    return all(d.count(r, method) >= 1 for r in range(2))


def _front_end_at(d: _Driver, coord: tuple[int, bool]) -> bool:
    return (int(d.client.current_wave), bool(d.client.engines_running)) == coord


def _finish(
    served: _Served,
    events: Path,
    res: ReproResult,
    buggy: Model,
    labels: list[Any],
    impossible: int | None,
    timeout_s: int,
    step_s: float,
    say: Callable[[str], None],
) -> None:
    from weightsync.vllm_tools.probe import read_events

    d = served.driver
    if res.fix == OFF and res.property in BELIEF_PROPERTIES:
        _finish_belief(served, events, res, buggy, labels, step_s)
        return
    if res.fix == OFF and res.property in QUEUED_PROPERTIES:
        finish_queued(served, events, res, step_s)
        return
    if res.fix == OFF:  # vLLM as shipped (the plugin's default fix turned off)
        states, _ = replay_labels(buggy, labels)
        final = states[-1]
        want = {str(i): final.ranks[i].blocked for i in range(buggy.n)}
        if res.diverged_at is None:  # wait for the group's timeout to end the one-sided collective
            _until(lambda: any(_blocked(r)[1] for r in read_events(events).values()), timeout_s + step_s)
        recs = read_events(events)
        got: dict[str, str] = {}
        for r, rr in recs.items():
            where, err = _blocked(rr)
            got[str(r)] = where
            if err is not None:
                res.errors[str(r)] = str(err.get("error", ""))
        res.ranks = got
        res.events = {str(r): [_line(x) for x in rr[-8:]] for r, rr in recs.items()}
        if res.diverged_at is not None:
            res.result = "diverged"
            return
        if got != want:
            res.reason = f"ranks ended in {got}, the model's final state has {want}"
            return
        stuck = [r for r, w in want.items() if w]
        timed_out = all(
            "timed out" in res.errors.get(r, "").lower() or "timeout" in res.errors.get(r, "").lower()
            for r in stuck
        )
        peers_idle = all(not got[r] for r in want if r not in stuck)
        if stuck and timed_out and peers_idle:
            res.result = "reproduced"
            res.reason = (
                f"rank(s) {', '.join(stuck)} in {', '.join(want[r] for r in stuck)} until the {timeout_s} s "
                "collective timeout; peers idle"
            )
        else:
            res.reason = f"stuck={stuck}, timeout errors={res.errors}, peers idle={peers_idle}"
        return
    # the fix: the impossible step must not have happened; then everything flows and finishes
    if res.diverged_at is None or res.diverged_at != impossible:
        res.result = "diverged" if res.diverged_at is not None else "not reproduced"
        if res.diverged_at is None:
            res.reason = f"the real engines took step {impossible}, which the fix's model makes impossible"
        res.ranks = {str(r): _blocked(rr)[0] for r, rr in read_events(events).items()}
        return
    say(f"step {impossible} did not happen (the fix's model has no such edge); releasing every held message")
    for r in range(2):  # the engines first: a START_DP_WAVE sent from now on is not held
        try:
            d.utility(r, "weightsync_release_all", timeout=step_s)
        except Exception as exc:
            res.errors[str(r)] = f"weightsync_release_all: {type(exc).__name__}: {exc}"
    d.release_everything()
    for fut in served.__dict__.get("calls", []):
        try:
            fut.result(step_s * 3)
        except Exception as exc:
            res.errors["driver"] = f"{type(exc).__name__}: {exc}"
    # one more request per rank after the cycle: the engines serve normally
    from vllm import SamplingParams

    async def one(rid: str, rank: int) -> None:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        served.outputs[rid] = []
        async for out in served.llm.generate(
            {"prompt_token_ids": [1, 7, 8]}, sp, rid, data_parallel_rank=rank
        ):
            served.outputs[rid].append(out)

    for r in range(2):
        try:
            d.run(one(f"after-{r}", r), step_s * 3)
        except Exception as exc:
            res.errors[f"after-{r}"] = f"{type(exc).__name__}: {exc}"
    # the wave ends (the ranks' next sync finds no work) and every rank goes idle
    _until(lambda: all(_idle(rr) for rr in read_events(events).values()), step_s * 3)
    fin = record_end(served, events, res)
    recs = read_events(events)
    if all(v > 0 for v in fin.values()) and not res.errors and all(_idle(rr) for rr in recs.values()):
        res.result = "completed"
        res.reason = (
            f"step {impossible} is impossible under the fix ({res.fix_rows[0]['fix_row'] if res.fix_rows else ''}); "
            "after releasing every held message every request finished"
        )
    else:
        res.reason = f"requests {fin}, errors {res.errors}, ranks {res.ranks}"


__all__ = [
    "BELIEF_PROPERTIES",
    "COMPARED",
    "DRIVEN_PROPERTIES",
    "Action",
    "ReproResult",
    "compile_schedule",
    "fix_divergence",
    "run_vllm_repro",
]
