"""Protocol traces from real vLLM 0.32 engines, for ``weightsync replay --variant vllm-0.32``.

:func:`to_replay_trace` turns the probe's per-engine logs (:mod:`weightsync.vllm_tools.probe`: what each
``DPEngineCoreProc`` saw and did, with vLLM's own variables) into the replay format of
:func:`weightsync.impl.checked.replay_trace`: one table event per line, the engines' lines merged by their
``time.monotonic()`` stamps (one clock per host; a collective's completion is stamped after every member's
entry, so the merge keeps every member's entry before any completion). The table is **not** consulted
here: each line is what the engine did, and replay checks it against the table and the model's
composition:

=======================  ========================================================================
probe record             trace line(s)
=======================  ========================================================================
``ADD``                  ``ADD`` (``wave``: the request's stamped wave)
``ABORT``                ``ABORT``
``START_DP_WAVE``        ``START_DP_WAVE`` (``wave``; ``exclude``: the coordinator's target engine,
                         or -1 when it is no int: vLLM 0.32's front-end sends a bytes identity that
                         never equals the engine's int index, ``core.py:2288``; ``held`` lines skipped)
``pause``                ``pause`` (``mode``, ``clear_cache``, ``running``)
``resume``               ``resume``; when it entered the barrier, ``collective`` ``resume_barrier``
``resume_done``          ``resume_barrier_done`` (``max_unfinished``: MAX of the members'
                         barrier inputs ``has_unfinished``; ``max_wave``: MAX of their waves at entry)
``step``                 ``step`` (``has_work``), ``collective`` ``dp_sync`` or ``dp_step``
``step_done``            ``dp_sync_done`` (``sum_unfinished``, ``sum_pending_pause``: SUMs of the
                         members' real inputs) or ``dp_step_done``; ``has_work``: the scheduler's
                         schedulable work (:func:`~weightsync.spec.states.schedulable`) after it
``rpc`` (a weight call)  the call's event, then ``transfer_init_done`` / ``weight_broadcast_done`` /
                         ``finish_done`` (or ``transfer_failed`` when it raised)
=======================  ========================================================================

Every line carries ``t`` (the engine record's stamp) and ``observed`` (or, for ``step`` and ``resume``, recorded on entry, ``observed_before``):
vLLM's ``engines_running``, ``current_wave``, ``pending_pause``, ``ignore_start_dp_wave`` and
``pause_state``, which replay compares with the table's variables field by field, and the scheduler's
``waiting`` / ``running`` counts. The header's ``sync_interval`` is the engines' ``dp_sync_interval``.

:func:`record_cycles` runs the traffic: a real ``AsyncLLM(data_parallel_size=2)`` of a tiny Mixtral with
weightsync's backend, and N controller cycles (pause in a random mode, a weight round from the trainer,
resume) with random requests on random DP ranks, some in flight across the pause.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.impl.engine.tracing import jsonable
from weightsync.spec.calls import (
    CALL_EVENT,
    PHASE_CALL,
    TRAINER_COLLECTIVE,
    WORKER_OUTCOME,
    call_args,
    worker_outcome,
)
from weightsync.spec.collectives import (
    CALL_FAIL_PHASE,
    COLLECTIVES,
    DONE_EVENT,
    done_args,
    outcome_args,
    reduce_values,
)
from weightsync.spec.states import Collective, PauseMode, PauseState, RankEvent, schedulable

#: vLLM's variables that the table has under the same name (compared by replay)
OBSERVED = ("engines_running", "current_wave", "pending_pause", "ignore_start_dp_wave", "pause_state")
#: weight-transfer call (those with a ``transfer_failed`` phase) -> the event that follows on success: the
#: completion of the transfer collective the call enters with the trainer (spec TRAINER_COLLECTIVE), the
#: workers' outcome ``finish_done`` for the finish, none for the start
_DONE_OF_CALL: dict[str, RankEvent | None] = {
    call: DONE_EVENT[str(TRAINER_COLLECTIVE[p].value)] if p in TRAINER_COLLECTIVE else None
    for p, call in PHASE_CALL.items()
    if CALL_EVENT[call] in CALL_FAIL_PHASE
}
_DONE_OF_CALL.update({call: WORKER_OUTCOME[call][0] for call in _DONE_OF_CALL if call in WORKER_OUTCOME})
WEIGHT_CALLS: dict[str, tuple[RankEvent, RankEvent | None]] = {
    call: (CALL_EVENT[call], done) for call, done in _DONE_OF_CALL.items()
}
#: the ``phase`` of ``transfer_failed`` for each weight call (spec/collectives.py)
PHASE = {call: CALL_FAIL_PHASE[CALL_EVENT[call]] for call in WEIGHT_CALLS}


def _logged(entry: list[Any], name: str) -> int:
    """Contribution ``name`` (spec/collectives.py's names) of one member to a DP collective, as vLLM logged
    it: the wave from the entry record, the flags (bools) from the completion record."""
    _, enter, done = entry
    return int(enter["vllm"]["current_wave"]) if name == "current_wave" else int(bool(done[name]))


def _obs(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec["vllm"][k] for k in OBSERVED}


def _exclude(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else -1


def to_replay_trace(
    events: dict[int, list[dict[str, Any]]], out: str | Path, variant: str = "vllm-0.32"
) -> dict[str, Any]:
    """Write the replay trace of the probe logs ``events`` (by DP rank) to ``out``; returns
    ``{"path", "lines", "ranks", "sync_interval", "collectives"}``.

    Raises:
        ValueError: no engine log, the ranks are not 0..N-1, or the ranks' DP collectives do not pair up
            (a rank entered a collective its peers never entered: the trace cannot say who to pair with).
    """
    ranks = sorted(events)
    if not ranks or ranks != list(range(len(ranks))):
        raise ValueError(f"engine logs for ranks {ranks}: need 0..N-1")
    n = len(ranks)
    intervals = {int(r["dp_sync_interval"]) for rr in events.values() for r in rr if r["ev"] == "step"}
    if len(intervals) > 1:
        raise ValueError(f"the engines report different dp_sync_interval values {sorted(intervals)}")
    k = intervals.pop() if intervals else 16
    # each rank's DP collectives in order: (kind, entry record, completion record or None)
    colls: dict[int, list[list[Any]]] = {r: [] for r in ranks}
    for r in ranks:
        for rec in events[r]:
            if rec["ev"] == "step":
                colls[r].append(["dp_sync" if rec["sync"] else "dp_step", rec, None])
            elif rec["ev"] == "resume":
                colls[r].append(["resume_barrier?", rec, None])
            elif rec["ev"] == "resume_done":
                open_ = colls[r][-1] if colls[r] else None
                if open_ is None or open_[0] != "resume_barrier?":
                    raise ValueError(f"rank {r}: resume_done without a resume")
                if rec["barrier"]:
                    open_[0], open_[2] = "resume_barrier", rec
                else:
                    colls[r].pop()
            elif rec["ev"] == "step_done":
                open_ = colls[r][-1] if colls[r] else None
                if open_ is None or open_[0] not in ("dp_sync", "dp_step") or open_[2] is not None:
                    raise ValueError(f"rank {r}: step_done without a step")
                open_[2] = rec
        colls[r] = [c for c in colls[r] if c[0] != "resume_barrier?"]
    m = min(len(c) for c in colls.values())
    outcome: dict[tuple[int, int], dict[str, Any]] = {}  # (rank, seq) -> completion args
    for seq in range(m):
        kinds = {colls[r][seq][0] for r in ranks}
        if len(kinds) > 1:
            raise ValueError(f"DP collective #{seq}: the ranks entered {sorted(kinds)} (not matched)")
        kind = kinds.pop()
        # each member's contribution as vLLM logged it, reduced by the spec (spec/collectives.py)
        names = COLLECTIVES[Collective(kind)].contributes
        contribs: list[tuple[int, ...]] | None = None
        if names and all(colls[r][seq][2] is not None for r in ranks):
            contribs = [tuple(_logged(colls[r][seq], n) for n in names) for r in ranks]
        args: dict[str, Any] = (
            {} if contribs is None else dict(outcome_args(kind, reduce_values(kind, contribs)))
        )
        for r in ranks:
            outcome[(r, seq)] = args
    seq_of = {id(c[1]): (r, s) for r in ranks for s, c in enumerate(colls[r])}
    seq_of.update({id(c[2]): (r, s) for r in ranks for s, c in enumerate(colls[r]) if c[2] is not None})
    lines: list[tuple[float, int, dict[str, Any]]] = []
    order = 0

    def emit(t: float, line: dict[str, Any]) -> None:
        nonlocal order
        lines.append((t, order, line))
        order += 1

    for r in ranks:
        for rec in events[r]:
            ev = rec["ev"]
            counts = {"waiting": rec["vllm"]["waiting"], "running": rec["vllm"]["running"]}
            t = float(rec["t"])
            base = {"rank": r, "t": t, **counts}
            if ev == "step_error":
                break
            if ev == "ADD":
                emit(t, {**base, "event": "ADD", "args": {"wave": rec["wave"]}, "observed": _obs(rec)})
            elif ev == "ABORT":
                emit(t, {**base, "event": "ABORT", "args": {}, "observed": _obs(rec)})
            elif ev == "START_DP_WAVE" and not rec["held"]:
                args = {"wave": rec["wave"], "exclude": _exclude(rec["exclude"])}
                emit(t, {**base, "event": "START_DP_WAVE", "args": args, "observed": _obs(rec)})
            elif ev == "pause":
                kw = {"mode": rec["mode"], "clear_cache": rec["clear_cache"]}
                args = {
                    k: jsonable(v)
                    for k, v in call_args(RankEvent.PAUSE, kw, rec["running"], rec["waiting"]).items()
                }
                emit(t, {**base, "event": RankEvent.PAUSE.value, "args": args, "observed": _obs(rec)})
            elif ev in ("resume", "step"):
                line: dict[str, Any] = {**base, "event": ev, "args": {}, "observed_before": _obs(rec)}
                if ev == "step":
                    line["args"] = {"has_work": bool(rec["has_work"])}
                where = seq_of.get(id(rec))
                if where is not None:
                    line["collective"] = colls[r][where[1]][0]
                    line["coll_seq"] = where[1]
                emit(t, line)
            elif ev in ("resume_done", "step_done"):
                where = seq_of.get(id(rec))
                if where is None:
                    continue  # a resume that was a no-op: no barrier to complete
                kind = colls[r][where[1]][0]
                if (r, where[1]) not in outcome:
                    break  # a collective the peers never completed (the trace's end)
                event = DONE_EVENT[kind].value
                v = rec["vllm"]
                work = schedulable(PauseState(v["pause_state"]), v["waiting"], v["running"])
                args = dict(done_args(kind, tuple(outcome[(r, where[1])].items()), work))
                emit(
                    t,
                    {**base, "event": event, "args": args, "coll_seq": where[1] + 1, "observed": _obs(rec)},
                )
            elif ev == "rpc" and rec["method"] in WEIGHT_CALLS:
                call, done = WEIGHT_CALLS[rec["method"]]
                emit(t, {**base, "event": call.value, "args": {}, "observed": _obs(rec)})
                if rec["error"]:
                    args = {"phase": PHASE[rec["method"]], "error": rec["error"]}
                    emit(t, {**base, "event": RankEvent.TRANSFER_FAILED.value, "args": args})
                elif done is not None:
                    # the probe sees no version here (vLLM relabels after the finish): the defaults
                    args = worker_outcome(rec["method"], {})[1] if rec["method"] in WORKER_OUTCOME else {}
                    emit(t, {**base, "event": done.value, "args": args, "observed": _obs(rec)})
    lines.sort(key=lambda x: (x[0], x[1]))
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    header = {"kind": "header", "variant": variant, "dp_size": n, "sync_interval": k, "init": None}
    header["source"] = "vLLM 0.32 DPEngineCoreProc, weightsync.vllm_tools.probe"
    with p.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for _, _, line in lines:
            f.write(json.dumps(line) + "\n")
    return {
        "path": str(p),
        "variant": variant,
        "lines": len(lines),
        "ranks": n,
        "sync_interval": k,
        "collectives": m,
    }


def record_cycles(
    out: str | Path,
    cycles: int = 20,
    seed: int = 0,
    modes: tuple[str, ...] = ("keep", "wait", "abort"),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``cycles`` pause / weight round / resume cycles with random request traffic on a real
    ``AsyncLLM(data_parallel_size=2)`` of a tiny Mixtral (CPU), record the engines' protocol events, and
    write the replay trace to ``out`` (see the module docstring) and the probe's raw engine logs to
    ``<out>.engines/``. Returns a summary: ``cycles``,
    ``requests``, ``finished``, ``aborted``, ``modes`` (count per mode), ``versions`` (vLLM's
    ``get_weight_version()`` after each cycle), ``seconds``, and :func:`to_replay_trace`'s fields. The
    engines run the plugin's fix as ``WEIGHTSYNC_VLLM_FIX`` chooses (on by default), and the trace's header
    names the variant they follow (``vllm-0.32-epoch``, or ``vllm-0.32`` with the fix off).

    Raises:
        ValueError: ``cycles`` < 1 or a mode that is not abort / wait / keep.
        RuntimeError: a request ended with an error, or vLLM's weight version is not the trainer's.
    """
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1, got {cycles}")
    bad = [m for m in modes if m not in {pm.value for pm in PauseMode}]
    if bad or not modes:
        raise ValueError(f"modes {list(modes)}: each must be one of {[pm.value for pm in PauseMode]}")
    say = log or (lambda _m: None)
    from weightsync.vllm_tools.fix import VARIANT, chosen_fix

    variant = VARIANT[chosen_fix()]  # an unknown WEIGHTSYNC_VLLM_FIX fails here, before any engine starts
    rng = random.Random(seed)
    t0 = time.monotonic()
    from weightsync.vllm_tools import probe
    from weightsync.vllm_tools.models import build_tiny_mixtral, checkpoint_state, perturbed_state
    from weightsync.vllm_tools.serving import LoopThread, connect_trainer, shutdown_async_llm, start_async_llm

    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-trace-") as tmp:
        events_dir = Path(tmp) / "events"
        hf = build_tiny_mixtral(Path(tmp) / "tiny-mixtral")
        os.environ[probe.ENV_EVENTS] = str(events_dir)
        from vllm import SamplingParams

        from weightsync.vllm.clients import AsyncLLMWeightSyncClient

        lt = LoopThread("vllm-trace-loop")
        try:
            llm, start_s = start_async_llm(lt, Path(tmp) / "tiny-mixtral", dp=2)
        finally:
            os.environ.pop(probe.ENV_EVENTS, None)
        say(f"AsyncLLM(data_parallel_size=2) up in {start_s:.1f} s")
        outcomes: dict[str, str] = {}
        tasks: list[Any] = []
        mode_count: dict[str, int] = {}
        versions: list[str] = []
        trainer: Any = None
        try:
            client = AsyncLLMWeightSyncClient(llm, lt.loop, timeout_s=120)
            trainer = connect_trainer(llm, hf, client=client, packed_buffer_size_bytes=96 << 10, timeout_s=60)

            async def one(rid: str, rank: int, max_tokens: int) -> None:
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                last = None
                prompt = [1, 5 + rng.randrange(50), 6 + rng.randrange(50)]
                async for o in llm.generate({"prompt_token_ids": prompt}, sp, rid, data_parallel_rank=rank):
                    last = o
                reason = str(last.outputs[0].finish_reason) if last is not None else "none"
                outcomes[rid] = reason

            n_req = 0
            for c in range(cycles):
                for _ in range(rng.randrange(0, 4)):
                    rid = f"c{c}-r{n_req}"
                    n_req += 1
                    tasks.append(lt.spawn(one(rid, rng.randrange(2), rng.randrange(2, 9))))
                time.sleep(rng.uniform(0.0, 0.3))
                mode = rng.choice(modes)
                mode_count[mode] = mode_count.get(mode, 0) + 1
                lt.run(llm.pause_generation(mode=mode), 300)
                hf.load_state_dict(perturbed_state(hf, seed=seed * 1000 + c, scale=0.02))
                trainer.send_weights(checkpoint_state(hf), weight_version=f"step-{c + 1}")
                lt.run(llm.resume_generation(), 300)
                versions.append(str(lt.run(llm.get_weight_version(), 60)))
                say(f"cycle {c + 1}/{cycles}: pause({mode}), round, resume; version {versions[-1]}")
            for fut in tasks:
                fut.result(300)
        finally:
            if trainer is not None:
                trainer.shutdown()
            shutdown_async_llm(llm, lt)
            lt.close()
        events = probe.read_events(events_dir)
        summary = to_replay_trace(events, out, variant=variant)
        raw = Path(str(out) + ".engines")
        raw.mkdir(parents=True, exist_ok=True)
        for f in events_dir.glob("engine-*.jsonl"):
            (raw / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
        summary["engine_logs"] = str(raw)
    errors = {rid: r for rid, r in outcomes.items() if r not in ("length", "stop", "abort")}
    if errors:
        raise RuntimeError(f"requests ended with errors: {errors}")
    want = [f"step-{c + 1}" for c in range(cycles)]
    if versions != want:
        raise RuntimeError(f"vLLM's weight versions {versions}, the trainer sent {want}")
    return {
        "cycles": cycles,
        "requests": len(outcomes),
        "finished": sum(1 for r in outcomes.values() if r in ("length", "stop")),
        "aborted": sum(1 for r in outcomes.values() if r == "abort"),
        "modes": mode_count,
        "versions": versions,
        "seconds": round(time.monotonic() - t0, 3),
        **summary,
    }


__all__ = ["OBSERVED", "WEIGHT_CALLS", "record_cycles", "to_replay_trace"]
