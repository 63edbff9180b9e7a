"""The spec tables: well-formedness, totality (every missing pair fails closed), machine behaviour, freshness."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.model.fsm_export import stale_spec_files
from weightsync.spec import (
    EFFECTS,
    GUARDS,
    UPDATES,
    VARIANTS,
    LocalProtocolError,
    PauseMode,
    PauseState,
    RankEvent,
    RankMachine,
    RankState,
    RemoteProtocolError,
    WorkerEvent,
    WorkerMachine,
    WorkerState,
)
from weightsync.spec.states import LOCAL_CALLS
from weightsync.spec.table import ALWAYS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rows_reference_registered_names(name: str) -> None:
    for (state, event), rows in VARIANTS[name].table.items():
        assert rows, (state, event)
        assert state is not RankState.ERROR, "error is sticky: no row may leave it"
        for tr in rows:
            assert tr.guard == ALWAYS or tr.guard in GUARDS, tr.guard
            assert all(u in UPDATES for u in tr.updates), tr.updates
            assert all(e in EFFECTS for e in tr.effects), tr.effects
            assert tr.rule


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_table_is_total_and_fails_closed(name: str) -> None:
    """Every (state, event) pair either has rows or raises the right error and lands in ERROR."""
    table = VARIANTS[name].table
    args = dict(
        mode="keep",
        clear_cache=False,
        running=0,
        waiting=0,
        wave=0,
        exclude=-1,
        has_work=False,
        sum_unfinished=0,
        sum_pending_pause=0,
        max_unfinished=0,
        max_wave=0,
    )
    for state in RankState:
        for event in RankEvent:
            if (state, event) in table:
                continue
            m = RankMachine(0, 2, name, sync_interval=2)
            m.vars = m.vars._replace(state=state)
            expected = LocalProtocolError if event in LOCAL_CALLS else RemoteProtocolError
            with pytest.raises(expected, match=f"illegal in state {state.value}"):
                m.fire(event, **args)
            assert m.state is RankState.ERROR


def _pause_to_verified(m: RankMachine, mode: str = "keep") -> None:
    m.fire(RankEvent.PAUSE, mode=mode, clear_cache=True, running=0, waiting=0)
    assert m.state is RankState.PAUSED and m.vars.pending_pause and m.vars.engines_running
    f = m.fire(RankEvent.STEP, has_work=False)
    assert f.transition.effects == ("execute_step", "enter_dp_step")
    m.fire(RankEvent.DP_STEP_DONE, has_work=False)
    f = m.fire(RankEvent.STEP, has_work=False)
    assert "enter_dp_sync" in f.transition.effects
    f = m.fire(RankEvent.DP_SYNC_DONE, has_work=False, sum_unfinished=0, sum_pending_pause=m.dp_size)
    assert m.state is RankState.VERIFIED
    assert "reply_pause" in f.transition.effects


def test_two_phase_pause_update_resume_cycle() -> None:
    m = RankMachine(0, 2, "two-phase-epoch", sync_interval=2)
    _pause_to_verified(m)
    assert m.vars.ignore_start_dp_wave and not m.vars.pending_pause and not m.vars.engines_running
    assert m.vars.pause_state is PauseState.PAUSED_ALL
    # a late START_DP_WAVE is dropped while verified (issue #36594 fixed)
    m.fire(RankEvent.START_DP_WAVE, wave=5, exclude=1)
    assert not m.vars.engines_running and m.vars.current_wave == 1
    assert m.fire(RankEvent.STEP, has_work=True).transition.effects == ()
    m.fire(RankEvent.START_UPDATE)
    m.fire(RankEvent.UPDATE_WEIGHTS)
    assert m.vars.collective == "weight_broadcast"
    m.fire(RankEvent.WEIGHT_BROADCAST_DONE)
    m.fire(RankEvent.FINISH_UPDATE)
    assert m.state is RankState.UPDATING and m.vars.weight_version == 0  # not before the workers' finish
    m.fire(RankEvent.FINISH_DONE, weight_version=1)  # the model's versions are round numbers
    assert m.state is RankState.VERIFIED and m.vars.weight_version == 1
    m.fire(RankEvent.RESUME)
    assert m.state is RankState.RESUMING and m.vars.collective == "resume_barrier"
    m.fire(RankEvent.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=1)
    assert m.state is RankState.RUNNING and m.vars.current_wave == 2  # epoch: MAX + 1
    # a stale ADD on the idle rank takes the start_wave path
    f = m.fire(RankEvent.ADD, wave=1)
    assert f.transition.effects == ("queue_request", "emit_start_wave") and m.vars.engines_running


def test_two_phase_as_shipped_keeps_wave_on_resume() -> None:
    m = RankMachine(1, 2, "two-phase", sync_interval=2)
    _pause_to_verified(m)
    m.fire(RankEvent.RESUME)
    m.fire(RankEvent.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=1)
    assert m.vars.current_wave == 1
    f = m.fire(RankEvent.ADD, wave=1)  # same wave: no wake-up of the peers
    assert f.transition.effects == ("queue_request",) and not m.vars.engines_running


@pytest.mark.parametrize("event", [RankEvent.UPDATE_WEIGHTS, RankEvent.START_UPDATE, RankEvent.FINISH_UPDATE])
def test_weight_calls_while_running_are_local_errors(event: RankEvent) -> None:
    m = RankMachine(0, 2)
    with pytest.raises(LocalProtocolError, match="legal events here"):
        m.fire(event)
    assert m.state is RankState.ERROR
    with pytest.raises(LocalProtocolError):  # sticky
        m.fire(RankEvent.RESUME)


def test_resume_while_pause_in_flight_is_rejected() -> None:
    m = RankMachine(0, 2)
    m.fire(RankEvent.PAUSE, mode=PauseMode.WAIT, clear_cache=False, running=3, waiting=0)
    assert m.state is RankState.PAUSING
    with pytest.raises(LocalProtocolError, match="resume"):
        m.fire(RankEvent.RESUME)


def test_idle_fast_path_rearms_on_late_wave() -> None:
    m = RankMachine(1, 2, "idle-fast-path", sync_interval=2)
    f = m.fire(RankEvent.PAUSE, mode="keep", clear_cache=False, running=0, waiting=0)
    assert m.state is RankState.VERIFIED and "reply_pause" in f.transition.effects
    m.fire(RankEvent.START_DP_WAVE, wave=0, exclude=0)
    assert m.vars.engines_running
    assert "enter_dp_step" in m.fire(RankEvent.STEP, has_work=False).transition.effects


def test_rank_machine_rejects_bad_construction() -> None:
    with pytest.raises(ValueError, match="outside"):
        RankMachine(2, 2)
    with pytest.raises(ValueError, match="known variants"):
        RankMachine(0, 2, "nope")


def test_worker_machine_order() -> None:
    w = WorkerMachine()
    with pytest.raises(LocalProtocolError, match="start_weight_update"):
        w.fire(WorkerEvent.UPDATE)
    assert w.state is WorkerState.ERROR
    w = WorkerMachine()
    with pytest.raises(LocalProtocolError):  # start before init
        w.fire(WorkerEvent.START)
    w = WorkerMachine()
    w.fire(WorkerEvent.INIT)
    w.fire(WorkerEvent.START)
    with pytest.raises(LocalProtocolError, match=r"already|illegal"):
        w.fire(WorkerEvent.START)


def test_worker_start_after_a_failed_reinit_is_refused() -> None:
    """A failed init_weight_transfer_engine (the rank table's fail_init effect) leaves the worker
    uninitialised even after an earlier init succeeded: the transfer group is gone, so a start before a
    new init is refused (the mutation report's note on the dropped fail_init effect relies on it)."""
    w = WorkerMachine()
    w.fire(WorkerEvent.INIT)
    w.fire(WorkerEvent.START)
    w.fire(WorkerEvent.FINISH)
    w.fire(WorkerEvent.FAIL_INIT)  # a later re-init failed
    with pytest.raises(LocalProtocolError, match=r"start_weight_update.*guard\(s\) initialized"):
        w.fire(WorkerEvent.START)
    w = WorkerMachine()
    w.fire(WorkerEvent.INIT)
    w.fire(WorkerEvent.FAIL_INIT)
    w.fire(WorkerEvent.INIT)  # initialised again: a round may start
    w.fire(WorkerEvent.START)


def test_generated_spec_files_are_fresh() -> None:
    assert stale_spec_files(ROOT / "spec") == [], "run `weightsync prove` and commit spec/"


def test_vllm_032_rows_cite_vllm_lines() -> None:
    """Every row of vllm-0.32 cites a vLLM 0.32 file and line. A row of the fix cites vLLM 0.32 lines too,
    unless it is a row of the fix's own (named ``weightsync vllm-0.32-epoch...``): a row without a vLLM line
    that is not attributed to the fix fails, which the old ``or "weightsync" in rule`` let through."""
    import re

    from weightsync.spec.rank_vllm032 import R_EPOCH_032

    cite = re.compile(r"vLLM 0\.32 .*\w+\.py:\d+")
    for (s, e), rows in VARIANTS["vllm-0.32"].table.items():
        for tr in rows:
            assert cite.search(tr.rule), (s, e, tr)
    fix_rows = 0
    for (s, e), rows in VARIANTS["vllm-0.32-epoch"].table.items():
        for tr in rows:
            own = tr.rule.startswith(R_EPOCH_032 + ":") or tr.rule.startswith(R_EPOCH_032 + " (")
            assert cite.search(tr.rule) or own, (s, e, tr)
            fix_rows += not cite.search(tr.rule)
    assert fix_rows > 0


def test_vllm_032_cadence_mirror_and_resume() -> None:
    """Sync at the wave's first step and every K; rank 0's start_wave follows was_running; resume errors are
    non-sticky; weight calls are decided by the worker's flags only."""
    m = RankMachine(0, 2, "vllm-0.32", sync_interval=3)
    m.fire(RankEvent.ADD, wave=0)
    syncs = []
    for _ in range(5):
        f = m.fire(RankEvent.STEP, has_work=True)
        sync = "enter_dp_sync" in f.transition.effects
        syncs.append(sync)
        if sync:
            f = m.fire(RankEvent.DP_SYNC_DONE, has_work=True, sum_unfinished=1, sum_pending_pause=0)
        else:
            f = m.fire(RankEvent.DP_STEP_DONE, has_work=True)
        # the mirror start_wave only after the first step (engines_running was False before it)
        assert ("emit_start_wave" in f.transition.effects) == (len(syncs) == 1)
    assert syncs == [True, False, True, False, False]  # step_counter 1, 3 (K=3), then 6
    m.fire(RankEvent.PAUSE, mode="keep", clear_cache=False, running=0, waiting=0)
    assert m.state is RankState.PAUSED
    f = m.fire(RankEvent.RESUME)  # a pause in flight: RuntimeError, the rank unchanged (non-sticky)
    assert f.transition.effects == ("refuse",) and m.state is RankState.PAUSED
    f = m.fire(RankEvent.START_UPDATE, worker="ready", worker_initialized=True)  # no engine gate
    assert "start_weight_update" in f.transition.effects and m.state is RankState.PAUSED
    f = m.fire(RankEvent.START_UPDATE, worker="active")
    assert f.transition.effects == ("refuse",)


def test_finish_without_a_version_keeps_it_and_relabel_is_no_transition() -> None:
    """vLLM 0.32: ``finish_weight_update(None)`` leaves the version (``async_llm.py:1351-1355``);
    ``update_weight_version(v)`` only relabels, in any state (``core.py:1082``), outside the tables."""
    from weightsync.spec.rank import relabel_weight_version

    m = RankMachine(0, 2, "two-phase-epoch", sync_interval=2)
    m.vars = relabel_weight_version(m.vars, "default")
    _pause_to_verified(m)
    for version, want in ((None, "default"), ("step-1", "step-1"), (None, "step-1")):
        m.fire(RankEvent.START_UPDATE)
        m.fire(RankEvent.FINISH_UPDATE)
        m.fire(RankEvent.FINISH_DONE, weight_version=version, monotonic=False)
        assert m.state is RankState.VERIFIED and m.vars.weight_version == want
    before = m.vars
    after = relabel_weight_version(before, "relabelled")
    assert after == before._replace(weight_version="relabelled")  # nothing else moves
    for state in RankState:  # any state: the label is not guarded by the table
        assert relabel_weight_version(before._replace(state=state), "x").state is state
    with pytest.raises(ValueError, match=r"must be a str .*got int 3"):
        relabel_weight_version(before, 3)  # type: ignore[arg-type]
    # the opt-in monotonic guard orders vLLM's string versions by their trailing step number
    from weightsync.spec.rank import GUARDS

    older = GUARDS["version_older"]
    assert older(after._replace(weight_version="step-5"), {"weight_version": "step-3", "monotonic": True})
    assert not older(
        after._replace(weight_version="default"), {"weight_version": "step-0", "monotonic": True}
    )
    assert not older(after._replace(weight_version="step-5"), {"weight_version": None, "monotonic": True})


@pytest.mark.parametrize("variant", ["two-phase-epoch", "vllm-0.32-epoch"])
def test_the_init_gate_refuses_a_dp_rank_that_served_and_not_a_lone_engine(variant: str) -> None:
    """Patch 0008's gate as rows of state ``running`` (guard ``alone_or_never_served``): a DP rank takes
    ``init_weight_transfer_engine`` before it served and refuses it once a wave ended or runs; a lone
    engine (dp_size 1, vLLM's EngineCoreProc, which the patch leaves alone) takes it whenever it runs."""
    from weightsync.spec.rank import RankMachine
    from weightsync.spec.states import RankEvent

    cases = [(2, 0, False, True), (2, 1, False, False), (2, 0, True, False), (1, 3, True, True)]
    for dp_size, wave, running, taken in cases:
        m = RankMachine(0, dp_size, variant, 2)
        m.vars = m.vars._replace(current_wave=wave, engines_running=running)
        tr = m.select(RankEvent.INIT_TRANSFER, {})
        assert tr is not None
        assert ("enter_transfer_init" in tr.effects) is taken, (dp_size, wave, running, tr)
        assert ("refuse" in tr.effects) is not taken, (dp_size, wave, running, tr)
