"""The API front-end's DP rules as a table: wave stamping, FIRST_REQ, the stats it adopts, and the
front-end pause gate (reference sections 5 and 6).

The front-end (vLLM's ``DPLBAsyncMPClient`` / ``DPAsyncMPClient``) believes ``(current_wave,
engines_running)`` from the coordinator's stats; here ``engines_running`` is the machine's state
(:class:`FrontState`). Both the model (:mod:`weightsync.model.system`) and the reference engine client
(:mod:`weightsync.impl.engine.client`) run :func:`front_end_fire` on :func:`front_end_table` for the
variant's :attr:`~weightsync.spec.rank.Variant.front_end_latches`.

Rules (vLLM 0.32 ``v1/engine/core_client.py``):

1. A new request is stamped with the believed ``current_wave`` and sent as ADD to its engine
   (lines 1582-1589). If the engines are believed idle, FIRST_REQ(target engine, current_wave) goes to
   the coordinator and the front-end believes them running from then on (lines 1590-1593, 1540-1549):
   the latch. vLLM 0.32's coordinator no longer latches on FIRST_REQ and publishes nothing for it
   (``v1/engine/coordinator.py:363-375``), so a latched belief lasts until its next publish, up to its
   5 s poll timeout (lines 264-290), while the engines may be paused and idle (vLLM issue #51481).
   Without the latch (``latches=False``, weightsync's patch ``0004``), forwarding FIRST_REQ leaves the
   belief as it was; only rule 2 moves it.
2. Stats from the coordinator replace the belief (lines 1562-1565).
3. While the front-end pause gate is closed (vLLM before PR #28037 moved pause into the engines: the
   ``front-end-pause`` variant's ``front_end_gate`` effect), new requests are held; opening it sends
   every held request through rule 1, stamped with the wave believed then.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, NamedTuple

from weightsync.spec.table import (
    ALWAYS,
    Transition,
    apply_transition,
    registry_digest,
    select_transition,
    table_digest,
)


class FrontState(StrEnum):
    """The front-end's ``engines_running`` belief."""

    IDLE = "idle"
    RUNNING = "running"


class FrontEvent(StrEnum):
    """What the front-end reacts to."""

    SEND_REQUEST = "send_request"  # a client request for engine ``target``
    STATS = "stats"  # the coordinator's ``(wave, running)``
    GATE = "gate"  # the rank table's ``front_end_gate`` effect
    UNGATE = "ungate"  # the rank table's ``front_end_ungate`` effect


class FrontVars(NamedTuple):
    """The front-end's variables (vLLM's names).

    Attributes:
        state: :class:`FrontState` (``engines_running``).
        current_wave: the believed wave, stamped on every ADD (int >= 0).
        gated: the front-end pause gate is closed (requests are held).
    """

    state: FrontState = FrontState.IDLE
    current_wave: int = 0
    gated: bool = False

    @property
    def engines_running(self) -> bool:
        """vLLM's ``engines_running`` as this front-end believes it."""
        return self.state is FrontState.RUNNING


#: Effects: ``send_add`` (ADD(request, current_wave) to ``target``), ``send_first_req`` (FIRST_REQ(target,
#: current_wave) to the coordinator), ``hold_request`` (keep it until the gate opens), ``release_held``
#: (every held request through :attr:`FrontEvent.SEND_REQUEST` again, in order).
FRONT_END_EFFECTS = ("send_add", "send_first_req", "hold_request", "release_held")

#: The rank table's effects that the front-end executes, and the front-end event each is (the rank row
#: names the effect; the front-end that serves the rank runs it).
RANK_EFFECT_EVENT: dict[str, FrontEvent] = {
    "front_end_gate": FrontEvent.GATE,
    "front_end_ungate": FrontEvent.UNGATE,
}

FRONT_END_GUARDS = {
    "gated": lambda v, a: v.gated,
    "stats_running": lambda v, a: bool(a["running"]),
}
FRONT_END_UPDATES = {
    "adopt_wave": lambda v, a: v._replace(current_wave=int(a["wave"])),
    "close_gate": lambda v, a: v._replace(gated=True),
    "open_gate": lambda v, a: v._replace(gated=False),
}

_S = FrontState
_E = FrontEvent
_SRC = "v1/engine/core_client.py"


Table = dict[tuple[FrontState, FrontEvent], tuple[Transition, ...]]


def front_end_table(latches: bool = True) -> Table:
    """The front-end's table.

    Args:
        latches: forwarding FIRST_REQ sets ``engines_running`` (vLLM 0.32, rule 1); False: weightsync's
            patch ``0004`` (the belief moves only on the coordinator's stats).
    """
    t = Transition
    hold = t(
        "gated", None, (), ("hold_request",), "PR #28037 (front-end pause, before it moved into the engines)"
    )
    first = (
        t(ALWAYS, _S.RUNNING, (), ("send_add", "send_first_req"), f"{_SRC}:1582-1593, 1540-1549 (latch)")
        if latches
        else t(
            ALWAYS,
            _S.IDLE,
            (),
            ("send_add", "send_first_req"),
            f"{_SRC}:1582-1593; no latch (weightsync patch 0004, vLLM issue #51481)",
        )
    )
    out: Table = {
        (_S.IDLE, _E.SEND_REQUEST): (hold._replace(target=_S.IDLE), first),
        (_S.RUNNING, _E.SEND_REQUEST): (
            hold._replace(target=_S.RUNNING),
            t(ALWAYS, _S.RUNNING, (), ("send_add",), f"{_SRC}:1582-1589"),
        ),
    }
    for s in _S:
        out[(s, _E.STATS)] = (
            t("stats_running", _S.RUNNING, ("adopt_wave",), (), f"{_SRC}:1562-1565"),
            t(ALWAYS, _S.IDLE, ("adopt_wave",), (), f"{_SRC}:1562-1565"),
        )
        out[(s, _E.GATE)] = (t(ALWAYS, s, ("close_gate",), (), "PR #28037 (front-end pause)"),)
        out[(s, _E.UNGATE)] = (
            t(ALWAYS, s, ("open_gate",), ("release_held",), "PR #28037 (front-end resume)"),
        )
    return out


#: vLLM 0.32's front-end table (it latches; only the ``front-end-pause`` variant's rank table fires
#: GATE / UNGATE).
FRONT_END_TABLE = front_end_table()


def front_end_fire(
    v: FrontVars, event: FrontEvent, args: Mapping[str, Any], table: Table = FRONT_END_TABLE
) -> tuple[Transition, FrontVars]:
    """Apply one event to the front-end: ``(row, variables after)``. Pure.

    Args:
        v: the variables before.
        event: what happened; ``args``: ``target`` (int) for SEND_REQUEST, ``wave`` (int) and ``running``
            (bool) for STATS.
        table: from :func:`front_end_table` (default: vLLM 0.32's).

    Raises:
        KeyError: an argument the row needs is missing.
    """
    tr = select_transition(table, v.state, event, v, args, FRONT_END_GUARDS)
    assert tr is not None  # every (state, event) pair has an ALWAYS row
    return tr, apply_transition(v, tr, args, FRONT_END_UPDATES)


def front_end_digest(latches: bool = True) -> str:
    """SHA-256 of :func:`front_end_table` for ``latches``."""
    table = front_end_table(latches)
    return table_digest(
        ((s, e, tr) for (s, e), trs in sorted(table.items()) for tr in trs),
        registry_digest(__name__, "FRONT_END_GUARDS", "FRONT_END_UPDATES"),
    )


__all__ = [
    "FRONT_END_EFFECTS",
    "FRONT_END_GUARDS",
    "FRONT_END_TABLE",
    "FRONT_END_UPDATES",
    "RANK_EFFECT_EVENT",
    "FrontEvent",
    "FrontState",
    "FrontVars",
    "Table",
    "front_end_digest",
    "front_end_fire",
    "front_end_table",
]
