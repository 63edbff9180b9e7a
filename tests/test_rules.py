"""Each numbered rule of ``spec/PROTOCOL.md`` (:data:`weightsync.spec.rules.RULES`) checked against the tables.

The rules are prose; the rows are the protocol. Here every rule has one check (``CHECKS``, keyed by the rule's
title, so a new rule without a check fails ``test_every_rule_has_a_check``) that fires the rank machines, walks
the controller table or explores the model, and asserts what the prose claims. A rule whose claim the tables
do not decide (rule 13, the wire agreement, lives in the transfer layer) names the behavioural test that
checks it on real processes, and the check asserts that test exists.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.calls import PHASE_CALL, Phase
from weightsync.spec.collectives import COLLECTIVES, Reduction
from weightsync.spec.controller import ONE_ROUND_ARGS, CtrlEvent, CtrlVars, controller_next, controller_table
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.rank import VARIANTS, RankMachine
from weightsync.spec.refusal import ILLEGAL_CALL, IllegalCallPolicy
from weightsync.spec.rules import RULES
from weightsync.spec.states import LOCAL_CALLS, Collective, PauseMode, PauseState, RankEvent, RankState
from weightsync.spec.table import ALWAYS

E, S = RankEvent, RankState
EPOCH = "two-phase-epoch"


def _verified(variant: str = EPOCH, rank: int = 0) -> RankMachine:
    """A rank of a 2-rank group driven from running through a keep pause to verified."""
    m = RankMachine(rank, 2, variant, sync_interval=2)
    m.fire(E.PAUSE, mode=PauseMode.KEEP, clear_cache=False, running=0, waiting=0)
    m.fire(E.STEP, has_work=False)
    m.fire(E.DP_STEP_DONE, has_work=False)
    m.fire(E.STEP, has_work=False)
    m.fire(E.DP_SYNC_DONE, has_work=False, sum_unfinished=0, sum_pending_pause=2)
    assert m.state is S.VERIFIED
    return m


def _effects(variant: str, state: S, event: E) -> list[tuple[str, ...]]:
    return [tr.effects for tr in VARIANTS[variant].table.get((state, event), ())]


def rule_one_table() -> None:
    # a (state, event) pair with no row is illegal: the bare machine fails closed on it
    for name, v in VARIANTS.items():
        missing = [(s, e) for s in S for e in E if (s, e) not in v.table and s is not S.ERROR]
        assert missing, name
        s, e = missing[0]
        m = RankMachine(0, 2, name)
        m.vars = m.vars._replace(state=s)
        assert m.select(e, {}) is None
    # the first row whose guard holds fires: running's resume in two-phase takes engines_running first
    m = RankMachine(0, 2, "two-phase")
    m.vars = m.vars._replace(engines_running=True)
    assert m.fire(E.RESUME).transition.guard == "engines_running"


def rule_fail_closed() -> None:
    assert ILLEGAL_CALL is IllegalCallPolicy.NON_STICKY
    for name, v in VARIANTS.items():
        assert not any(s is S.ERROR for s, _ in v.table), f"{name}: a row leaves error"
    # an illegal message lands in the sticky error state, and then every call is refused
    m = RankMachine(0, 2)
    with pytest.raises(RemoteProtocolError):
        m.fire(E.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=0)
    assert m.state is S.ERROR
    with pytest.raises(LocalProtocolError):
        m.fire(E.PAUSE, mode=PauseMode.KEEP, clear_cache=False, running=0, waiting=0)
    # an illegal call is answered by the table before anything fires: the rank is unchanged
    m = RankMachine(0, 2)
    before = m.vars
    assert m.select(E.START_UPDATE, {}) is None
    assert "legal events here" in m.explain_illegal(E.START_UPDATE, {})
    assert m.vars == before


def rule_utility_calls_between_steps() -> None:
    """In the model a rank blocked in a collective takes no input and no step; every other move of a rank
    (an input or a step) changes that rank alone."""
    model = Model(Config(EPOCH, 2, PauseMode.KEEP, bounds=Bounds(requests=1)))
    seen = {model.initial()}
    todo = deque(seen)
    blocked_seen = 0
    while todo and len(seen) < 4000:
        s = todo.popleft()
        for label, t in model.successors(s):
            if label[0] in ("recv", "step"):
                i = int(label[1])
                assert not s.ranks[i].blocked, (label, s.ranks[i].blocked)
                others = [j for j in range(model.n) if j != i]
                assert all(t.ranks[j].vars == s.ranks[j].vars for j in others), label
            for i, r in enumerate(s.ranks):
                if r.blocked and label[0] != "done" and "timeout" not in str(label[0]):
                    blocked_seen += 1
                    assert t.ranks[i].vars == r.vars, (label, i)
            if t not in seen:
                seen.add(t)
                todo.append(t)
    assert blocked_seen > 0, "no move was taken while a rank was blocked: the check saw nothing"


def rule_lockstep() -> None:
    m = RankMachine(0, 2, EPOCH, sync_interval=2)
    m.fire(E.ADD, wave=0)
    f = m.fire(E.STEP, has_work=True)
    assert "enter_dp_step" in f.transition.effects or "enter_dp_sync" in f.transition.effects
    sync = COLLECTIVES[Collective.DP_SYNC]
    assert sync.reduction is Reduction.SUM and sync.contributes == ("has_unfinished", "pending_pause")
    # an idle rank with engines_running still steps (a dummy batch joins the forward collective)
    m = RankMachine(1, 2, EPOCH, sync_interval=2)
    m.vars = m.vars._replace(engines_running=True)
    assert m.fire(E.STEP, has_work=False).transition.effects
    # the wave ends on a sync with no unfinished work and no partial pause: rank 0 emits wave_complete
    m = RankMachine(0, 2, EPOCH, sync_interval=1)
    m.vars = m.vars._replace(engines_running=True, collective="dp_sync")
    f = m.fire(E.DP_SYNC_DONE, has_work=False, sum_unfinished=0, sum_pending_pause=0)
    assert "emit_wave_complete" in f.transition.effects and m.vars.current_wave == 1


def rule_waves_from_coordinator() -> None:
    m = RankMachine(1, 2, EPOCH)
    m.fire(E.START_DP_WAVE, wave=0, exclude=1)  # excluded
    assert not m.vars.engines_running
    m.fire(E.START_DP_WAVE, wave=0, exclude=0)
    assert m.vars.engines_running
    m = RankMachine(1, 2, EPOCH)
    m.vars = m.vars._replace(current_wave=2)
    m.fire(E.START_DP_WAVE, wave=1, exclude=0)  # older than the rank's wave
    assert not m.vars.engines_running
    m.fire(E.ADD, wave=3)  # a newer wave is adopted
    assert m.vars.current_wave == 3
    m = RankMachine(1, 2, EPOCH)
    m.vars = m.vars._replace(current_wave=2)
    f = m.fire(E.ADD, wave=1)  # stale ADD on an idle UNPAUSED rank: re-arm and tell the coordinator
    assert f.transition.effects == ("queue_request", "emit_start_wave") and m.vars.engines_running


def rule_phase_1() -> None:
    expect = {PauseMode.ABORT: PauseState.PAUSED_NEW, PauseMode.WAIT: PauseState.PAUSED_NEW}
    expect[PauseMode.KEEP] = PauseState.PAUSED_ALL
    for mode, ps in expect.items():
        m = RankMachine(0, 2, EPOCH)
        f = m.fire(E.PAUSE, mode=mode, clear_cache=False, running=2, waiting=0)
        assert m.vars.pause_state is ps and m.vars.pending_pause and m.vars.engines_running, mode
        assert ("abort_requests" in f.transition.effects) == (mode is PauseMode.ABORT), mode
        assert not any("reply_pause" in e for e in [f.transition.effects]), "the pause returned at once"
        # the rank keeps honouring START_DP_WAVE and keeps stepping
        assert (m.state, E.START_DP_WAVE) in VARIANTS[EPOCH].table
        assert m.fire(E.STEP, has_work=True).transition.effects


def rule_phase_2() -> None:
    m = RankMachine(0, 2, EPOCH, sync_interval=1)
    m.fire(E.PAUSE, mode=PauseMode.KEEP, clear_cache=True, running=0, waiting=0)
    m.fire(E.STEP, has_work=False)
    f = m.fire(E.DP_SYNC_DONE, has_work=False, sum_unfinished=0, sum_pending_pause=1)  # partial pause
    assert m.state is S.PAUSED and "reply_pause" not in f.transition.effects
    m.fire(E.STEP, has_work=False)
    f = m.fire(E.DP_SYNC_DONE, has_work=False, sum_unfinished=0, sum_pending_pause=2)
    assert m.state is S.VERIFIED and m.vars.ignore_start_dp_wave and not m.vars.pending_pause
    assert {"reply_pause", "clear_cache"} <= set(f.transition.effects)


def rule_weights_only_when_verified() -> None:
    for v in VARIANTS.values():
        if v.name == "vllm-0.32":
            continue  # vLLM 0.32 as shipped: weight calls in any state (rule 14)
        t = v.table
        takers = {
            s for (s, e), rows in t.items() if e is E.START_UPDATE for r in rows if "refuse" not in r.effects
        }
        assert takers <= {S.VERIFIED, S.FAILED}, (v.name, takers)
        movers = {(s, e) for (s, e), rows in t.items() for r in rows if "set_weight_version" in r.updates}
        assert movers == {(S.UPDATING, E.FINISH_DONE)}, v.name
    m = _verified()
    m.fire(E.START_DP_WAVE, wave=5, exclude=1)  # dropped while verified
    assert not m.vars.engines_running and not m.fire(E.STEP, has_work=True).transition.effects
    m.fire(E.START_UPDATE)
    m.fire(E.UPDATE_WEIGHTS)
    m.fire(E.WEIGHT_BROADCAST_DONE)
    m.fire(E.FINISH_UPDATE)
    assert m.vars.weight_version == 0
    m.fire(E.FINISH_DONE, weight_version=1)
    assert m.state is S.VERIFIED and m.vars.weight_version == 1


def rule_failure_is_a_state() -> None:
    for v in VARIANTS.values():
        if v.name == "vllm-0.32":
            continue
        t = v.table
        assert all(not r.effects for r in t[(S.FAILED, E.STEP)])
        for e in (E.PAUSE, E.RESUME, E.UPDATE_WEIGHTS, E.FINISH_UPDATE):
            assert [r.effects for r in t[(S.FAILED, e)]] == [("refuse",)], (v.name, e)
        exits = {r.target for (s, e), rows in t.items() if s is S.FAILED for r in rows}
        assert exits == {S.FAILED, S.UPDATING}, v.name
        assert {r.target for (s, e), rows in t.items() if e is E.TRANSFER_FAILED for r in rows} == {S.FAILED}
    m = _verified()
    m.fire(E.START_UPDATE)
    m.fire(E.UPDATE_WEIGHTS)
    m.fire(E.TRANSFER_FAILED, phase="update")
    assert m.state is S.FAILED and m.vars.weight_version == 0
    m.fire(E.START_UPDATE)  # a new round recovers
    assert m.state is S.UPDATING


def rule_resume_is_a_barrier() -> None:
    m = _verified()
    f = m.fire(E.RESUME)
    assert m.state is S.RESUMING and "enter_resume_barrier" in f.transition.effects
    assert COLLECTIVES[Collective.RESUME_BARRIER].reduction is Reduction.MAX
    m.fire(E.RESUME_BARRIER_DONE, max_unfinished=1, max_wave=0)
    assert m.state is S.RUNNING and m.vars.engines_running
    assert (S.PAUSING, E.RESUME) not in VARIANTS[EPOCH].table  # resume while a pause is in flight
    (row,) = VARIANTS[EPOCH].table[(S.RUNNING, E.RESUME)]
    assert row.guard == ALWAYS and row.target is S.RUNNING and row.effects == ("reply_resume",)
    shipped = VARIANTS["two-phase"].table[(S.RUNNING, E.RESUME)]
    assert [t.guard for t in shipped] == ["engines_running", "engines_stopped"]
    assert shipped[1].target is S.RESUMING


def rule_resume_agrees_on_the_wave() -> None:
    v = VARIANTS[EPOCH]
    assert v.resume_barrier_carries_wave and not v.coordinator_latches
    m = _verified(rank=0)
    m.fire(E.RESUME)
    f = m.fire(E.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=4)
    assert m.vars.current_wave == 5 and "emit_wave_complete" in f.transition.effects
    m.fire(E.START_DP_WAVE, wave=4, exclude=1)  # stamped before the resume: stale on every rank
    assert not m.vars.engines_running


def _controller_round(fail_at: str | None) -> tuple[list[str], tuple[str, ...]]:
    table = controller_table(False)
    v = CtrlVars(state=Phase.IDLE, transfer_initialised=True)
    calls: list[str] = []
    event = CtrlEvent.DONE
    for _ in range(12):
        step = controller_next(table, v, event, ONE_ROUND_ARGS)
        assert step is not None
        tr, v = step
        if tr.target is Phase.IDLE:
            return calls, tr.effects
        calls.append(PHASE_CALL[tr.target])
        event = CtrlEvent.FAILED if calls[-1] == fail_at else CtrlEvent.DONE
    raise AssertionError(calls)


def rule_resume_on_complete_weights() -> None:
    full = ["pause", "start_weight_update", "update_weights", "finish_weight_update", "resume"]
    assert _controller_round(None) == (full, ("end_round",))
    assert _controller_round("pause") == (["pause"], ("raise_failure",))
    assert _controller_round("start_weight_update") == ([*full[:2], "resume"], ("raise_failure",))
    for k, call in ((3, "update_weights"), (4, "finish_weight_update")):
        calls, end = _controller_round(call)
        assert calls == full[:k] and "resume" not in calls and end == ("raise_update_failed",), call


def rule_wire_agreement() -> None:
    """Decided by the transfer layer, not a table: checked on real gloo processes by these tests."""
    import importlib

    for module, name in (
        (
            "test_transfer_broadcast",
            "test_b5_mismatched_buffer_size_raises_wire_mismatch_on_every_rank_within_seconds",
        ),
        ("test_transfer_broadcast", "test_b17_dtype_mismatch_rejected_before_the_collective"),
        ("test_transfer_bad_input", "test_world_size_disagreement_raises_on_every_rank_within_seconds"),
    ):
        assert callable(getattr(importlib.import_module(module), name)), (module, name)


def rule_vllm_032() -> None:
    v = VARIANTS["vllm-0.32"]
    assert not v.resume_barrier_carries_wave and not v.coordinator_latches
    t = v.table
    assert all("refuse" not in e for e in _effects(v.name, S.UPDATING, E.PAUSE))  # a pause during an update
    assert _effects(v.name, S.RUNNING, E.START_UPDATE)  # weight calls in any state
    m = _verified("vllm-0.32")
    wave = m.vars.current_wave
    m.fire(E.RESUME)
    m.fire(E.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=wave + 3)
    assert m.vars.current_wave == wave  # the barrier keeps current_wave
    # every refusal is an error reply that leaves the rank where it was
    refusals = [
        (s, r.target) for (s, e), rows in t.items() if e in LOCAL_CALLS for r in rows if "refuse" in r.effects
    ]
    assert refusals and all(s is target for s, target in refusals)


def rule_vllm_032_epoch() -> None:
    name = "vllm-0.32-epoch"
    v = VARIANTS[name]
    assert v.resume_barrier_carries_wave and not v.coordinator_latches
    assert _effects(name, S.UPDATING, E.PAUSE) == [("refuse",)]
    assert _effects(name, S.UPDATING, E.RESUME) == [("refuse",)]
    assert all("refuse" in e for e in _effects(name, S.RUNNING, E.START_UPDATE))
    takers = {
        s
        for (s, e), rows in v.table.items()
        if e is E.START_UPDATE
        for r in rows
        if "refuse" not in r.effects
    }
    assert takers <= {S.VERIFIED, S.FAILED}, takers
    m = _verified(name)
    f = m.fire(
        E.PAUSE, mode=PauseMode.KEEP, clear_cache=False, running=0, waiting=0
    )  # returns at once when verified
    assert m.state is S.VERIFIED and "reply_pause" in f.transition.effects
    m.fire(E.RESUME)
    m.fire(E.RESUME_BARRIER_DONE, max_unfinished=0, max_wave=4)
    assert m.vars.current_wave == 5 and m.vars.step_counter == 0


CHECKS: dict[str, Callable[[], Any]] = {
    "One table": rule_one_table,
    "Fail closed and stay failed": rule_fail_closed,
    "Utility calls run between steps": rule_utility_calls_between_steps,
    "Lockstep while any rank has work": rule_lockstep,
    "Waves start from the coordinator": rule_waves_from_coordinator,
    "Phase 1: pause locally, keep honouring waves": rule_phase_1,
    "Phase 2: stop together": rule_phase_2,
    "Weights move only when verified": rule_weights_only_when_verified,
    "Failure is a state": rule_failure_is_a_state,
    "Resume is a barrier": rule_resume_is_a_barrier,
    "Resume agrees on the wave (two-phase-epoch)": rule_resume_agrees_on_the_wave,
    "A pause is resumed only on a complete set of weights": rule_resume_on_complete_weights,
    "Wire agreement before payload": rule_wire_agreement,
    "vLLM 0.32 as shipped (variant vllm-0.32)": rule_vllm_032,
    "The fix on vLLM 0.32 (variant vllm-0.32-epoch)": rule_vllm_032_epoch,
}


def test_every_rule_has_a_check() -> None:
    assert [r.title for r in RULES] == list(CHECKS)


@pytest.mark.parametrize("number", range(1, len(RULES) + 1))
def test_rule_holds_in_the_tables(number: int) -> None:
    CHECKS[RULES[number - 1].title]()
