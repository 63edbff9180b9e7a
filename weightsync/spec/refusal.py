"""Refusals as data: what a rank does with a call it does not take, and what the refusal says.

Three cases, each decided here rather than in an engine's prose:

- **An illegal call** (no row of the rank's table takes the event with these arguments): the policy is
  :data:`ILLEGAL_CALL`, ``NON_STICKY``: the engine asks the table first (``select``), the caller gets the
  table's :class:`~weightsync.spec.errors.LocalProtocolError` (``explain_illegal``), nothing fires and the
  rank is unharmed. ``STICKY`` (firing it, which leaves the machine in ``error``) is what the sans-IO
  :class:`~weightsync.spec.table.TableMachine` does alone; no engine uses it.
- **A refused call** (a row fires with the effect ``refuse``: a call on a ``failed`` rank, a weight call
  outside a pause or a pause during an update in the ``vllm-0.32`` variants): the rank stays where the row
  puts it and the reply is an error whose text :func:`refusal_text` builds: the rank, the call, the state
  and event it was refused in, the row's rule (its reason) and, per state, how to recover
  (:data:`RECOVERY`).
- **A halted engine** (an effect raised outside a round: a DP collective timed out or mismatched, the loop
  failed; the engine reports ``EngineFailure``): it leaves lockstep for good. :data:`HALTED` is that state's
  policy: it fires nothing more and answers every protocol call with the failure (``PeerFailedError``,
  :func:`halted_text`); queries and shutdown are answered as before.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from weightsync.spec.states import RankEvent, RankState


class IllegalCallPolicy(StrEnum):
    """What an engine does with a call no row takes."""

    NON_STICKY = "non-sticky"  # refused before the table fires; the rank is unchanged
    STICKY = "sticky"  # fired into the machine's sticky ``error`` state (the bare TableMachine)


#: The policy every engine (the reference engine, CheckedEngine, the vLLM adapters) follows.
ILLEGAL_CALL = IllegalCallPolicy.NON_STICKY

#: How to leave each state a refusal can happen in (appended to the refusal's text).
RECOVERY: dict[RankState, str] = {
    RankState.FAILED: (
        "a weight-transfer round failed; the weights may be partial and are not served; recover with a new "
        "round: start_weight_update -> update_weights -> finish_weight_update"
    ),
    RankState.UPDATING: "finish the round first: finish_weight_update",
    RankState.RUNNING: "pause first: weight calls are taken only inside a pause",
    RankState.PAUSING: "wait for the pause to complete",
    RankState.RESUMING: "wait for the resume to complete",
}

#: The states whose refusals also name the error that put the rank there (a failed round's); elsewhere a
#: refusal is about the call, not about an earlier error.
NAMES_CAUSE: frozenset[RankState] = frozenset({RankState.FAILED})

#: The halted engine's state (after an ``EngineFailure``), as its refusals name it.
HALTED = "halted"


def refusal_text(rank: Any, call: str, state: RankState, event: RankEvent, rule: str, cause: str = "") -> str:
    """The error text of call ``call`` refused by the row ``(state, event)`` of rule ``rule`` on ``rank``
    (an int or a list such as ``"0, 1"``); ``cause``: the engine's last round error, if any, named only in
    the states of :data:`NAMES_CAUSE`."""
    text = f"rank {rank}: {call} refused in state {state.value} (event {event.value}; row: {rule})"
    if cause and state in NAMES_CAUSE:
        text += f" after {cause}"
    hint = RECOVERY.get(state)
    return text + (f"; {hint}" if hint else "")


def halted_text(rank: int, call: str, error: str) -> str:
    """The error text of call ``call`` at a halted engine (:data:`HALTED`) that failed with ``error``."""
    return (
        f"rank {rank}: {call} refused in state {HALTED} (event {call}): rank {rank} failed earlier: {error}"
    )


__all__ = [
    "HALTED",
    "ILLEGAL_CALL",
    "NAMES_CAUSE",
    "RECOVERY",
    "IllegalCallPolicy",
    "halted_text",
    "refusal_text",
]
