"""The controller table (``spec/controller.py``) as the model runs it and as ``update_round`` runs it.

The same random sequences of call outcomes (each call succeeds or fails) go through the model's controller
(``Environment._controller``, whose first choice under policy ``one_round`` is the implementation's) and
through :func:`weightsync.impl.engine.controller.update_round` driving a recording engine; the calls each
issues and how each round ends must be equal. Under the model's own policy (``recover``) every choice the
model offers is a row of the table whose guard holds, and nothing else.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from weightsync.impl.engine.controller import UpdateFailedError, update_round
from weightsync.model.system import FAILED_REPLY, REPLIED, Bounds, Config, G, Model
from weightsync.spec.calls import PHASE_CALL, Phase
from weightsync.spec.controller import CtrlEvent, CtrlVars, Policy, controller_choices, controller_table
from weightsync.spec.states import PauseMode


class _Failed(RuntimeError):
    pass


class _Recorder:
    """An engine client and trainer that record every call and fail the ones ``outcomes`` says."""

    def __init__(self, outcomes: list[bool]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.outcomes.pop(0):
            raise _Failed(name)

    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None) -> None:
        self._call("pause")

    def resume(self, timeout: float | None = None) -> None:
        self._call("resume")

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any, *, timeout: float | None = None) -> None:
        self._call("update_weights")

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        self._call("finish_weight_update")

    def update(self, weights: Any = None) -> None:  # the trainer's part of a round
        self.update_weights({})


def impl_round(outcomes: list[bool]) -> tuple[list[str], str]:
    """The calls ``update_round`` issues under ``outcomes`` and how it ends."""
    rec = _Recorder(outcomes)
    try:
        update_round(rec, rec, weight_version="step-1")
    except UpdateFailedError as exc:
        return rec.calls, f"raise_update_failed:{exc.phase}"
    except _Failed as exc:
        return rec.calls, f"raise_failure:{exc}"
    return rec.calls, "end_round"


def _answered(model: Model, s: G, fail: bool) -> G:
    """``s`` with every rank (and the trainer, where it joined) having answered the current call; with
    ``fail`` rank 0's answer is an error."""
    ranks = tuple(
        r.with_status(FAILED_REPLY if fail and i == 0 else REPLIED, r.pause_ghost)
        for i, r in enumerate(s.ranks)
    )
    trainer = s.trainer._replace(status=REPLIED) if s.trainer.status else s.trainer
    return s._replace(ranks=ranks, trainer=trainer)


def model_round(variant: str, outcomes: list[bool]) -> tuple[list[str], str]:
    """The calls the model's controller makes under policy ``one_round`` (its first choice each time)
    under ``outcomes``, and how the round ends."""
    model = Model(Config(variant, 2, PauseMode.KEEP, "per-socket", Bounds(cycles=1)))
    model.ctrl_policy = Policy.ONE_ROUND
    s = model.initial()
    s = s._replace(ctrl=s.ctrl._replace(transfer_initialised=True))
    left = list(outcomes)
    calls: list[str] = []
    last = ""
    for _ in range(20):
        out: list[tuple[Any, G]] = []
        model._controller(s, out)
        assert out, "the controller stopped without ending the round"
        label, t = out[0]
        if label[0] == "end":
            end = str(label[1])
            return calls, end if end == "end_round" else f"{end}:{last}"
        assert label[0] in ("fan", "fe"), label
        calls.append(str(label[1]))
        fail = left.pop(0)
        if fail:
            last = str(label[1])
        s = _answered(model, t, fail)
    raise AssertionError("no end after 20 calls")


@pytest.mark.parametrize("variant", ["two-phase-epoch", "front-end-pause", "vllm-0.32"])
def test_the_model_and_update_round_issue_the_same_calls_for_the_same_outcomes(variant: str) -> None:
    rng = random.Random(12)
    ends = set()
    for _ in range(300):
        outcomes = [rng.random() < 0.3 for _ in range(8)]
        impl = impl_round(outcomes)
        model = model_round(variant, outcomes)
        assert model == impl, outcomes
        ends.add(impl[1].split(":")[0])
    # every way a round ends was driven
    assert ends == {"end_round", "raise_failure", "raise_update_failed"}


def test_update_round_resumes_only_with_a_complete_set_of_weights() -> None:
    assert impl_round([False] * 5) == (
        ["pause", "start_weight_update", "update_weights", "finish_weight_update", "resume"],
        "end_round",
    )
    assert impl_round([True]) == (["pause"], "raise_failure:pause")
    assert impl_round([False, True, False]) == (
        ["pause", "start_weight_update", "resume"],
        "raise_failure:start_weight_update",
    )
    assert impl_round([False, False, True]) == (
        ["pause", "start_weight_update", "update_weights"],
        "raise_update_failed:update_weights",
    )
    assert impl_round([False, False, False, True]) == (
        ["pause", "start_weight_update", "update_weights", "finish_weight_update"],
        "raise_update_failed:finish_weight_update",
    )


def _ctrl_vars(s: G) -> CtrlVars:
    c = s.ctrl
    return CtrlVars(
        Phase(c.phase),
        c.cycles_started,
        c.update_rounds,
        c.transfer_initialised,
        c.stray_resume_used,
        c.repeat_resume_used,
        c.recovering,
        c.extra_used,
    )


@pytest.mark.parametrize(
    "variant,bounds",
    [
        ("two-phase-epoch", Bounds(failures=1, init_transfer=True, stray_resume=True, repeat_resume=True)),
        ("vllm-0.32-epoch", Bounds(pause_during_update=True, resume_during_update=True)),
        ("front-end-pause", Bounds(stray_resume=True)),
    ],
)
def test_the_models_controller_offers_exactly_the_rows_whose_guards_hold(
    variant: str, bounds: Bounds
) -> None:
    """Random walks through the model: at each state the controller's moves are the table's choices."""
    model = Model(Config(variant, 2, PauseMode.KEEP, "per-socket", bounds))
    table = controller_table(model.variant.pause_in_front_end)
    rng = random.Random(3)
    seen: set[tuple[Any, ...]] = set()
    for _ in range(40):
        s = model.initial()
        for _ in range(60):
            out: list[tuple[Any, G]] = []
            model._controller(s, out)
            answered = model._all_replied(s, s.ctrl.phase)
            ev = (
                CtrlEvent.DONE
                if s.ctrl.phase == Phase.IDLE
                else (
                    CtrlEvent.WAITING
                    if not answered
                    else (CtrlEvent.FAILED if model._phase_failed(s) else CtrlEvent.DONE)
                )
            )
            want = [
                (tr.effects[0], PHASE_CALL.get(after.phase, ""), after)
                for tr, after in controller_choices(
                    table, _ctrl_vars(s), ev, model._ctrl_args(s.front.next_request)
                )
            ]
            got = [(label, _ctrl_vars(t)) for label, t in out]
            assert [after for *_, after in want] == [v for _, v in got]
            kinds = {"fan_out": "fan", "front_end_call": "fe", "retry_resume": "retry"}
            assert [kinds.get(e, "extra") for e, _, _ in want] == [label[0] for label, _ in got]
            seen.update((s.ctrl.phase, ev, label[0]) for label, _ in got)
            nxt = model.successors(s)
            if not nxt:
                break
            s = rng.choice(nxt)[1]
    assert len(seen) > 5


def test_call_args_are_vllms_pause_arguments_with_its_defaults_and_the_ranks_running_count() -> None:
    """The one builder of a call's table arguments (engine, model, trace walker): vLLM 0.32's defaults
    (``pause_generation(mode="abort", clear_cache=True)``), a precise error for a bad value or argument, and
    no table argument for a weight-transfer call (its kwargs are the worker's payload)."""
    from weightsync.spec.calls import CALL_ARGS, DEFERRED_REPLY, call_args
    from weightsync.spec.rank_vars import EFFECTS
    from weightsync.spec.states import PauseMode, RankEvent

    assert call_args(RankEvent.PAUSE, {}, 3, 1) == {
        "mode": PauseMode.ABORT,
        "clear_cache": True,
        "running": 3,
        "waiting": 1,
    }
    assert call_args(RankEvent.PAUSE, {"mode": "keep", "clear_cache": False}, 0, 0) == {
        "mode": PauseMode.KEEP,
        "clear_cache": False,
        "running": 0,
        "waiting": 0,
    }
    assert call_args(RankEvent.UPDATE_WEIGHTS, {"update_info": {"names": []}}, 2, 0) == {}
    with pytest.raises(
        ValueError, match=r"^pause: mode='drain' is no pause mode; use one of \['abort', 'wait', 'keep'\]$"
    ):
        call_args(RankEvent.PAUSE, {"mode": "drain"}, 0, 0)
    with pytest.raises(ValueError, match=r"^pause takes no argument\(s\) \['running'\]"):
        call_args(RankEvent.PAUSE, {"running": 5}, 0, 0)  # read off the rank, never the caller's
    assert set(CALL_ARGS) <= set(RankEvent) and all(eff in EFFECTS for eff in DEFERRED_REPLY.values())


def test_an_init_while_serving_is_offered_once_after_a_resume_and_leads_to_a_pause_or_to_serving() -> None:
    """Model bound ``init_while_serving``: after a completed resume the controller may init once more; when
    that init returns it pauses for the next cycle or serves on, never a round without a pause (the lazy
    init's rows, ``start`` and ``resume``, do not apply to it)."""
    from weightsync.spec.controller import ONE_ROUND_ARGS

    table = controller_table()
    args = {**ONE_ROUND_ARGS, "policy": Policy.RECOVER, "cycles": 2, "init_while_serving": True}
    resumed = CtrlVars(Phase.RESUME, cycles_started=1, update_rounds=1)

    def targets(v: CtrlVars, ev: CtrlEvent, a: dict[str, Any]) -> list[tuple[Phase, CtrlVars]]:
        return [
            (tr.target if tr.target is not None else v.phase, after)
            for tr, after in controller_choices(table, v, ev, a)
        ]

    offered = targets(resumed, CtrlEvent.DONE, args)
    inits = [after for p, after in offered if p is Phase.INIT]
    assert len(inits) == 1, offered
    assert not [
        p
        for p, _ in targets(resumed, CtrlEvent.DONE, {**args, "init_while_serving": False})
        if p is Phase.INIT
    ]
    (serving,) = inits
    assert [p for p, _ in targets(serving, CtrlEvent.DONE, args)] == [Phase.PAUSE]
    assert [p for p, _ in targets(serving, CtrlEvent.DONE, {**args, "cycles": 1})] == [Phase.IDLE]
    (paused,) = [after for _, after in targets(serving, CtrlEvent.DONE, args)]
    # used once: after the next cycle's resume no second init while serving is offered
    again = paused._replace(state=Phase.RESUME, cycles_started=2)
    assert not [p for p, _ in targets(again, CtrlEvent.DONE, {**args, "cycles": 3}) if p is Phase.INIT]
    # a lazy init (while paused) still goes on to start, or resumes (pause -> init -> resume)
    lazy = CtrlVars(Phase.INIT, cycles_started=1, transfer_initialised=True)
    assert [p for p, _ in targets(lazy, CtrlEvent.DONE, args)] == [Phase.START, Phase.RESUME]


def test_a_refused_init_while_serving_pauses_then_inits_while_paused() -> None:
    """The init gate (rank guard ``alone_or_never_served``, patch 0008) refuses an init on DP ranks that
    served; the controller (policy recover) then pauses, forgetting the init, so the pause's answer leads to
    the lazy init while paused; it never re-sends the init while serving. Policy one_round raises the
    refusal."""
    from weightsync.spec.controller import ONE_ROUND_ARGS

    table = controller_table()
    args = {**ONE_ROUND_ARGS, "policy": Policy.RECOVER, "cycles": 1, "init_while_serving": True}
    resumed = CtrlVars(Phase.RESUME, cycles_started=1, update_rounds=1)
    (serving,) = [
        a for tr, a in controller_choices(table, resumed, CtrlEvent.DONE, args) if tr.target is Phase.INIT
    ]
    refused = controller_choices(table, serving, CtrlEvent.FAILED, args)
    assert [tr.target for tr, _ in refused] == [Phase.PAUSE], refused
    ((_, pausing),) = refused
    assert not pausing.transfer_initialised and not pausing.recovering
    after_pause = [tr.target for tr, _ in controller_choices(table, pausing, CtrlEvent.DONE, args)]
    assert after_pause == [Phase.INIT, Phase.RESUME], after_pause
    # a failed init that is not the serving one still inits again (the transfer group is gone)
    lazy = CtrlVars(Phase.INIT, cycles_started=1)
    assert [tr.target for tr, _ in controller_choices(table, lazy, CtrlEvent.FAILED, args)] == [Phase.INIT]
    one = {**args, "policy": Policy.ONE_ROUND}
    assert [tr.effects for tr, _ in controller_choices(table, serving, CtrlEvent.FAILED, one)] == [
        ("raise_failure",)
    ]
