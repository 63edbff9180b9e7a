"""The per-rank transition tables of every protocol variant, and the sans-IO ``RankMachine``.

Everything that affects a DP engine rank's protocol transitions lives in this file (h11 ``_state.py``
style): the local variables (vLLM's names), the named guards, the named updates, the effect names, and
one table per variant keyed by ``(RankState, RankEvent)``.

Event arguments (``args``) used by the guards:

- every event: ``rank`` (DP rank index), ``dp_size``, ``sync_interval`` (K; 32 in PR #21617, 16 in vLLM
  0.32) -- injected by :class:`RankMachine` or by the model checker;
- weight-transfer calls in ``vllm-0.32``: ``worker`` (the worker machine's state) and ``worker_initialized``;
- ``PAUSE``: ``mode`` (:class:`PauseMode`), ``clear_cache`` (bool), ``running`` (requests running on
  this rank now, i.e. what ``wait`` must drain);
- ``ADD``: ``wave`` (the wave the front-end stamped on the request);
- ``START_DP_WAVE``: ``wave``, ``exclude`` (the engine index that must not re-start, or -1);
- ``STEP``, ``DP_STEP_DONE``, ``DP_SYNC_DONE``: ``has_work`` (the scheduler has schedulable work
  under the rank's PauseState, see :func:`weightsync.spec.states.schedulable`);
- ``DP_SYNC_DONE``: ``sum_unfinished``, ``sum_pending_pause`` (the SUM all-reduce result);
- ``RESUME_BARRIER_DONE``: ``max_unfinished``, ``max_wave`` (the MAX all-reduce result);
- ``FINISH_DONE``: ``weight_version`` (the version the caller supplied to ``finish_weight_update``, vLLM's
  string ``weight_version``, or None) and ``monotonic`` (bool: the opt-in guard that refuses a version older
  than the rank's);
- ``TRANSFER_FAILED``: ``phase`` (``"init"``, ``"start"``, ``"update"`` or ``"finish"``) and ``error``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from weightsync.spec.states import (
    LOCAL_CALLS,
    PAUSE_STATE_OF_MODE,
    PauseMode,
    PauseState,
    RankEvent,
    RankState,
)
from weightsync.spec.table import (
    ALWAYS,
    Fired,
    TableMachine,
    Transition,
    apply_transition,
    select_transition,
    table_digest,
)


class RankVars(NamedTuple):
    """Local protocol variables of one DP engine rank (vLLM's names, reference sections 5-6).

    Attributes:
        state: protocol state.
        pause_state: the scheduler's PauseState.
        engines_running: the rank believes a wave is running and must step (dummy batches if idle).
        current_wave: the wave number this rank is in.
        step_counter: steps taken in the current wave, modulo ``sync_interval``.
        pending_pause: phase 1 of the two-phase pause (PR #39366).
        ignore_start_dp_wave: phase 2 reached: START_DP_WAVE is dropped (PR #39366).
        collective: the collective this rank is blocked in ("" when none).
        weight_version: the label of the weights being served: the caller's ``weight_version`` of the last
            successful finish_weight_update that named one (a finish without one leaves it, as vLLM 0.32's
            ``async_llm.py:1351-1355``), or the label :func:`relabel_weight_version` set; never moved by a
            failed round. The model's versions are round numbers (ints, initial 0); a real engine's are
            vLLM's strings (initial ``"default"``, ``v1/engine/core.py:141``).
        clear_cache: the pending pause's ``clear_cache`` argument.
        wave_started: rank 0 has reported the current wave's start to the coordinator (vLLM's
            ``was_running`` edge, ``v1/engine/core.py:2394-2406``); set by the mirror rows only, cleared
            when the wave ends.
        first_synced: the wave has taken its first step (vLLM 0.32's ``step_counter >= 1``; with
            ``step_counter`` kept modulo K this keeps the cadence "step 1 plus every K" finite,
            ``v1/engine/core.py:2410-2414``); used by the vllm-0.32 tables only.
        was_running: rank 0's ``engines_running`` at the end of its last loop iteration, i.e. vLLM 0.32's
            ``was_running`` sampled at the top of the next one (``v1/engine/core.py:2333``); used by the
            vllm-0.32 tables only (and only on rank 0, the only rank that reads it).
    """

    state: RankState = RankState.RUNNING
    pause_state: PauseState = PauseState.UNPAUSED
    engines_running: bool = False
    current_wave: int = 0
    step_counter: int = 0
    pending_pause: bool = False
    ignore_start_dp_wave: bool = False
    collective: str = ""
    weight_version: int | str = 0
    clear_cache: bool = False
    wave_started: bool = False
    first_synced: bool = False
    was_running: bool = False


Args = Mapping[str, Any]

# ---------------------------------------------------------------------------------------------------
# Guards: named predicates over (vars, args). Every guard used in a table is listed here.
# ---------------------------------------------------------------------------------------------------


def _works(v: RankVars, a: Args) -> bool:
    return bool(a["has_work"]) or v.engines_running


def _is_sync_step(v: RankVars, a: Args) -> bool:
    return v.step_counter % int(a["sync_interval"]) == int(a["sync_interval"]) - 1


def _sum_p(a: Args) -> int:
    return int(a["sum_pending_pause"])


def _consensus(a: Args) -> bool:
    return _sum_p(a) == int(a["dp_size"])


def _keep_running(a: Args) -> bool:
    """vLLM: keep running = sum(unfinished) > 0 or sum(pending_pause) mod dp_size != 0."""
    return int(a["sum_unfinished"]) > 0 or _sum_p(a) % int(a["dp_size"]) != 0


def _wave_for_me(v: RankVars, a: Args) -> bool:
    return int(a["exclude"]) != int(a["rank"]) and int(a["wave"]) >= v.current_wave


_VERSION_STEP = re.compile(r"(\d+)$")


def version_order(version: int | str) -> int:
    """The order the opt-in monotonic guard compares: an int version itself; a string version its trailing
    number (``"step-12"`` -> 12); vLLM's initial ``"default"`` -> -1.

    Raises:
        ValueError: a string version without a trailing number (the guard cannot order it).
    """
    if isinstance(version, int):
        return version
    if version == "default":
        return -1
    m = _VERSION_STEP.search(version)
    if m is None:
        raise ValueError(
            f"weight_version {version!r} has no trailing step number; the monotonic guard orders versions "
            "by it (e.g. 'step-12')"
        )
    return int(m.group(1))


def _version_older(v: RankVars, a: Args) -> bool:
    new = a.get("weight_version")
    return (
        bool(a.get("monotonic")) and new is not None and version_order(new) < version_order(v.weight_version)
    )


def _first_step_rank0(v: RankVars, a: Args) -> bool:
    """vLLM 0.32 ``v1/engine/core.py:2394-2406``: rank 0 reports the not-running -> running edge."""
    return int(a["rank"]) == 0 and not v.wave_started and not v.pending_pause


def _k1_sync_step(v: RankVars, a: Args) -> bool:
    """vLLM 0.32 ``v1/engine/core.py:2410-2414``: the step's sync runs at step_counter == 1 (the wave's
    first step) and every ``dp_sync_interval`` steps (``step_counter`` is incremented first)."""
    return not v.first_synced or _is_sync_step(v, a)


def _k1_mirror(v: RankVars, a: Args, pending_after: bool) -> bool:
    """vLLM 0.32 ``v1/engine/core.py:2394-2406``: rank 0, not ``was_running`` at the top of the iteration,
    and no pause pending after the iteration's sync."""
    return int(a["rank"]) == 0 and not v.was_running and not pending_after


def _pending_after_sync(v: RankVars, a: Args) -> bool:
    return v.pending_pause and not _consensus(a)


def _resume_in_flight(v: RankVars, a: Args) -> bool:
    """vLLM 0.32 ``v1/engine/core.py:2251``: pending_pause or (engines_running and ignore_start_dp_wave)."""
    return v.pending_pause or (v.engines_running and v.ignore_start_dp_wave)


def _worker(a: Args) -> str:
    return str(a.get("worker", "ready"))


def _drains_now(v: RankVars, a: Args) -> bool:
    return PauseMode(a["mode"]) is not PauseMode.WAIT or int(a["running"]) == 0


GUARDS: dict[str, Callable[[RankVars, Args], bool]] = {
    # loop
    "step_plain": lambda v, a: _works(v, a) and not _is_sync_step(v, a),
    "step_sync": lambda v, a: _works(v, a) and _is_sync_step(v, a),
    "idle": lambda v, a: not _works(v, a),
    "drained": lambda v, a: not bool(a["has_work"]),
    "not_drained": lambda v, a: bool(a["has_work"]),
    # DP sync all-reduce outcomes (reference section 5, 'DP sync')
    "sync_keep_running": lambda v, a: _keep_running(a),
    "sync_stop": lambda v, a: not _keep_running(a),
    # Phase 2 stop: every rank paused (this sync's consensus, or an earlier one that set
    # ignore_start_dp_wave while wait-mode requests still ran) and no unfinished work anywhere.
    "sync_paused_and_idle": lambda v, a: (
        (_consensus(a) or v.ignore_start_dp_wave) and int(a["sum_unfinished"]) == 0
    ),
    "sync_consensus_drained": lambda v, a: (
        _consensus(a) and int(a["sum_unfinished"]) > 0 and not bool(a["has_work"])
    ),
    "sync_consensus_draining": lambda v, a: _consensus(a) and bool(a["has_work"]),
    "sync_partial_drained": lambda v, a: not _consensus(a) and not bool(a["has_work"]),
    "sync_partial_draining": lambda v, a: not _consensus(a) and bool(a["has_work"]),
    # waves
    "wave_for_me": _wave_for_me,
    "wave_not_for_me": lambda v, a: not _wave_for_me(v, a),
    "wave_for_me_not_ignoring": lambda v, a: _wave_for_me(v, a) and not v.ignore_start_dp_wave,
    "wave_dropped": lambda v, a: not (_wave_for_me(v, a) and not v.ignore_start_dp_wave),
    "add_newer_wave": lambda v, a: int(a["wave"]) > v.current_wave,
    "add_stale_wave_idle_unpaused": lambda v, a: (
        int(a["wave"]) < v.current_wave and not v.engines_running and v.pause_state is PauseState.UNPAUSED
    ),
    "add_current_or_busy": lambda v, a: (
        not (
            int(a["wave"]) > v.current_wave
            or (
                int(a["wave"]) < v.current_wave
                and not v.engines_running
                and v.pause_state is PauseState.UNPAUSED
            )
        )
    ),
    # pause
    "pause_abort": lambda v, a: PauseMode(a["mode"]) is PauseMode.ABORT,
    "pause_abort_idle": lambda v, a: PauseMode(a["mode"]) is PauseMode.ABORT and not v.engines_running,
    "pause_abort_busy": lambda v, a: PauseMode(a["mode"]) is PauseMode.ABORT and v.engines_running,
    "pause_drains_now": _drains_now,
    "pause_must_drain": lambda v, a: not _drains_now(v, a),
    "pause_idle_fast_path": lambda v, a: _drains_now(v, a) and not v.engines_running,
    "pause_drains_now_busy": lambda v, a: _drains_now(v, a) and v.engines_running,
    # resume
    "engines_running": lambda v, a: v.engines_running,
    "engines_stopped": lambda v, a: not v.engines_running,
    "barrier_idle": lambda v, a: int(a["max_unfinished"]) == 0,
    # rank 0's mirror start_wave (vLLM 0.32)
    "first_step_rank0": _first_step_rank0,
    "sync_keep_running_first_rank0": lambda v, a: _keep_running(a) and _first_step_rank0(v, a),
    "not_first_step_rank0": lambda v, a: not _first_step_rank0(v, a),
    # versions
    "version_older": _version_older,
    # vLLM 0.32 (variants vllm-0.32, vllm-0.32-epoch)
    "k1_step_plain": lambda v, a: _works(v, a) and not _k1_sync_step(v, a),
    "k1_step_sync": lambda v, a: _works(v, a) and _k1_sync_step(v, a),
    "k1_mirror_after_step": lambda v, a: _k1_mirror(v, a, v.pending_pause),
    "k1_mirror_after_step_drained": lambda v, a: (
        _k1_mirror(v, a, v.pending_pause) and not bool(a["has_work"])
    ),
    "k1_mirror_after_step_draining": lambda v, a: _k1_mirror(v, a, v.pending_pause) and bool(a["has_work"]),
    "k1_sync_keep_mirror": lambda v, a: _keep_running(a) and _k1_mirror(v, a, _pending_after_sync(v, a)),
    "k1_sync_keep_mirror_drained": lambda v, a: (
        _keep_running(a) and _k1_mirror(v, a, _pending_after_sync(v, a)) and not bool(a["has_work"])
    ),
    "k1_sync_keep_mirror_draining": lambda v, a: (
        _keep_running(a) and _k1_mirror(v, a, _pending_after_sync(v, a)) and bool(a["has_work"])
    ),
    "resume_in_flight": _resume_in_flight,
    "resume_noop_running": lambda v, a: not _resume_in_flight(v, a) and v.engines_running,
    "worker_can_start": lambda v, a: _worker(a) == "ready" and bool(a.get("worker_initialized", True)),
    "worker_active": lambda v, a: _worker(a) == "active",
    "worker_not_active": lambda v, a: _worker(a) != "active",
    "failed_init": lambda v, a: a.get("phase") == "init",
}

# ---------------------------------------------------------------------------------------------------
# Updates: pure functions (vars, args) -> vars, applied by the machine in the listed order.
# ---------------------------------------------------------------------------------------------------


def _set_pause(v: RankVars, a: Args) -> RankVars:
    return v._replace(
        pause_state=PAUSE_STATE_OF_MODE[PauseMode(a["mode"])], clear_cache=bool(a["clear_cache"])
    )


def _end_wave(v: RankVars, a: Args) -> RankVars:
    return v._replace(
        engines_running=False, current_wave=v.current_wave + 1, step_counter=0, wave_started=False
    )


def _fail_stop(v: RankVars, a: Args) -> RankVars:
    """A failed rank stops serving: nothing schedulable, not stepping, waves ignored, no pause pending."""
    return v._replace(
        pause_state=PauseState.PAUSED_ALL,
        engines_running=False,
        pending_pause=False,
        ignore_start_dp_wave=True,
        collective="",
    )


def _set_weight_version(v: RankVars, a: Args) -> RankVars:
    """vLLM 0.32 ``finish_weight_update(weight_version)`` (``v1/engine/async_llm.py:1351-1355``): the
    caller's version, or (None) the served one unchanged."""
    new = a.get("weight_version")
    return v if new is None else v._replace(weight_version=new)


def relabel_weight_version(v: RankVars, version: str) -> RankVars:
    """vLLM 0.32 ``update_weight_version(v)`` (``v1/engine/async_llm.py:1357-1359`` ->
    ``EngineCore.set_weight_version``, ``v1/engine/core.py:1082-1083``): the served weights get the label
    ``version``; nothing else changes.

    This is deliberately **not a transition** of the tables: vLLM sets the label in any state (no gate, no
    worker call, no collective), so no row guards it and no effect runs. A real engine applies it to its
    rank variables, reports it to its listeners and records it in its trace (a ``"relabel"`` record);
    ``weightsync replay`` applies the same function to the replayed rank (:func:`weightsync.impl.checked.
    replay_trace`). The model has no relabel (its versions are round numbers).

    Raises:
        ValueError: ``version`` is not a str (vLLM's type), naming it.
    """
    if not isinstance(version, str):
        raise ValueError(
            f"update_weight_version: the version must be a str (vLLM 0.32's string weight_version), got "
            f"{type(version).__name__} {version!r}"
        )
    return v._replace(weight_version=version)


UPDATES: dict[str, Callable[[RankVars, Args], RankVars]] = {
    "set_pause_state": _set_pause,
    "unpause": lambda v, a: v._replace(pause_state=PauseState.UNPAUSED),
    "set_pending_pause": lambda v, a: v._replace(pending_pause=True),
    "clear_pending_pause": lambda v, a: v._replace(pending_pause=False),
    "set_ignore_start_dp_wave": lambda v, a: v._replace(ignore_start_dp_wave=True),
    "clear_ignore_start_dp_wave": lambda v, a: v._replace(ignore_start_dp_wave=False),
    "set_engines_running": lambda v, a: v._replace(engines_running=True),
    "adopt_wave": lambda v, a: v._replace(current_wave=int(a["wave"])),
    "enter_dp_step": lambda v, a: v._replace(collective="dp_step"),
    "enter_dp_sync": lambda v, a: v._replace(collective="dp_sync"),
    "enter_resume_barrier": lambda v, a: v._replace(collective="resume_barrier"),
    "enter_weight_broadcast": lambda v, a: v._replace(collective="weight_broadcast"),
    "enter_transfer_init": lambda v, a: v._replace(collective="transfer_init"),
    "leave_collective": lambda v, a: v._replace(collective=""),
    "count_step": lambda v, a: v._replace(
        step_counter=(v.step_counter + 1) % int(a["sync_interval"]), engines_running=True
    ),
    "mark_wave_started": lambda v, a: v._replace(wave_started=True),
    "end_wave": _end_wave,
    "running_from_barrier": lambda v, a: v._replace(engines_running=int(a["max_unfinished"]) > 0),
    "adopt_wave_after_barrier": lambda v, a: v._replace(current_wave=int(a["max_wave"]) + 1),
    "set_weight_version": _set_weight_version,
    "fail_stop": _fail_stop,
    # vLLM 0.32 (variants vllm-0.32, vllm-0.32-epoch)
    "count_step_k1": lambda v, a: v._replace(
        step_counter=(v.step_counter + 1) % int(a["sync_interval"]), first_synced=True, engines_running=True
    ),
    "end_wave_k1": lambda v, a: v._replace(
        engines_running=False, current_wave=v.current_wave + 1, step_counter=0, first_synced=False
    ),
    "sync_consensus": lambda v, a: (
        v._replace(ignore_start_dp_wave=True, pending_pause=False) if _consensus(a) else v
    ),
    "latch_was_running": lambda v, a: v._replace(was_running=v.engines_running) if int(a["rank"]) == 0 else v,
    "reset_step_counter": lambda v, a: v._replace(step_counter=0, first_synced=False),
}

#: Effect names and what the runtime (impl) or the model does for each.
EFFECTS: dict[str, str] = {
    "abort_requests": "abort every in-flight request; partial outputs with finish_reason='abort'",
    "queue_request": "append the request to the scheduler's waiting queue",
    "abort_request": "abort one request on the client's ABORT",
    "emit_start_wave": "send start_wave(current_wave) to the DP coordinator",
    "emit_wave_complete": "rank 0 only: send wave_complete(wave that ended) to the DP coordinator",
    "execute_step": "run one forward step of the scheduled batch (a dummy batch when nothing is scheduled)",
    "enter_dp_step": "join the per-step DP/EP forward collective",
    "enter_dp_sync": "join the DP sync SUM all-reduce of [has_unfinished, pending_pause]",
    "enter_resume_barrier": "join the resume MAX all-reduce (barrier)",
    "enter_weight_broadcast": "join the weight-transfer broadcast with the trainer (receive_weights)",
    "enter_transfer_init": "join the weight-transfer group rendezvous with the trainer",
    "reply_pause": "resolve the pause call's future (the pause call returns)",
    "reply_resume": "the resume call returns",
    "reply": "the utility call returns",
    "clear_cache": "reset prefix/KV caches if the pause asked clear_cache (preempts frozen requests)",
    "start_weight_update": "worker machine: start_weight_update on every worker",
    "finish_weight_update": "worker machine: finish_weight_update on every worker (check every layer arrived, "
    "finalize the reload); its outcome is FINISH_DONE or TRANSFER_FAILED",
    "fail_round": "worker machine: abandon the round; the weights are partial until a round completes",
    "fail_init": "worker machine: close the half-made transfer group; init again before the next start",
    "reply_failure": "the current call returns the failure (its phase, error and the ranks missing)",
    "refuse": "the call returns an error naming the rank's state and the legal calls; nothing changes",
    "front_end_gate": "the API front-end holds new requests (front-end-pause only)",
    "front_end_ungate": "the API front-end releases held requests (front-end-pause only)",
}

_S = RankState
_E = RankEvent
Table = dict[tuple[RankState, RankEvent], tuple[Transition, ...]]


def _t(
    guard: str, target: RankState, updates: tuple[str, ...], effects: tuple[str, ...], rule: str
) -> Transition:
    return Transition(guard, target, updates, effects, rule)


R39366 = "vLLM PR #39366 (two-phase pause/resume)"
R_WAVES = "reference s5 (DP waves)"


def _serving_rows(state: RankState, honour_waves: bool, stale_add_rearms: bool, may_step: bool) -> Table:
    """Rows for ADD, ABORT, START_DP_WAVE and STEP in a state where the rank keeps (or stops) serving."""
    rows: Table = {}
    add: list[Transition] = [_t("add_newer_wave", state, ("adopt_wave",), ("queue_request",), R_WAVES)]
    if stale_add_rearms:
        add.append(
            _t(
                "add_stale_wave_idle_unpaused",
                state,
                ("set_engines_running",),
                ("queue_request", "emit_start_wave"),
                "vLLM PR #37024 (stale-wave ADD on an idle UNPAUSED engine)",
            )
        )
        add.append(_t("add_current_or_busy", state, (), ("queue_request",), R_WAVES))
    else:
        add.append(_t(ALWAYS, state, (), ("queue_request",), R_WAVES))
    rows[(state, _E.ADD)] = tuple(add)
    rows[(state, _E.ABORT)] = (_t(ALWAYS, state, (), ("abort_request",), "reference s5"),)
    if honour_waves:
        rows[(state, _E.START_DP_WAVE)] = (
            _t("wave_for_me_not_ignoring", state, ("adopt_wave", "set_engines_running"), (), R_WAVES),
            _t("wave_dropped", state, (), (), R39366 + ": dropped while globally paused"),
        )
    else:
        rows[(state, _E.START_DP_WAVE)] = (_t(ALWAYS, state, (), (), "dropped"),)
    if may_step:
        rows[(state, _E.STEP)] = (
            _t("step_plain", state, ("enter_dp_step",), ("execute_step", "enter_dp_step"), R_WAVES),
            _t("step_sync", state, ("enter_dp_sync",), ("execute_step", "enter_dp_sync"), "vLLM PR #21617"),
            _t("idle", state, (), (), R_WAVES),
        )
    else:
        rows[(state, _E.STEP)] = (_t(ALWAYS, state, (), (), R39366 + ": stopped together"),)
    return rows


R_FAIL = "weightsync: failure is a table event; a failed round reaches `failed`"


def _transfer_rows() -> Table:
    """verified -> updating -> verified, with failures as rows (weightsync); init legal in running, verified
    and failed. ``finish_weight_update`` moves the version only on FINISH_DONE, after the workers' finish
    returned; every failure (TRANSFER_FAILED) leaves the round in ``failed``, and a new round recovers it."""
    start = _t(ALWAYS, _S.UPDATING, (), ("start_weight_update", "reply"), "reference s2")
    rows: Table = {
        (_S.VERIFIED, _E.START_UPDATE): (start,),
        (_S.FAILED, _E.START_UPDATE): (
            start._replace(rule="weightsync: a new round recovers a failed rank"),
        ),
        (_S.UPDATING, _E.UPDATE_WEIGHTS): (
            _t(ALWAYS, _S.UPDATING, ("enter_weight_broadcast",), ("enter_weight_broadcast",), "reference s2"),
        ),
        (_S.UPDATING, _E.WEIGHT_BROADCAST_DONE): (
            _t(ALWAYS, _S.UPDATING, ("leave_collective",), ("reply",), "reference s2"),
        ),
        (_S.UPDATING, _E.FINISH_UPDATE): (
            _t(
                ALWAYS,
                _S.UPDATING,
                (),
                ("finish_weight_update",),
                "reference s2; outcome as an event: weightsync",
            ),
        ),
        (_S.UPDATING, _E.FINISH_DONE): (
            _t(
                "version_older",
                _S.FAILED,
                ("fail_stop",),
                ("fail_round", "reply_failure"),
                "weightsync: opt-in monotonic weight_version; engines never go backwards",
            ),
            _t(
                ALWAYS,
                _S.VERIFIED,
                ("set_weight_version",),
                ("reply",),
                "reference s2; vLLM 0.32 finish_weight_update(weight_version); moves only on success",
            ),
        ),
        (_S.UPDATING, _E.TRANSFER_FAILED): (
            _t(ALWAYS, _S.FAILED, ("leave_collective", "fail_stop"), ("fail_round", "reply_failure"), R_FAIL),
        ),
    }
    for s in (_S.RUNNING, _S.VERIFIED, _S.FAILED):
        rows[(s, _E.INIT_TRANSFER)] = (
            _t(ALWAYS, s, ("enter_transfer_init",), ("enter_transfer_init",), "reference s2"),
        )
        rows[(s, _E.TRANSFER_INIT_DONE)] = (_t(ALWAYS, s, ("leave_collective",), ("reply",), "reference s2"),)
        rows[(s, _E.TRANSFER_FAILED)] = (
            _t(ALWAYS, _S.FAILED, ("leave_collective", "fail_stop"), ("fail_init", "reply_failure"), R_FAIL),
        )
    rows.update(_serving_rows(_S.FAILED, honour_waves=False, stale_add_rearms=False, may_step=False))
    refuse = _t(ALWAYS, _S.FAILED, (), ("refuse",), "weightsync: a failed rank never serves partial weights")
    for e in (_E.PAUSE, _E.RESUME, _E.UPDATE_WEIGHTS, _E.FINISH_UPDATE):
        rows[(_S.FAILED, e)] = (refuse,)
    return rows


R_MIRROR = "vLLM 0.32 v1/engine/core.py:2394-2406: rank 0 mirrors the not-running -> running edge"


def _step_done_rows(
    state: RankState, drained_target: RankState | None = None, mirror_start_wave: bool = False
) -> Table:
    """Non-sync forward collective completed: count the step; vLLM sets engines_running True. With
    ``mirror_start_wave`` rank 0 sends start_wave(current_wave) after the first step of a wave."""
    step = ("leave_collective", "count_step")
    if drained_target is None and mirror_start_wave:
        return {
            (state, _E.DP_STEP_DONE): (
                _t("first_step_rank0", state, (*step, "mark_wave_started"), ("emit_start_wave",), R_MIRROR),
                _t(ALWAYS, state, step, (), R_WAVES),
            )
        }
    if drained_target is None:
        return {(state, _E.DP_STEP_DONE): (_t(ALWAYS, state, step, (), R_WAVES),)}
    return {
        (state, _E.DP_STEP_DONE): (
            _t("drained", drained_target, ("leave_collective", "count_step"), (), "weightsync: local drain"),
            _t("not_drained", state, ("leave_collective", "count_step"), (), R_WAVES),
        )
    }


def _running_rows(stale_add_rearms: bool = True, mirror_start_wave: bool = False) -> Table:
    rows = _serving_rows(_S.RUNNING, honour_waves=True, stale_add_rearms=stale_add_rearms, may_step=True)
    rows.update(_step_done_rows(_S.RUNNING, mirror_start_wave=mirror_start_wave))
    keep = _t("sync_keep_running", _S.RUNNING, ("leave_collective", "count_step"), (), R_WAVES)
    mirror: tuple[Transition, ...] = ()
    if mirror_start_wave:
        # vLLM 0.32 checks the sync result first (engines_running), then the edge; a wave that stops at
        # its first sync ends (wave_complete) without a start_wave.
        mirror = (
            _t(
                "sync_keep_running_first_rank0",
                _S.RUNNING,
                ("leave_collective", "count_step", "mark_wave_started"),
                ("emit_start_wave",),
                R_MIRROR,
            ),
        )
    rows[(_S.RUNNING, _E.DP_SYNC_DONE)] = (
        *mirror,
        keep,
        _t("sync_stop", _S.RUNNING, ("leave_collective", "end_wave"), ("emit_wave_complete",), R_WAVES),
    )
    return rows


def two_phase_table(epoch: bool, safe_resume: bool = False, mirror_start_wave: bool = False) -> Table:
    """vLLM PR #39366 as shipped (``epoch=False``) or weightsync's ``two-phase-epoch`` fix (``epoch=True``).

    ``safe_resume``: a resume is a local no-op unless the rank is verified (weightsync; vLLM's rule, "no-op
    if engines_running", is a per-rank belief, and a stray resume with one rank busy and one idle sends
    the idle one alone into the resume barrier). ``mirror_start_wave``: rank 0 reports the not-running ->
    running edge to the coordinator (vLLM 0.32), which then no longer latches on FIRST_REQ.
    """
    rows = _running_rows(mirror_start_wave=mirror_start_wave)
    pause_updates = ("set_pause_state", "set_pending_pause", "set_engines_running")
    # Only mode=abort aborts requests (reference s4); keep freezes them and wait drains the running ones.
    rows[(_S.RUNNING, _E.PAUSE)] = (
        _t("pause_abort", _S.PAUSED, pause_updates, ("abort_requests",), R39366 + " phase 1 (abort)"),
        _t("pause_drains_now", _S.PAUSED, pause_updates, (), R39366 + " phase 1"),
        _t("pause_must_drain", _S.PAUSING, pause_updates, (), R39366 + " phase 1 (wait drains)"),
    )
    for s in (_S.PAUSING, _S.PAUSED):
        rows.update(_serving_rows(s, honour_waves=True, stale_add_rearms=False, may_step=True))
    rows.update(_step_done_rows(_S.PAUSING, drained_target=_S.PAUSED))
    rows.update(_step_done_rows(_S.PAUSED))
    verify = _t(
        "sync_paused_and_idle",
        _S.VERIFIED,
        ("leave_collective", "set_ignore_start_dp_wave", "clear_pending_pause", "end_wave"),
        ("emit_wave_complete", "clear_cache", "reply_pause"),
        R39366 + " phase 2",
    )
    # After consensus with work left (wait mode) the ranks keep stepping, ignoring waves, and stop together.
    after_consensus = ("leave_collective", "set_ignore_start_dp_wave", "clear_pending_pause", "count_step")
    for s in (_S.PAUSING, _S.PAUSED):
        rows[(s, _E.DP_SYNC_DONE)] = (
            verify,
            _t("sync_consensus_drained", _S.PAUSED, after_consensus, (), R39366 + " phase 2 (wait)"),
            _t("sync_consensus_draining", _S.PAUSING, after_consensus, (), R39366 + " phase 2 (wait)"),
            _t(
                "sync_partial_drained", _S.PAUSED, ("leave_collective", "count_step"), (), R39366 + " partial"
            ),
            _t(
                "sync_partial_draining",
                _S.PAUSING,
                ("leave_collective", "count_step"),
                (),
                R39366 + " partial",
            ),
        )
    rows.update(_serving_rows(_S.VERIFIED, honour_waves=True, stale_add_rearms=False, may_step=False))
    rows.update(_serving_rows(_S.UPDATING, honour_waves=True, stale_add_rearms=False, may_step=False))
    rows.update(_transfer_rows())
    rows[(_S.VERIFIED, _E.RESUME)] = (
        _t(
            ALWAYS,
            _S.RESUMING,
            ("unpause", "clear_ignore_start_dp_wave", "enter_resume_barrier"),
            ("enter_resume_barrier",),
            R39366 + " resume barrier",
        ),
    )
    if safe_resume:
        rows[(_S.RUNNING, _E.RESUME)] = (
            _t(
                ALWAYS,
                _S.RUNNING,
                (),
                ("reply_resume",),
                "weightsync: a resume is a local no-op unless the rank is verified (stray, repeated or "
                "racing resumes are safe)",
            ),
        )
    else:
        rows[(_S.RUNNING, _E.RESUME)] = (
            _t("engines_running", _S.RUNNING, (), ("reply_resume",), R39366 + ": no-op while running"),
            _t(
                "engines_stopped",
                _S.RESUMING,
                ("unpause", "clear_ignore_start_dp_wave", "enter_resume_barrier"),
                ("enter_resume_barrier",),
                R39366 + " resume barrier",
            ),
        )
    barrier_updates: tuple[str, ...] = ("leave_collective", "running_from_barrier")
    rule = R39366 + " resume barrier"
    if epoch:
        barrier_updates += ("adopt_wave_after_barrier",)
        rule = "weightsync two-phase-epoch: the resume all-reduce also agrees on MAX(current_wave) + 1"
    if mirror_start_wave:
        # The coordinator does not latch, so it learns the re-based wave from the engines: an idle resume
        # ends wave MAX (rank 0's wave_complete); a busy one starts wave MAX + 1 (rank 0's start_wave
        # after its first step, since wave_started is clear).
        rows[(_S.RESUMING, _E.RESUME_BARRIER_DONE)] = (
            _t(
                "barrier_idle",
                _S.RUNNING,
                barrier_updates,
                ("emit_wave_complete", "reply_resume"),
                rule + "; rank 0 reports the idle resume as wave_complete(MAX)",
            ),
            _t(ALWAYS, _S.RUNNING, barrier_updates, ("reply_resume",), rule),
        )
    else:
        rows[(_S.RESUMING, _E.RESUME_BARRIER_DONE)] = (
            _t(ALWAYS, _S.RUNNING, barrier_updates, ("reply_resume",), rule),
        )
    return rows


def _engine_pause_table(ignore_waves_while_paused: bool) -> Table:
    """Pause inside EngineCore with the idle fast path (issue #36594 era), optionally ignoring waves
    while paused (the rejected PR #36608 idea)."""
    rows = _running_rows()
    honour = not ignore_waves_while_paused
    pause_updates = ("set_pause_state",)
    fast = "issue #36594: an idle engine completes pause at once"
    rows[(_S.RUNNING, _E.PAUSE)] = (
        _t(
            "pause_abort_idle",
            _S.VERIFIED,
            pause_updates,
            ("abort_requests", "clear_cache", "reply_pause"),
            fast + " (abort)",
        ),
        _t("pause_idle_fast_path", _S.VERIFIED, pause_updates, ("clear_cache", "reply_pause"), fast),
        _t("pause_abort_busy", _S.PAUSED, pause_updates, ("abort_requests",), "reference s4 (abort)"),
        _t("pause_drains_now_busy", _S.PAUSED, pause_updates, (), "reference s4"),
        _t("pause_must_drain", _S.PAUSING, pause_updates, (), "reference s4 (wait drains)"),
    )
    for s in (_S.PAUSING, _S.PAUSED):
        rows.update(_serving_rows(s, honour_waves=honour, stale_add_rearms=False, may_step=True))
        rows[(s, _E.DP_SYNC_DONE)] = (
            _t(
                "sync_stop",
                _S.VERIFIED,
                ("leave_collective", "end_wave"),
                ("emit_wave_complete", "clear_cache", "reply_pause"),
                "reference s4: completes when idle",
            ),
            _t("drained", _S.PAUSED, ("leave_collective", "count_step"), (), R_WAVES),
            _t("not_drained", _S.PAUSING, ("leave_collective", "count_step"), (), R_WAVES),
        )
    rows.update(_step_done_rows(_S.PAUSING, drained_target=_S.PAUSED))
    rows.update(_step_done_rows(_S.PAUSED))
    # A paused (verified/updating) engine still honours START_DP_WAVE and steps when re-armed: issue #36594.
    for s in (_S.VERIFIED, _S.UPDATING):
        rows.update(_serving_rows(s, honour_waves=honour, stale_add_rearms=False, may_step=True))
        rows.update(_step_done_rows(s))
        rows[(s, _E.DP_SYNC_DONE)] = (
            _t("sync_keep_running", s, ("leave_collective", "count_step"), (), R_WAVES),
            _t("sync_stop", s, ("leave_collective", "end_wave"), ("emit_wave_complete",), R_WAVES),
        )
    rows.update(_transfer_rows())
    for s in (_S.VERIFIED, _S.PAUSING, _S.PAUSED):
        rows[(s, _E.RESUME)] = (
            _t(ALWAYS, _S.RUNNING, ("unpause",), ("reply_resume",), "reference s4: resume"),
        )
    rows[(_S.RUNNING, _E.RESUME)] = (_t(ALWAYS, _S.RUNNING, (), ("reply_resume",), "reference s4: no-op"),)
    return rows


def front_end_pause_table() -> Table:
    """Pause held in the API front-end (PR #28037, before PR #34125): engines never pause."""
    rows = _running_rows()
    rows[(_S.RUNNING, _E.PAUSE)] = (
        _t(ALWAYS, _S.VERIFIED, (), ("front_end_gate", "reply_pause"), "PR #28037: a flag in AsyncLLM"),
    )
    for s in (_S.VERIFIED, _S.UPDATING):
        rows.update(_serving_rows(s, honour_waves=True, stale_add_rearms=True, may_step=True))
        rows.update(_step_done_rows(s))
        rows[(s, _E.DP_SYNC_DONE)] = (
            _t("sync_keep_running", s, ("leave_collective", "count_step"), (), R_WAVES),
            _t("sync_stop", s, ("leave_collective", "end_wave"), ("emit_wave_complete",), R_WAVES),
        )
    rows.update(_transfer_rows())
    rows[(_S.VERIFIED, _E.RESUME)] = (
        _t(ALWAYS, _S.RUNNING, (), ("front_end_ungate", "reply_resume"), "PR #28037"),
    )
    rows[(_S.RUNNING, _E.RESUME)] = (_t(ALWAYS, _S.RUNNING, (), ("reply_resume",), "PR #28037: no-op"),)
    return rows


# ---------------------------------------------------------------------------------------------------
# vLLM 0.32 as shipped (variant vllm-0.32) and weightsync's fix applied to it (vllm-0.32-epoch).
# Paths are inside the installed package (site-packages/vllm/), lines are vLLM 0.32.0's.
# ---------------------------------------------------------------------------------------------------

V032 = "vLLM 0.32 "
C_ADD = V032 + "v1/engine/core.py:2234-2248 (DPEngineCoreProc.add_request)"
C_ABORT = V032 + "v1/engine/core.py:1685-1686 (ABORT)"
C_WAVE = V032 + "v1/engine/core.py:2281-2299 (START_DP_WAVE)"
C_LOOP = (
    V032 + "v1/engine/core.py:2328-2371 (run_busy_loop: a real or dummy batch while work or engines_running)"
)
C_SYNC = (
    V032 + "v1/engine/core.py:2410-2427, config/parallel.py:850-875 (SUM all-reduce of [has_unfinished, "
    "pending_pause] at step_counter == 1 and every dp_sync_interval, default 16: config/parallel.py:162)"
)
C_WAVE_END = (
    V032 + "v1/engine/core.py:2374-2393 (wave end: rank 0 wave_complete, current_wave += 1, step_counter = 0)"
)
C_MIRROR_032 = (
    V032
    + "v1/engine/core.py:2333, 2394-2406 (rank 0 sends start_wave(current_wave) when engines_running was False "
    "at the top of the iteration and no pause is pending after its sync)"
)
C_CONSENSUS = (
    V032 + "v1/engine/core.py:2422-2425 (pause consensus: ignore_start_dp_wave, pending_pause cleared)"
)
C_PAUSE = (
    V032 + "v1/engine/core.py:2061-2103, 2216-2231 (pause_scheduler: mode sets PauseState, abort aborts; "
    "_pause_complete sets pending_pause and engines_running; the reply waits for idle; no check of the "
    "rank's state, so a second pause re-enters phase 1)"
)
C_PAUSE_DONE = (
    V032
    + "v1/engine/core.py:1573-1578, 2081-2087, 914-919 (the pause future resolves when the rank is idle: "
    "synchronize_device, cache reset)"
)
C_RESUME = V032 + "v1/engine/core.py:2250-2273 (DPEngineCoreProc.resume_scheduler)"
C_UTIL_ERR = (
    V032 + "v1/engine/core.py:1736-1752 (an exception is the call's failure_message; the rank is unchanged)"
)
C_RPC = (
    V032
    + "v1/engine/core.py:1073-1080, v1/engine/async_llm.py:1315-1355 (collective_rpc: no engine-level gate; "
    "the worker checks only its own start/active flag, reference s3.7)"
)


def _v032_serving_rows(state: RankState) -> Table:
    """ADD, ABORT and START_DP_WAVE as vLLM 0.32 handles them: the same code in every state."""
    return {
        (state, _E.ADD): (
            _t(
                "add_newer_wave",
                state,
                ("adopt_wave",),
                ("queue_request",),
                C_ADD + ": a newer wave is adopted",
            ),
            _t(
                "add_stale_wave_idle_unpaused",
                state,
                ("set_engines_running",),
                ("queue_request", "emit_start_wave"),
                C_ADD + ": a stale wave on an idle UNPAUSED rank re-arms it and sends start_wave",
            ),
            _t(ALWAYS, state, (), ("queue_request",), C_ADD),
        ),
        (state, _E.ABORT): (_t(ALWAYS, state, (), ("abort_request",), C_ABORT),),
        (state, _E.START_DP_WAVE): (
            _t("wave_for_me_not_ignoring", state, ("adopt_wave", "set_engines_running"), (), C_WAVE),
            _t(
                "wave_dropped",
                state,
                (),
                (),
                C_WAVE
                + ": dropped while ignore_start_dp_wave, when excluded, or when older than current_wave",
            ),
        ),
    }


def _v032_step_rows(state: RankState) -> Table:
    """The loop's step decision with vLLM 0.32's cadence (sync at the wave's first step and every K)."""
    return {
        (state, _E.STEP): (
            _t("k1_step_plain", state, ("enter_dp_step",), ("execute_step", "enter_dp_step"), C_LOOP),
            _t("k1_step_sync", state, ("enter_dp_sync",), ("execute_step", "enter_dp_sync"), C_SYNC),
            _t("idle", state, (), (), C_LOOP + ": idle"),
        )
    }


def _v032_loop_rows(state: RankState, paused: bool) -> Table:
    """STEP, DP_STEP_DONE and DP_SYNC_DONE of a stepping state (running, or phase 1 of a pause when
    ``paused``; there the labels pausing/paused follow the local drain)."""
    rows = _v032_step_rows(state)
    step = ("leave_collective", "count_step_k1", "latch_was_running")
    sync = ("leave_collective", "sync_consensus", "count_step_k1", "latch_was_running")
    stop = ("leave_collective", "sync_consensus", "end_wave_k1", "latch_was_running")
    if not paused:
        rows[(state, _E.DP_STEP_DONE)] = (
            _t("k1_mirror_after_step", state, step, ("emit_start_wave",), C_MIRROR_032),
            _t(ALWAYS, state, step, (), C_LOOP),
        )
        rows[(state, _E.DP_SYNC_DONE)] = (
            _t("k1_sync_keep_mirror", state, sync, ("emit_start_wave",), C_SYNC + "; " + C_MIRROR_032),
            _t("sync_keep_running", state, sync, (), C_SYNC),
            _t("sync_stop", state, stop, ("emit_wave_complete",), C_WAVE_END),
        )
        return rows
    rows[(state, _E.DP_STEP_DONE)] = (
        _t("k1_mirror_after_step_drained", _S.PAUSED, step, ("emit_start_wave",), C_MIRROR_032),
        _t("k1_mirror_after_step_draining", _S.PAUSING, step, ("emit_start_wave",), C_MIRROR_032),
        _t("drained", _S.PAUSED, step, (), C_LOOP + "; weightsync label: drained locally"),
        _t(ALWAYS, _S.PAUSING, step, (), C_LOOP),
    )
    rows[(state, _E.DP_SYNC_DONE)] = (
        _t(
            "sync_stop",
            _S.VERIFIED,
            stop,
            ("emit_wave_complete", "clear_cache", "reply_pause"),
            C_CONSENSUS + "; " + C_WAVE_END + "; " + C_PAUSE_DONE,
        ),
        _t(
            "k1_sync_keep_mirror_drained",
            _S.PAUSED,
            sync,
            ("emit_start_wave",),
            C_CONSENSUS + "; " + C_MIRROR_032,
        ),
        _t(
            "k1_sync_keep_mirror_draining",
            _S.PAUSING,
            sync,
            ("emit_start_wave",),
            C_CONSENSUS + "; " + C_MIRROR_032,
        ),
        _t("drained", _S.PAUSED, sync, (), C_SYNC + "; " + C_CONSENSUS),
        _t(ALWAYS, _S.PAUSING, sync, (), C_SYNC + "; " + C_CONSENSUS),
    )
    return rows


def _v032_pause_rows(state: RankState) -> Table:
    upd = ("set_pause_state", "set_pending_pause", "set_engines_running")
    return {
        (state, _E.PAUSE): (
            _t("pause_abort", _S.PAUSED, upd, ("abort_requests",), C_PAUSE + " (abort)"),
            _t("pause_drains_now", _S.PAUSED, upd, (), C_PAUSE),
            _t("pause_must_drain", _S.PAUSING, upd, (), C_PAUSE + " (wait drains)"),
        )
    }


def _v032_resume_rows(state: RankState) -> Table:
    return {
        (state, _E.RESUME): (
            _t(
                "resume_in_flight",
                state,
                (),
                ("refuse",),
                C_RESUME + ": RuntimeError while a pause is in flight; " + C_UTIL_ERR,
            ),
            _t("engines_running", state, (), ("reply_resume",), C_RESUME + ": a no-op while engines_running"),
            _t(
                ALWAYS,
                _S.RESUMING,
                ("unpause", "clear_ignore_start_dp_wave", "enter_resume_barrier"),
                ("enter_resume_barrier",),
                C_RESUME + ": UNPAUSED, ignore_start_dp_wave cleared, MAX all-reduce of has_unfinished",
            ),
        )
    }


def _v032_weight_rows(state: RankState) -> Table:
    """The weight-transfer calls as vLLM 0.32 runs them: in any state; only the worker's own flags decide
    (the model passes them as the ``worker`` / ``worker_initialized`` arguments). A worker refusal is a
    non-sticky error reply."""
    refuse = _t(ALWAYS, state, (), ("refuse",), C_RPC + ": the worker raises; " + C_UTIL_ERR)
    return {
        (state, _E.INIT_TRANSFER): (
            _t(
                "worker_not_active",
                state,
                ("enter_transfer_init",),
                ("enter_transfer_init",),
                C_RPC + " (vLLM re-inits even mid-round; the worker table refuses that)",
            ),
            refuse,
        ),
        (state, _E.TRANSFER_INIT_DONE): (_t(ALWAYS, state, ("leave_collective",), ("reply",), C_RPC),),
        (state, _E.START_UPDATE): (
            _t("worker_can_start", state, (), ("start_weight_update", "reply"), C_RPC),
            refuse,
        ),
        (state, _E.UPDATE_WEIGHTS): (
            _t("worker_active", state, ("enter_weight_broadcast",), ("enter_weight_broadcast",), C_RPC),
            refuse,
        ),
        (state, _E.WEIGHT_BROADCAST_DONE): (_t(ALWAYS, state, ("leave_collective",), ("reply",), C_RPC),),
        (state, _E.FINISH_UPDATE): (
            _t("worker_active", state, (), ("finish_weight_update",), C_RPC),
            refuse,
        ),
        (state, _E.FINISH_DONE): (
            _t(
                ALWAYS,
                state,
                ("set_weight_version",),
                ("reply",),
                C_RPC + "; v1/engine/async_llm.py:1351-1355 (finish_weight_update(weight_version))",
            ),
        ),
        (state, _E.TRANSFER_FAILED): (
            _t(
                "failed_init",
                state,
                ("leave_collective",),
                ("fail_init", "reply_failure"),
                C_RPC + ": a failed init is an error reply",
            ),
            _t(
                ALWAYS,
                state,
                ("leave_collective",),
                ("fail_round", "reply_failure"),
                C_RPC + ": a failed update resets the worker to ready; the rank is unchanged",
            ),
        ),
    }


R_EPOCH_032 = "weightsync vllm-0.32-epoch"


def vllm032_table(epoch: bool) -> Table:
    """vLLM 0.32's DP pause/resume (``epoch=False``, variant ``vllm-0.32``) or weightsync's fix applied to
    it (``epoch=True``, variant ``vllm-0.32-epoch``).

    vllm-0.32 has no weightsync states beyond vLLM's variables: the labels running / pausing / paused /
    verified / resuming name (pause_state, pending_pause, ignore_start_dp_wave) combinations, a weight
    round leaves the label unchanged (the worker machine holds it), and every call is legal in every state
    where the busy loop can take it (a refusal is an error reply, the rank unchanged: non-sticky).

    vllm-0.32-epoch adds: the resume all-reduce carries [has_unfinished, current_wave] with MAX, every rank
    adopts MAX + 1 and resets its step counter; a resume is a no-op on a running rank; the round is the
    state ``updating`` (start only when verified, update and finish only while updating, each refused
    otherwise), a pause on a verified rank returns at once, a pause or resume during an update is refused;
    weightsync's failure handling (state ``failed``).
    """
    rows: Table = {}
    for s in (_S.RUNNING, _S.PAUSING, _S.PAUSED, _S.VERIFIED):
        rows.update(_v032_serving_rows(s))
        rows.update(_v032_pause_rows(s))
        rows.update(_v032_resume_rows(s))
    rows.update(_v032_loop_rows(_S.RUNNING, paused=False))
    rows.update(_v032_loop_rows(_S.PAUSING, paused=True))
    rows.update(_v032_loop_rows(_S.PAUSED, paused=True))
    # verified: nothing schedulable and engines_running False, so the loop is idle (no DONE rows: a step
    # here would be a protocol error the checker reports)
    rows.update(_v032_step_rows(_S.VERIFIED))
    barrier: tuple[str, ...] = ("leave_collective", "running_from_barrier")
    rule = C_RESUME + ": has_unfinished MAX sets engines_running; the wave is not re-based"
    if epoch:
        barrier += ("adopt_wave_after_barrier", "reset_step_counter")
        rule = (
            R_EPOCH_032
            + ": the resume all-reduce carries [has_unfinished, current_wave] (MAX); every rank adopts "
            "MAX + 1 and resets step_counter"
        )
    rows[(_S.RESUMING, _E.RESUME_BARRIER_DONE)] = (_t(ALWAYS, _S.RUNNING, barrier, ("reply_resume",), rule),)
    if epoch:
        # The coordinator does not latch, so it learns the re-based wave from rank 0: an idle resume ends
        # wave MAX (wave_complete(MAX)); a busy one starts MAX + 1 (the mirror start_wave after the first
        # step: engines_running was False at the top of that iteration).
        rows[(_S.RESUMING, _E.RESUME_BARRIER_DONE)] = (
            _t(
                "barrier_idle",
                _S.RUNNING,
                barrier,
                ("emit_wave_complete", "reply_resume"),
                rule + "; rank 0 reports the idle resume as wave_complete(MAX)",
            ),
            _t(ALWAYS, _S.RUNNING, barrier, ("reply_resume",), rule),
        )
    if not epoch:
        for s in (_S.RUNNING, _S.PAUSING, _S.PAUSED, _S.VERIFIED):
            rows.update(_v032_weight_rows(s))
        return rows
    # ---- the fix
    rows[(_S.RUNNING, _E.RESUME)] = (
        _t(
            ALWAYS, _S.RUNNING, (), ("reply_resume",), R_EPOCH_032 + ": a resume on a running rank is a no-op"
        ),
    )
    rows[(_S.VERIFIED, _E.PAUSE)] = (
        _t(
            ALWAYS,
            _S.VERIFIED,
            (),
            ("reply_pause",),
            R_EPOCH_032 + ": a pause on a verified rank returns at once",
        ),
    )
    rows.update(_v032_serving_rows(_S.UPDATING))
    rows.update(_v032_step_rows(_S.UPDATING))
    rows.update(
        {
            k: tuple(
                tr._replace(rule=f"{R_EPOCH_032} (weightsync's round and failure rows): {tr.rule}")
                for tr in trs
            )
            for k, trs in _transfer_rows().items()
        }
    )
    refuse = R_EPOCH_032 + ": refused (an error reply, the rank unchanged)"
    for e in (_E.PAUSE, _E.RESUME):
        rows[(_S.UPDATING, e)] = (_t(ALWAYS, _S.UPDATING, (), ("refuse",), refuse + " during an update"),)
    for s in (_S.RUNNING, _S.PAUSING, _S.PAUSED, _S.VERIFIED, _S.UPDATING):
        for e in (_E.INIT_TRANSFER, _E.START_UPDATE, _E.UPDATE_WEIGHTS, _E.FINISH_UPDATE):
            if (s, e) not in rows:
                rows[(s, e)] = (
                    _t(ALWAYS, s, (), ("refuse",), refuse + ": weight calls only inside a pause"),
                )
    return rows


@dataclass(frozen=True)
class Variant:
    """A protocol variant: a table plus the facts the model needs about it.

    Attributes:
        name: CLI name.
        description: one line.
        source: where it comes from.
        table: ``{(RankState, RankEvent): (Transition, ...)}``.
        pause_in_front_end: pause/resume are answered by the API front-end without reaching engines.
        resume_barrier_carries_wave: the resume all-reduce also carries MAX(current_wave).
        expected: what the model checker should find under per-socket channels ("verified" or
            "counterexample").
        verified_channels: channel semantics under which the variant is expected to verify.
        coordinator_latches: the DP coordinator sets engines_running when it broadcasts START_DP_WAVE for a
            FIRST_REQ (before vLLM's fix of issue #51476); False: only the engines' own reports
            (start_wave, wave_complete) move it (vLLM 0.32 ``v1/engine/coordinator.py:363-375``).
        first_req_exclusion: the START_DP_WAVE the coordinator broadcasts for a FIRST_REQ excludes the rank the
            request went to. False: vLLM 0.32, where the front-end names the target by its bytes identity
            and the engine compares it with its int index (``v1/engine/core_client.py:1592`` ->
            ``v1/engine/core.py:2288``), so the exclusion never matches and the target takes the wave too. weightsync's two-phase-epoch
            drops it on purpose: with the exclusion the target rank drops the wake-up, the client aborts the
            request before that rank steps, and its woken peer steps alone into ``dp_step`` (a one-sided
            collective; ``proofs`` row ``client-abort``).
        worker_flags_decide: weight-transfer calls reach the table with the worker's state as arguments
            (``worker``, ``worker_initialized``) and the table's rows decide by them (vLLM 0.32: no engine-level
            gate, the worker checks only its own flags).
        untracked_replies: the model accounts for the deferred replies of untracked calls (a second pause, an
            early or retried resume) per rank, so a reply they cause is not a spurious reply; a refused resume
            does not end the rank's pause (the vllm-0.32 variants, whose refusals are error replies).
    """

    name: str
    description: str
    source: str
    table: Table = field(repr=False)
    pause_in_front_end: bool = False
    resume_barrier_carries_wave: bool = False
    expected: str = "counterexample"
    verified_channels: tuple[str, ...] = ()
    coordinator_latches: bool = True
    first_req_exclusion: bool = True
    worker_flags_decide: bool = False
    untracked_replies: bool = False

    def expected_verdict(self, channels: str) -> str:
        """ "verified" if the variant should verify under ``channels``, else "counterexample"."""
        return "verified" if channels in self.verified_channels else "counterexample"

    def digest(self) -> str:
        """SHA-256 of this variant's table rows (sorted)."""
        rows = sorted(
            ((s, e, tr) for (s, e), trs in self.table.items() for tr in trs),
            key=lambda r: (r[0].value, r[1].value),
        )
        # Environment flags added later enter the digest only when they differ from their defaults, so the
        # digests of the variants that predate them do not move.
        extra = [
            f"{name}={getattr(self, name)}"
            for name, default in (
                ("worker_flags_decide", False),
                ("untracked_replies", False),
            )
            if getattr(self, name) != default
        ]
        return table_digest(
            rows,
            self.name,
            str(self.pause_in_front_end),
            str(self.resume_barrier_carries_wave),
            str(self.coordinator_latches),
            str(self.first_req_exclusion),
            *extra,
        )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "two-phase-epoch",
            "two-phase pause/resume whose resume barrier agrees on the wave (MAX(current_wave) + 1), a "
            "resume that is a no-op unless verified, and vLLM 0.32's non-latching coordinator",
            "weightsync: closes the resume-time race of two-phase and the stray-resume deadlock",
            two_phase_table(epoch=True, safe_resume=True, mirror_start_wave=True),
            resume_barrier_carries_wave=True,
            expected="verified",
            verified_channels=("per-socket", "ordered"),
            coordinator_latches=False,
            first_req_exclusion=False,
        ),
        Variant(
            "two-phase",
            "vLLM's two-phase pause/resume as shipped: honour waves until consensus, resume is a barrier",
            "vLLM PR #39366",
            two_phase_table(epoch=False),
            verified_channels=("ordered",),
        ),
        Variant(
            "front-end-pause",
            "pause held in the API front-end; engines keep stepping and honouring waves",
            "vLLM PR #28037 (before PR #34125); the blog's DP=2 scenario",
            front_end_pause_table(),
            pause_in_front_end=True,
        ),
        Variant(
            "idle-fast-path",
            "engine pause returns at once when idle; a late START_DP_WAVE re-arms it",
            "vLLM issue #36594",
            _engine_pause_table(ignore_waves_while_paused=False),
        ),
        Variant(
            "ignore-wave",
            "a paused engine ignores START_DP_WAVE at once",
            "vLLM PR #36608 (closed, rejected)",
            _engine_pause_table(ignore_waves_while_paused=True),
        ),
        Variant(
            "vllm-0.32",
            "vLLM 0.32 as shipped: sync at step 1 and every K, non-latching coordinator, rank 0's mirror "
            "start_wave, a FIRST_REQ exclusion that never matches, resume errors and a second pause accepted, "
            "weight calls in any state, non-sticky errors",
            "vLLM 0.32.0 v1/engine/core.py, coordinator.py, core_client.py (reference vllm-0.32.md s3)",
            vllm032_table(epoch=False),
            verified_channels=("ordered",),
            coordinator_latches=False,
            first_req_exclusion=False,
            worker_flags_decide=True,
            untracked_replies=True,
        ),
        Variant(
            "vllm-0.32-epoch",
            "weightsync's fix on vLLM 0.32: the resume all-reduce agrees on MAX(current_wave) + 1 and resets the "
            "step counter; a resume is a no-op unless verified; weight calls only inside a pause; a pause or "
            "resume during an update refused",
            "weightsync on vLLM 0.32.0 (the environment of vllm-0.32 unchanged)",
            vllm032_table(epoch=True),
            resume_barrier_carries_wave=True,
            expected="verified",
            verified_channels=("per-socket", "ordered", "one-api-server"),
            coordinator_latches=False,
            first_req_exclusion=False,
            untracked_replies=True,
        ),
    )
}

DEFAULT_VARIANT = "two-phase-epoch"


def get_variant(name: str) -> Variant:
    """The variant called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known variants).
    """
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown protocol variant {name!r}; known variants: {', '.join(VARIANTS)}"
        ) from None


def spec_digest() -> str:
    """One digest over every variant's table and the worker table (``weightsync prove --check``)."""
    from weightsync.spec.worker import worker_table_digest

    return table_digest((), *(v.digest() for v in VARIANTS.values()), worker_table_digest())


def select(
    table: Table,
    v: RankVars,
    event: RankEvent,
    args: Args,
    guards: Mapping[str, Callable[[RankVars, Args], bool]] = GUARDS,
) -> Transition | None:
    """The transition ``event`` takes from ``v`` under ``table`` (first guard that holds), or None.

    ``guards`` defaults to :data:`GUARDS`; the model checker's mutation test passes an extended registry.
    """
    return select_transition(table, v.state, event, v, args, guards)


def apply(
    v: RankVars,
    tr: Transition,
    args: Args,
    updates: Mapping[str, Callable[[RankVars, Args], RankVars]] = UPDATES,
) -> RankVars:
    """Apply ``tr``'s updates to ``v`` and move to its target (pure; used by the model's hot loop)."""
    return apply_transition(v, tr, args, updates)


class RankMachine(TableMachine[RankState, RankEvent]):
    """Sans-IO protocol machine of one DP engine rank.

    ``fire(event, **args)`` returns a :class:`~weightsync.spec.table.Fired`; the caller runs
    ``fired.transition.effects`` (see :data:`EFFECTS`). No I/O, no torch, no threads.

    Args:
        rank: DP rank index (0 is the rank that emits wave_complete).
        dp_size: number of DP ranks.
        variant: protocol variant name (default ``two-phase-epoch``).
        sync_interval: K, the DP sync all-reduce cadence in steps (PR #21617: 32; vLLM 0.32: 16).

    Raises:
        ValueError: unknown variant, rank outside ``[0, dp_size)``, or ``sync_interval < 1``.
        LocalProtocolError / RemoteProtocolError from ``fire`` (then the machine is in ``error``).
    """

    def __init__(
        self, rank: int, dp_size: int, variant: str = DEFAULT_VARIANT, sync_interval: int = 32
    ) -> None:
        if not 0 <= rank < dp_size:
            raise ValueError(f"rank {rank} is outside [0, dp_size={dp_size})")
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        self.variant = get_variant(variant)
        self.rank = rank
        self.dp_size = dp_size
        self.sync_interval = sync_interval
        super().__init__(
            f"rank {rank}",
            self.variant.table,
            GUARDS,
            UPDATES,
            RankVars(),
            LOCAL_CALLS,
            RankState.ERROR,
        )

    def _with_rank(self, args: Mapping[str, Any]) -> dict[str, Any]:
        full = {"rank": self.rank, "dp_size": self.dp_size, "sync_interval": self.sync_interval}
        full.update(args)
        return full

    def select(self, event: RankEvent, args: Mapping[str, Any]) -> Transition | None:
        """The row ``event`` would take now (``rank``, ``dp_size``, ``sync_interval`` supplied), or None."""
        return super().select(event, self._with_rank(args))

    def explain_illegal(self, event: RankEvent, args: Mapping[str, Any]) -> str:
        """The error text of an illegal ``event`` (see :meth:`TableMachine.explain_illegal`)."""
        return super().explain_illegal(event, self._with_rank(args))

    def fire(self, event: RankEvent, **args: Any) -> Fired:
        """Fire ``event``; ``rank``, ``dp_size`` and ``sync_interval`` are supplied automatically."""
        args.setdefault("rank", self.rank)
        args.setdefault("dp_size", self.dp_size)
        args.setdefault("sync_interval", self.sync_interval)
        return super().fire(event, **args)
