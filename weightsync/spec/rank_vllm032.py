"""The rank tables of vLLM 0.32 as shipped (variant ``vllm-0.32``) and of weightsync's fix applied to it
(``vllm-0.32-epoch``). Paths are inside the installed package (site-packages/vllm/), lines are vLLM
0.32.0's."""

from __future__ import annotations

from weightsync.spec.rank_tables import (
    _E,
    _S,
    R_JOIN_CONSENSUS,
    Table,
    _t,
    _transfer_rows,
    drain_queued_row,
)
from weightsync.spec.states import RankState
from weightsync.spec.table import ALWAYS

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
    "the worker checks only its own start/active flag, v1/worker/gpu_worker.py:1534-1538, 1566-1569)"
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


def _v032_pause_rows(state: RankState, drain_queued: bool) -> Table:
    """The pause rows. vLLM 0.32's ``wait`` drains only the running requests: one queued on the rank when
    the pause arrives stays queued under PAUSED_NEW until the resume (``v1/core/sched/scheduler.py:900-917``,
    ``get_num_unfinished_requests`` at ``:2803-2811``). ``drain_queued``: weightsync's patch 0005 drains it
    too (:func:`~weightsync.spec.rank_tables.drain_queued_row`): the requests queued when the scheduler
    enters PAUSED_NEW from another PauseState: from UNPAUSED, or from PAUSED_ALL when a wait follows a keep
    still in flight (a pause on a verified rank changes nothing, patch 0006)."""
    upd = ("set_pause_state", "set_pending_pause", "set_engines_running")
    drain = drain_queued_row(upd, "pause_drains_queued_entering_paused_new")
    return {
        (state, _E.PAUSE): (
            _t("pause_abort", _S.PAUSED, upd, ("abort_requests",), C_PAUSE + " (abort)"),
            *((drain,) if drain_queued else ()),
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

    vllm-0.32-epoch adds: a wait-mode pause drains the requests queued before it (patch 0005); the resume all-reduce carries [has_unfinished, current_wave] with MAX, every rank
    adopts MAX + 1 and resets its step counter; a resume is a no-op on a running rank; the round is the
    state ``updating`` (start only when verified, update and finish only while updating, each refused
    otherwise), a pause on a verified rank returns at once, a pause or resume during an update is refused;
    weightsync's failure handling (state ``failed``).
    """
    rows: Table = {}
    for s in (_S.RUNNING, _S.PAUSING, _S.PAUSED, _S.VERIFIED):
        rows.update(_v032_serving_rows(s))
        # the fix drains what the rank has queued when a wait enters PAUSED_NEW (patch 0005)
        rows.update(_v032_pause_rows(s, drain_queued=epoch))
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
    for s in (_S.PAUSING, _S.PAUSED):
        rows[(s, _E.PAUSE)] = (
            _t("pause_joins_consensus", s, (), (), R_JOIN_CONSENSUS),
            *rows[(s, _E.PAUSE)],
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
