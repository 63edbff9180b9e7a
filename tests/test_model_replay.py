"""weightsync.model.replay: collective outcomes agree with the model's joint completions; TraceChecker
rejects a wrong outcome, a blocked rank taking input and a wrong has_work, naming the step."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.model.check import build_model
from weightsync.model.explorer import explore
from weightsync.model.replay import Member, TraceChecker, collective_outcome
from weightsync.model.system import DONE_EVENT, Bounds
from weightsync.spec.rank import RankMachine, RankVars
from weightsync.spec.states import PauseState, RankState

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("variant", ["two-phase-epoch", "two-phase"])
def test_outcome_matches_the_models_completion_on_every_done_edge(variant: str) -> None:
    model = build_model(variant, 2, "keep", "per-socket", Bounds())
    ex = explore([model.initial()], model.successors, max_states=15_000)
    seen = 0
    for s in ex.states:
        for label, t in model.successors(s):
            if label[0] != "done" or label[1] not in ("dp_sync", "resume_barrier"):
                continue
            kind = label[1]
            members = [Member(r.vars, len(r.waiting), len(r.running)) for r in s.ranks]
            out = collective_outcome(kind, members)
            for i, r in enumerate(s.ranks):
                extra = (("has_work", model._has_work(r)), *sorted(out.items()))
                _, after = model.fire(i, r.vars, DONE_EVENT[kind], extra)
                assert after == t.ranks[i].vars, (kind, out, i)
            seen += 1
    assert seen > 10


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
