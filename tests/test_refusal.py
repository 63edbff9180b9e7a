"""Every refusal names the state and event it was refused in (issue 23, acceptance 3).

For each variant, one row that refuses a call (effect ``refuse``; a non-``failed`` one where the variant has
one, the ``vllm-0.32`` variants' pause during an update for instance) is fired on a rank machine, and the
reference engine's own ``refuse`` effect (:class:`~weightsync.impl.engine.replies.CallReplies`) answers the
call: the reply must name that state, that event and the row's reason. A constant message ("refused in state
failed") fails every variant whose refusal is in another state, and the ``failed`` case checks the cause.
"""

from __future__ import annotations

import queue
from typing import Any

import pytest

from weightsync.impl.engine.config import EngineQueues
from weightsync.impl.engine.messages import UtilityCall, UtilityReply
from weightsync.impl.engine.replies import CallReplies
from weightsync.spec.calls import CALL_EVENT
from weightsync.spec.rank import VARIANTS, RankMachine
from weightsync.spec.refusal import ILLEGAL_CALL, IllegalCallPolicy, refusal_text
from weightsync.spec.states import PauseMode, RankEvent, RankState

_METHOD = {e: call for call, e in CALL_EVENT.items()}
_ARGS: dict[RankEvent, dict[str, Any]] = {
    RankEvent.PAUSE: {"mode": PauseMode.KEEP, "clear_cache": True, "running": 0, "waiting": 0}
}


def _refusing_row(variant: str) -> tuple[RankState, RankEvent, str]:
    rows = [
        (s, e, tr.rule)
        for (s, e), trs in sorted(
            VARIANTS[variant].table.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)
        )
        for tr in trs
        if "refuse" in tr.effects and e in _METHOD
    ]
    assert rows, f"{variant}: no row refuses a call"
    return next((r for r in rows if r[0] is not RankState.FAILED), rows[0])


def _engine_reply(state: RankState, event: RankEvent, variant: str, round_error: BaseException | None) -> str:
    m = RankMachine(0, 2, variant, 2)
    # a rank that served (wave 1): the transfer init gate (guard alone_or_never_served) refuses it
    m.vars = m.vars._replace(state=state, current_wave=1)
    fired = m.fire(event, **_ARGS.get(event, {}))
    eng = CallReplies()
    eng.rank = 0
    eng.q = EngineQueues(queue.Queue(), queue.Queue(), queue.Queue(), queue.Queue(), queue.Queue())
    eng._round_error = round_error
    eng._ctx_call = UtilityCall(7, _METHOD[event])
    eng._pending_calls = {7: eng._ctx_call}
    eng._deferred = {}
    eng._refuse(fired)
    reply = eng.q.out.get_nowait()
    assert isinstance(reply, UtilityReply) and reply.call_id == 7 and reply.error_type == "LocalProtocolError"
    assert fired.after.state is state  # a refusal leaves the rank where it was
    return str(reply.error)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_refusal_names_its_state_and_event(variant: str) -> None:
    state, event, rule = _refusing_row(variant)
    text = _engine_reply(state, event, variant, None)
    assert f"refused in state {state.value} (event {event.value}; row: {rule})" in text, text
    assert text.startswith(f"LocalProtocolError: rank 0: {_METHOD[event]} refused")


def test_refusal_in_failed_names_the_cause_and_the_recovery() -> None:
    text = _engine_reply(RankState.FAILED, RankEvent.RESUME, "two-phase-epoch", TimeoutError("bucket 3"))
    assert "refused in state failed (event resume" in text
    assert "after TimeoutError: bucket 3" in text and "recover with a new round" in text


def test_illegal_calls_are_not_sticky() -> None:
    assert ILLEGAL_CALL is IllegalCallPolicy.NON_STICKY
    assert refusal_text(1, "pause", RankState.UPDATING, RankEvent.PAUSE, "r").startswith(
        "rank 1: pause refused in state updating (event pause; row: r); finish the round first"
    )


def test_a_round_error_is_named_only_where_it_put_the_rank() -> None:
    """The engine passes its last round error to every refusal; spec (``NAMES_CAUSE``) names it only for a
    refusal in ``failed``: a pause refused during a later update is about the update, not the old error."""
    err = TimeoutError("bucket 3")
    text = _engine_reply(RankState.UPDATING, RankEvent.PAUSE, "vllm-0.32-epoch", err)
    assert "refused in state updating (event pause" in text and "bucket 3" not in text
    text = _engine_reply(RankState.FAILED, RankEvent.PAUSE, "vllm-0.32-epoch", err)
    assert "after TimeoutError: bucket 3" in text
