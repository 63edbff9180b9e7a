"""weightsync.model.replay: collective outcomes agree with the model's joint completions; TraceChecker
rejects a wrong outcome, a blocked rank taking input and a wrong has_work, naming the step."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.model.check import build_model
from weightsync.model.replay import Member, TraceChecker, collective_outcome
from weightsync.model.system import Bounds
from weightsync.model.system.effects import collective_args
from weightsync.spec.rank import RankMachine, RankVars
from weightsync.spec.states import PauseState, RankState

pytestmark = pytest.mark.timeout(120)


_U, _N, _A = PauseState.UNPAUSED, PauseState.PAUSED_NEW, PauseState.PAUSED_ALL

#: Hand-computed outcomes from vLLM 0.32's source, not from spec/collectives.py: the DP sync all-reduces
#: (SUM) has-unfinished and pending_pause, where has-unfinished is "waiting or running" when unpaused,
#: "running" under PAUSED_NEW and nothing under PAUSED_ALL (``v1/core/sched/scheduler.py:2803-2811``,
#: ``v1/engine/core.py:1555-1573``); the resume barrier all-reduces (MAX) has-unfinished and, in the epoch
#: variants, current_wave (``v1/engine/core.py:2250-2273``). Members: (pause_state, waiting, running,
#: pending_pause, current_wave).
HAND_OUTCOMES: list[tuple[str, list[tuple[PauseState, int, int, bool, int]], dict[str, int]]] = [
    ("dp_sync", [(_U, 1, 0, False, 0), (_U, 0, 0, True, 0)], {"sum_unfinished": 1, "sum_pending_pause": 1}),
    ("dp_sync", [(_U, 0, 2, True, 1), (_U, 3, 1, True, 1)], {"sum_unfinished": 2, "sum_pending_pause": 2}),
    ("dp_sync", [(_N, 3, 0, True, 2), (_N, 0, 1, False, 2)], {"sum_unfinished": 1, "sum_pending_pause": 1}),
    ("dp_sync", [(_A, 2, 2, True, 1), (_U, 0, 0, False, 1)], {"sum_unfinished": 0, "sum_pending_pause": 1}),
    (
        "dp_sync",
        [(_U, 1, 0, False, 0), (_U, 1, 0, False, 0), (_A, 0, 4, True, 0)],
        {"sum_unfinished": 2, "sum_pending_pause": 1},
    ),
    ("resume_barrier", [(_A, 0, 0, False, 3), (_A, 0, 1, False, 5)], {"max_unfinished": 0, "max_wave": 5}),
    ("resume_barrier", [(_U, 0, 1, False, 2), (_U, 0, 0, False, 7)], {"max_unfinished": 1, "max_wave": 7}),
    ("resume_barrier", [(_N, 4, 0, True, 0), (_U, 2, 0, False, 0)], {"max_unfinished": 1, "max_wave": 0}),
    ("dp_step", [(_U, 1, 1, True, 4), (_A, 0, 0, False, 4)], {}),
]


@pytest.mark.parametrize(("kind", "members", "expected"), HAND_OUTCOMES)
def test_outcome_against_hand_computed_vllm_semantics(
    kind: str, members: list[tuple[PauseState, int, int, bool, int]], expected: dict[str, int]
) -> None:
    """Replay's :func:`collective_outcome` and the model's joint completion (``collective_args``) against
    outcomes computed by hand from vLLM's code: a wrong contribution, reduction or outcome name in
    spec/collectives.py (which both read) fails here, where comparing the two could not."""
    ms = [
        Member(RankVars(pause_state=ps, pending_pause=pp, current_wave=w), wt, rn)
        for ps, wt, rn, pp, w in members
    ]
    assert collective_outcome(kind, ms) == expected
    blank = build_model("two-phase-epoch", 2, "keep", "per-socket", Bounds()).initial().ranks[0]
    ranks = tuple(
        blank._replace(
            vars=m.vars,
            waiting=tuple((i, 1) for i in range(m.waiting)),
            running=tuple((i, 1, 0) for i in range(m.running)),
        )
        for m in ms
    )
    assert dict(collective_args(ranks, kind)) == expected


def _vars(**kw: Any) -> dict[str, Any]:
    d = RankVars()._asdict()
    d.update(kw)
    return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items()}


def test_trace_checker_outcome_and_blocked_rank() -> None:
    machines = [RankMachine(r, 2, "two-phase-epoch", 2) for r in range(2)]
    for m in machines:
        m.vars = m.vars._replace(
            state=RankState.PAUSED,
            pause_state=PauseState.PAUSED_ALL,
            pending_pause=True,
            engines_running=True,
            step_counter=1,
            collective="dp_sync",
        )
    done = [
        {
            "rank": r,
            "event": "dp_sync_done",
            "coll_seq": 8,
            "waiting": 1,
            "running": 0,
            "args": {"has_work": False, "sum_unfinished": 0, "sum_pending_pause": 2},
        }
        for r in range(2)
    ]
    ck = TraceChecker()
    ck.prepare(done)
    assert ck(0, done[0], machines) is None
    assert ck.outcomes_checked == 1
    bad = dict(done[1], args={"has_work": False, "sum_unfinished": 0, "sum_pending_pause": 1})
    why = ck(1, bad, machines)
    assert why is not None and "sum_pending_pause=1 (model: 2)" in why
    # a blocked rank takes no input
    why = TraceChecker()(0, {"rank": 0, "event": "START_DP_WAVE", "args": {}}, machines)
    assert why is not None and "blocked in dp_sync" in why
    # has_work must match the scheduler counts
    m2 = [RankMachine(r, 2, "two-phase-epoch", 2) for r in range(2)]
    why = TraceChecker()(
        0, {"rank": 0, "event": "step", "waiting": 2, "running": 0, "args": {"has_work": False}}, m2
    )
    assert why is not None and "has_work=False" in why
