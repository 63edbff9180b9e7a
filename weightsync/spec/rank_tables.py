"""The rank tables of the two-phase variants (vLLM PR #39366 and weightsync's ``two-phase-epoch``) and of
the historical pause designs (the idle fast path of issue #36594, PR #36608's ignored waves, PR #28037's
front-end pause), keyed by ``(RankState, RankEvent)``; their guards, updates and effects are named in
:mod:`weightsync.spec.rank_vars`."""

from __future__ import annotations

from weightsync.spec.states import RankEvent, RankState
from weightsync.spec.table import ALWAYS, Transition

_S = RankState
_E = RankEvent
Table = dict[tuple[RankState, RankEvent], tuple[Transition, ...]]


def _t(
    guard: str, target: RankState, updates: tuple[str, ...], effects: tuple[str, ...], rule: str
) -> Transition:
    return Transition(guard, target, updates, effects, rule)


R39366 = "vLLM PR #39366 (two-phase pause/resume)"
R_WAVES = "vLLM 0.32 v1/engine/core.py:2234-2248, 2281-2299, 2328-2393 (DP waves)"
R_ABORT = "vLLM 0.32 v1/engine/core.py:1685-1686 (ABORT)"
R_INIT = "vLLM 0.32 v1/engine/async_llm.py:1315-1326, v1/worker/gpu_worker.py:1484-1496"
R_START = "vLLM 0.32 v1/engine/async_llm.py:1332-1334, v1/worker/gpu_worker.py:1507-1548"
R_UPDATE = "vLLM 0.32 v1/engine/async_llm.py:1340-1349, v1/worker/gpu_worker.py:1550-1585"
R_FINISH = "vLLM 0.32 v1/engine/async_llm.py:1351-1355, v1/worker/gpu_worker.py:1587-1604"
R_PAUSE = "vLLM 0.32 v1/engine/core.py:2061-2103 (EngineCoreProc.pause_scheduler)"
R_RESUME = "vLLM 0.32 v1/engine/core.py:951-953 (resume_scheduler)"


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
    rows[(state, _E.ABORT)] = (_t(ALWAYS, state, (), ("abort_request",), R_ABORT),)
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
R_INIT_GATE = (
    "weightsync patch 0008: init only before the rank served or while paused (a rank in the rendezvous "
    "cannot take its part in a wave's DP step: tests/test_vllm_moe_dp.py)"
)


def _transfer_rows() -> Table:
    """verified -> updating -> verified, with failures as rows (weightsync); init legal in verified and
    failed, and in running only without DP peers or before the rank served (guard ``alone_or_never_served``;
    a served DP rank refuses).
    ``finish_weight_update`` moves the version only on FINISH_DONE, after the workers' finish returned;
    every failure (TRANSFER_FAILED) leaves the round in ``failed``, and a new round recovers it."""
    start = _t(ALWAYS, _S.UPDATING, (), ("start_weight_update", "reply"), R_START)
    rows: Table = {
        (_S.VERIFIED, _E.START_UPDATE): (start,),
        (_S.FAILED, _E.START_UPDATE): (
            start._replace(rule="weightsync: a new round recovers a failed rank"),
        ),
        (_S.UPDATING, _E.UPDATE_WEIGHTS): (
            _t(ALWAYS, _S.UPDATING, ("enter_weight_broadcast",), ("enter_weight_broadcast",), R_UPDATE),
        ),
        (_S.UPDATING, _E.WEIGHT_BROADCAST_DONE): (
            _t(ALWAYS, _S.UPDATING, ("leave_collective",), ("reply",), R_UPDATE),
        ),
        (_S.UPDATING, _E.FINISH_UPDATE): (
            _t(
                ALWAYS,
                _S.UPDATING,
                (),
                ("finish_weight_update",),
                R_FINISH + "; outcome as an event: weightsync",
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
                R_FINISH + ": finish_weight_update(weight_version); moves only on success",
            ),
        ),
        (_S.UPDATING, _E.TRANSFER_FAILED): (
            _t(ALWAYS, _S.FAILED, ("leave_collective", "fail_stop"), ("fail_round", "reply_failure"), R_FAIL),
        ),
    }
    for s in (_S.RUNNING, _S.VERIFIED, _S.FAILED):
        rows[(s, _E.INIT_TRANSFER)] = (
            _t(ALWAYS, s, ("enter_transfer_init",), ("enter_transfer_init",), R_INIT),
        )
        if s is _S.RUNNING:
            rows[(s, _E.INIT_TRANSFER)] = (
                _t(
                    "alone_or_never_served",
                    s,
                    ("enter_transfer_init",),
                    ("enter_transfer_init",),
                    R_INIT_GATE,
                ),
                _t(ALWAYS, s, (), ("refuse",), R_INIT_GATE + ": refused once the rank served"),
            )
        rows[(s, _E.TRANSFER_INIT_DONE)] = (_t(ALWAYS, s, ("leave_collective",), ("reply",), R_INIT),)
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


def _stepping_rows(
    state: RankState, honour_waves: bool, stale_add_rearms: bool, mirror_start_wave: bool = False
) -> Table:
    """A state that serves and steps in waves: its serving rows, its step rows and its wave sync (keep
    running, or stop and report the wave complete). ``mirror_start_wave``: as :func:`_step_done_rows`."""
    rows = _serving_rows(state, honour_waves=honour_waves, stale_add_rearms=stale_add_rearms, may_step=True)
    rows.update(_step_done_rows(state, mirror_start_wave=mirror_start_wave))
    keep = _t("sync_keep_running", state, ("leave_collective", "count_step"), (), R_WAVES)
    mirror: tuple[Transition, ...] = ()
    if mirror_start_wave:
        # vLLM 0.32 checks the sync result first (engines_running), then the edge; a wave that stops at
        # its first sync ends (wave_complete) without a start_wave.
        mirror = (
            _t(
                "sync_keep_running_first_rank0",
                state,
                ("leave_collective", "count_step", "mark_wave_started"),
                ("emit_start_wave",),
                R_MIRROR,
            ),
        )
    rows[(state, _E.DP_SYNC_DONE)] = (
        *mirror,
        keep,
        _t("sync_stop", state, ("leave_collective", "end_wave"), ("emit_wave_complete",), R_WAVES),
    )
    return rows


#: weightsync patch 0005: a wait-mode pause drains every request queued on the rank when the pause arrives
#: (vLLM 0.32 leaves them queued under PAUSED_NEW, ``v1/core/sched/scheduler.py:900-917``, since
#: ``_process_input_queue`` handles every queued message before the next step, ``v1/engine/core.py:1573-1601``).
R_DRAIN_QUEUED = (
    "weightsync patch 0005: a wait-mode pause drains the requests queued before it (vLLM 0.32 "
    "v1/core/sched/scheduler.py:900-917 leaves them queued under PAUSED_NEW)"
)


#: weightsync patch 0007 (a pause retried across the consensus round; found by the model under
#: ``--repeat-pause``, ``progress_pause``, and reproduced on real vLLM: ``tests/test_vllm_retried_pause.py``)
R_JOIN_CONSENSUS = (
    "weightsync patch 0007: a pause that reaches a rank past the DP pause consensus while it still drains "
    "joins that pause: it changes nothing and returns when the rank is idle (vLLM 0.32 "
    "v1/engine/core.py:2216-2231 sets pending_pause again, and sync_dp_state, config/parallel.py:850-875, "
    "then never sees every rank pending: the ranks step dummy batches forever)"
)


def drain_queued_row(updates: tuple[str, ...], guard: str = "pause_drains_queued") -> Transition:
    """The fixed variants' pause row for a wait-mode pause that finds queued requests: the rank drains them
    with its running ones (effect ``admit_waiting``) before its pause completes. ``guard`` names when."""
    return _t(guard, _S.PAUSING, updates, ("admit_waiting",), R_DRAIN_QUEUED)


def _running_rows(stale_add_rearms: bool = True, mirror_start_wave: bool = False) -> Table:
    return _stepping_rows(_S.RUNNING, True, stale_add_rearms, mirror_start_wave)


def two_phase_table(epoch: bool, safe_resume: bool = False, mirror_start_wave: bool = False) -> Table:
    """vLLM PR #39366 as shipped (``epoch=False``) or weightsync's ``two-phase-epoch`` fix (``epoch=True``).

    ``safe_resume``: a resume on a running rank is a local no-op, whatever its engines_running (weightsync; vLLM's rule, "no-op
    if engines_running", is a per-rank belief, and a stray resume with one rank busy and one idle sends
    the idle one alone into the resume barrier). ``mirror_start_wave``: rank 0 reports the not-running ->
    running edge to the coordinator (vLLM 0.32), which then no longer latches on FIRST_REQ.
    """
    rows = _running_rows(mirror_start_wave=mirror_start_wave)
    pause_updates = ("set_pause_state", "set_pending_pause", "set_engines_running")
    # Only mode=abort aborts requests (vLLM 0.32 core.py:2088-2092); keep freezes them and wait drains the
    # running ones.
    rows[(_S.RUNNING, _E.PAUSE)] = (
        _t("pause_abort", _S.PAUSED, pause_updates, ("abort_requests",), R39366 + " phase 1 (abort)"),
        *((drain_queued_row(pause_updates),) if epoch else ()),
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
    if epoch:
        rows.update(_repeated_pause_rows(pause_updates))
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
                "weightsync: a resume on a running rank is a local no-op (stray, repeated or racing "
                "resumes are safe)",
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


R_REPEAT_PAUSE = (
    "weightsync two-phase-epoch: a pause at a rank whose pause is in flight, before the consensus, is "
    "taken like the first (vLLM 0.32 v1/engine/core.py:2061-2103 sets the PauseState and pending_pause "
    "again); one at a verified rank returns at once (weightsync patch 0006)"
)


def _repeated_pause_rows(pause_updates: tuple[str, ...]) -> Table:
    """``two-phase-epoch``'s rows for a pause while paused (an orchestrator's retry, a second controller, or a
    pause in another mode; ``weightsync check --mode any --repeat-pause``), as the upstream patches 0005-0007
    make vLLM 0.32 take it (:mod:`~weightsync.spec.rank_vllm032`):

    - past the consensus while the rank still drains: it joins the pause in progress (patch 0007);
    - before the consensus: the pause's mode applies again; a wait that finds keep's PAUSED_ALL drains the
      requests queued before it (patch 0005);
    - verified: a no-op that returns at once (patch 0006).
    """
    rows: Table = {}
    for s in (_S.PAUSING, _S.PAUSED):
        rows[(s, _E.PAUSE)] = (
            _t("pause_joins_consensus", s, (), (), R_JOIN_CONSENSUS),
            _t("pause_abort", _S.PAUSED, pause_updates, ("abort_requests",), R_REPEAT_PAUSE + " (abort)"),
            drain_queued_row(pause_updates, "pause_drains_queued_entering_paused_new"),
            _t("pause_drains_now", _S.PAUSED, pause_updates, (), R_REPEAT_PAUSE),
            _t("pause_must_drain", _S.PAUSING, pause_updates, (), R_REPEAT_PAUSE + " (wait drains)"),
        )
    rows[(_S.VERIFIED, _E.PAUSE)] = (
        _t(ALWAYS, _S.VERIFIED, (), ("reply_pause",), R_REPEAT_PAUSE + ": verified, a no-op"),
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
        _t("pause_abort_busy", _S.PAUSED, pause_updates, ("abort_requests",), R_PAUSE + " (abort)"),
        _t("pause_drains_now_busy", _S.PAUSED, pause_updates, (), R_PAUSE),
        _t("pause_must_drain", _S.PAUSING, pause_updates, (), R_PAUSE + " (wait drains)"),
    )
    for s in (_S.PAUSING, _S.PAUSED):
        rows.update(_serving_rows(s, honour_waves=honour, stale_add_rearms=False, may_step=True))
        rows[(s, _E.DP_SYNC_DONE)] = (
            _t(
                "sync_stop",
                _S.VERIFIED,
                ("leave_collective", "end_wave"),
                ("emit_wave_complete", "clear_cache", "reply_pause"),
                R_PAUSE + ": completes when idle",
            ),
            _t("drained", _S.PAUSED, ("leave_collective", "count_step"), (), R_WAVES),
            _t("not_drained", _S.PAUSING, ("leave_collective", "count_step"), (), R_WAVES),
        )
    rows.update(_step_done_rows(_S.PAUSING, drained_target=_S.PAUSED))
    rows.update(_step_done_rows(_S.PAUSED))
    # A paused (verified/updating) engine still honours START_DP_WAVE and steps when re-armed: issue #36594.
    for s in (_S.VERIFIED, _S.UPDATING):
        rows.update(_stepping_rows(s, honour_waves=honour, stale_add_rearms=False))
    rows.update(_transfer_rows())
    for s in (_S.VERIFIED, _S.PAUSING, _S.PAUSED):
        rows[(s, _E.RESUME)] = (_t(ALWAYS, _S.RUNNING, ("unpause",), ("reply_resume",), R_RESUME),)
    rows[(_S.RUNNING, _E.RESUME)] = (_t(ALWAYS, _S.RUNNING, (), ("reply_resume",), R_RESUME + ": no-op"),)
    return rows


def front_end_pause_table() -> Table:
    """Pause held in the API front-end (PR #28037, before PR #34125): engines never pause."""
    rows = _running_rows()
    rows[(_S.RUNNING, _E.PAUSE)] = (
        _t(ALWAYS, _S.VERIFIED, (), ("front_end_gate", "reply_pause"), "PR #28037: a flag in AsyncLLM"),
    )
    for s in (_S.VERIFIED, _S.UPDATING):
        rows.update(_stepping_rows(s, honour_waves=True, stale_add_rearms=True))
    rows.update(_transfer_rows())
    rows[(_S.VERIFIED, _E.RESUME)] = (
        _t(ALWAYS, _S.RUNNING, (), ("front_end_ungate", "reply_resume"), "PR #28037"),
    )
    rows[(_S.RUNNING, _E.RESUME)] = (_t(ALWAYS, _S.RUNNING, (), ("reply_resume",), "PR #28037: no-op"),)
    return rows
