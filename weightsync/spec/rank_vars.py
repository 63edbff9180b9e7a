"""One DP engine rank's local variables (vLLM's names) and the named guards, updates and effects every rank
table uses (:mod:`weightsync.spec.rank_tables`, :mod:`weightsync.spec.rank_vllm032`).

Event arguments (``args``) used by the guards:

- every event: ``rank`` (DP rank index), ``dp_size``, ``sync_interval`` (K; 32 in PR #21617, 16 in vLLM
  0.32) -- injected by :class:`weightsync.spec.rank.RankMachine` or by the model checker;
- weight-transfer calls in ``vllm-0.32``: ``worker`` (the worker machine's state) and ``worker_initialized``;
- ``PAUSE``: ``mode`` (:class:`PauseMode`), ``clear_cache`` (bool), ``running`` (requests running on
  this rank now, i.e. what ``wait`` must drain), ``waiting`` (requests queued on this rank and not yet
  scheduled: what vLLM 0.32's ``wait`` leaves queued and the fixed variants' ``wait`` drains too);
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
from typing import Any, NamedTuple

from weightsync.spec.states import PAUSE_STATE_OF_MODE, PauseMode, PauseState, RankState


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


def wave_dropped_for_good(v: RankVars, rank: int, wave: int, exclude: int) -> bool:
    """A START_DP_WAVE(``wave``, ``exclude``) that rank ``rank``, with variables ``v``, drops now and in every
    later state: its wave is older than ``v.current_wave``, or it excludes the rank and its wave is not
    newer. vLLM 0.32 acts on START_DP_WAVE only when ``exclude_eng_index != self.engine_index and new_wave >=
    self.current_wave`` (``v1/engine/core.py:2284-2297``), and ``current_wave`` never decreases (every row
    that moves it adopts a wave at least as new, or the resume barrier's ``MAX + 1``). Not a guard of any
    table: the model checker's silent-wave reduction (:mod:`weightsync.model.system.reduction`) removes such
    a message, and checks both premises against the table in use on every rank state and every transition
    it explores."""
    return wave < v.current_wave or (exclude == rank and wave <= v.current_wave)


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


def version_older(new: int | str, served: int | str) -> bool:
    """The opt-in monotonic guard's rule: ``new`` would move the served version backwards
    (:func:`version_order`). The rank table's ``version_older`` row and the trainer's check before
    ``start_weight_update`` (:meth:`weightsync.impl.transfer.trainer.TrainerEngine.send_weights`) both ask it.

    Raises:
        ValueError: a version :func:`version_order` cannot order.
    """
    return version_order(new) < version_order(served)


def _version_older(v: RankVars, a: Args) -> bool:
    new = a.get("weight_version")
    return bool(a.get("monotonic")) and new is not None and version_older(new, v.weight_version)


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


def _drains_queued(v: RankVars, a: Args) -> bool:
    """A wait-mode pause finds requests queued before it (weightsync patch 0005: it drains them)."""
    return PauseMode(a["mode"]) is PauseMode.WAIT and int(a["waiting"]) > 0


def _drains_queued_entering_paused_new(v: RankVars, a: Args) -> bool:
    """Patch 0005 as ``Scheduler.set_pause_state`` runs it: a wait-mode pause records the queued requests
    when the scheduler enters PAUSED_NEW from another PauseState (UNPAUSED, or keep's PAUSED_ALL while that
    pause is in flight); one that finds PAUSED_NEW already (an abort or wait pause in flight) leaves the
    recorded set alone."""
    return _drains_queued(v, a) and v.pause_state is not PauseState.PAUSED_NEW


def _joins_consensus(v: RankVars, a: Args) -> bool:
    """Patch 0007: the rank is past the DP pause consensus (``ignore_start_dp_wave``) and still drains
    (``engines_running``), so a pause joins the one in progress."""
    return v.ignore_start_dp_wave and v.engines_running


GUARDS: dict[str, Callable[[RankVars, Args], bool]] = {
    # loop
    "step_plain": lambda v, a: _works(v, a) and not _is_sync_step(v, a),
    "step_sync": lambda v, a: _works(v, a) and _is_sync_step(v, a),
    "idle": lambda v, a: not _works(v, a),
    "drained": lambda v, a: not bool(a["has_work"]),
    "not_drained": lambda v, a: bool(a["has_work"]),
    # DP sync all-reduce outcomes (vLLM 0.32 config/parallel.py:850-875, v1/engine/core.py:2410-2427)
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
    "pause_drains_queued": _drains_queued,
    "pause_drains_queued_entering_paused_new": _drains_queued_entering_paused_new,
    "pause_joins_consensus": _joins_consensus,
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
    # the transfer init gate (weightsync patch 0008, DPEngineCoreProc only): a running rank joins the
    # rendezvous only if no DP peer steps with it (dp_size 1: vLLM's EngineCoreProc, no gate) or it never
    # served (no wave ended or was re-based by a resume, none running)
    "alone_or_never_served": lambda v, a: (
        int(a["dp_size"]) == 1 or (v.current_wave == 0 and not v.engines_running)
    ),
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
    "admit_waiting": "a wait-mode pause drains the requests queued before it: the scheduler may start them "
    "under PAUSED_NEW (and counts them unfinished) until they finish; requests added after the pause stay "
    "queued (weightsync patch 0005)",
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

#: Effects that act on some DP ranks only, with those ranks; every other effect acts on every rank. Only
#: DP rank 0 tells the coordinator that a wave ended (vLLM 0.32 ``v1/engine/core.py:2376-2390``: ``if
#: self.dp_rank == 0 or not self.has_coordinator``, the coordinator case).
EFFECT_RANKS: dict[str, frozenset[int]] = {"emit_wave_complete": frozenset({0})}


def effect_acts_on(effect: str, rank: int) -> bool:
    """Whether the table's ``effect`` acts on DP rank ``rank`` (:data:`EFFECT_RANKS`); the model and the
    engine both ask, so neither decides by rank itself."""
    ranks = EFFECT_RANKS.get(effect)
    return ranks is None or rank in ranks
