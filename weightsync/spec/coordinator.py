"""The DP coordinator as a table: vLLM's ``DPCoordinatorProc`` wave bookkeeping (vLLM 0.32
``v1/engine/coordinator.py:197-466``).

The coordinator holds ``(current_wave, engines_running)``; here ``engines_running`` is the machine's state
(:class:`CoordState`). It reads three messages (:class:`CoordEvent`) and its effects are the
START_DP_WAVE broadcasts to every engine's wave socket and the stats it publishes to the front-ends.
Both the model (:mod:`weightsync.model.system`) and the reference engine's coordinator process
(:mod:`weightsync.impl.engine.coordinator`) run :func:`coordinator_fire` on :func:`coordinator_table`;
neither decides a coordinator rule by itself.

Rules (vLLM 0.32 ``v1/engine/coordinator.py``):

1. ``FIRST_REQ(exclude, wave)`` from a front-end while the engines are believed idle: broadcast
   START_DP_WAVE(current_wave), excluding the target engine ``exclude`` unless the request's ``wave`` is
   stale (``wave < current_wave``: every engine must take it) (lines 363-375). While running it is
   ignored. vLLM 0.32 does not set ``engines_running`` here: a paused engine discards START_DP_WAVE, so
   sending it is no evidence that the engines run (issue #51476's fix). Older vLLM latched it
   (:attr:`~weightsync.spec.rank.Variant.coordinator_latches`).
2. ``wave_complete=w`` from engine rank 0: if ``current_wave <= w``, ``current_wave = w + 1`` and the
   engines are idle (lines 432-445); an older report is ignored.
3. ``start_wave=w`` from engine ``sender``: if ``w > current_wave``, or ``w == current_wave`` while idle,
   adopt ``w``, the engines run, and broadcast START_DP_WAVE(w) excluding the sender (lines 446-461);
   otherwise ignored.
4. Every change of ``(current_wave, engines_running)`` is published to the front-ends (lines 463-466).
   Otherwise the coordinator publishes only on its poll timeout (every 5 s while nothing happens,
   lines 264-290). So after rule 1, a front-end that set ``engines_running`` when it forwarded the
   FIRST_REQ (``v1/engine/core_client.py:1540-1549``) keeps believing paused, idle engines run until
   that timeout (property ``front_end_belief``; vLLM issue #51481;
   :attr:`~weightsync.spec.rank.Variant.front_end_latches`).

The exclusion of rule 1 never matches in vLLM 0.32: the front-end sends the target as a bytes identity
and the engine compares it with its int index (``v1/engine/core_client.py:1592`` -> ``core.py:2288``);
:attr:`~weightsync.spec.rank.Variant.first_req_exclusion` False models that (every engine takes it).
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


class CoordState(StrEnum):
    """The coordinator's ``engines_running`` belief."""

    IDLE = "idle"
    RUNNING = "running"


class CoordEvent(StrEnum):
    """Messages the coordinator reads (vLLM 0.32 ``v1/engine/coordinator.py:363-375, 432-461``)."""

    FIRST_REQ = "FIRST_REQ"  # front-end -> coordinator: args ``exclude`` (target rank), ``wave``
    WAVE_COMPLETE = "wave_complete"  # engine rank 0 -> coordinator: args ``wave``
    START_WAVE = "start_wave"  # engine -> coordinator: args ``wave``, ``sender``


class CoordVars(NamedTuple):
    """The coordinator's variables (vLLM's names).

    Attributes:
        state: :class:`CoordState` (``engines_running``).
        current_wave: the wave the coordinator believes current (int >= 0).
    """

    state: CoordState = CoordState.IDLE
    current_wave: int = 0

    @property
    def engines_running(self) -> bool:
        """vLLM's ``engines_running``."""
        return self.state is CoordState.RUNNING


#: The fields of each coordinator input, in the order the model's message tuples ``(kind, *fields)`` carry
#: them (``kind`` is the :class:`CoordEvent` value).
MESSAGE_FIELDS: dict[CoordEvent, tuple[str, ...]] = {
    CoordEvent.FIRST_REQ: ("exclude", "wave"),
    CoordEvent.WAVE_COMPLETE: ("wave", "sender"),
    CoordEvent.START_WAVE: ("wave", "sender"),
}

#: A START_DP_WAVE broadcast: the effect names below and whom each excludes (``"none"``: every engine;
#: ``"exclude"`` / ``"sender"``: the message's argument of that name). The broadcast carries the
#: coordinator's ``current_wave`` after the transition.
BROADCASTS: dict[str, str] = {
    "start_dp_wave_all": "none",
    "start_dp_wave_but_target": "exclude",
    "start_dp_wave_but_sender": "sender",
}
#: The effect that publishes ``(current_wave, engines_running)`` to the front-ends (rule 4).
PUBLISH = "publish_stats"

COORD_GUARDS = {
    "stale_request": lambda v, a: int(a["wave"]) < v.current_wave,
    "report_not_older": lambda v, a: v.current_wave <= int(a["wave"]),
    "wave_not_older": lambda v, a: int(a["wave"]) >= v.current_wave,
    "wave_newer": lambda v, a: int(a["wave"]) > v.current_wave,
}
COORD_UPDATES = {
    "adopt_wave": lambda v, a: v._replace(current_wave=int(a["wave"])),
    "next_wave": lambda v, a: v._replace(current_wave=int(a["wave"]) + 1),
}

Table = dict[tuple[CoordState, CoordEvent], tuple[Transition, ...]]
_S = CoordState
_E = CoordEvent
_SRC = "v1/engine/coordinator.py"


def coordinator_table(latches: bool = False, excludes: bool = True) -> Table:
    """The coordinator's table for a variant's flags.

    Args:
        latches: FIRST_REQ sets ``engines_running`` (vLLM before issue #51476's fix); False: vLLM 0.32.
        excludes: FIRST_REQ's START_DP_WAVE excludes the target engine (False: vLLM 0.32's bytes-vs-int
            identity, the exclusion never matches).
    """
    first = _S.RUNNING if latches else _S.IDLE
    published = (PUBLISH,) if latches else ()
    fresh = "start_dp_wave_but_target" if excludes else "start_dp_wave_all"
    latch_rule = "latches: before issue #51476's fix" if latches else "no latch: issue #51476's fix"
    t = Transition
    return {
        (_S.IDLE, _E.FIRST_REQ): (
            t("stale_request", first, (), ("start_dp_wave_all", *published), f"{_SRC}:364-366; {latch_rule}"),
            t(ALWAYS, first, (), (fresh, *published), f"{_SRC}:363-375; {latch_rule}"),
        ),
        (_S.RUNNING, _E.FIRST_REQ): (t(ALWAYS, _S.RUNNING, (), (), f"{_SRC}:363 (engines running)"),),
        **{
            (s, _E.WAVE_COMPLETE): (
                t("report_not_older", _S.IDLE, ("next_wave",), (PUBLISH,), f"{_SRC}:432-445"),
                t(ALWAYS, s, (), (), f"{_SRC}:436 (an older report)"),
            )
            for s in _S
        },
        (_S.IDLE, _E.START_WAVE): (
            t(
                "wave_not_older",
                _S.RUNNING,
                ("adopt_wave",),
                ("start_dp_wave_but_sender", PUBLISH),
                f"{_SRC}:446-461",
            ),
            t(ALWAYS, _S.IDLE, (), (), f"{_SRC}:446-449 (an older wave)"),
        ),
        (_S.RUNNING, _E.START_WAVE): (
            t(
                "wave_newer",
                _S.RUNNING,
                ("adopt_wave",),
                ("start_dp_wave_but_sender", PUBLISH),
                f"{_SRC}:446-461",
            ),
            t(ALWAYS, _S.RUNNING, (), (), f"{_SRC}:446-449 (not a newer wave)"),
        ),
    }


class CoordFired(NamedTuple):
    """One coordinator transition: the row, the variables after it, and the START_DP_WAVE broadcasts as
    ``(wave, exclude)`` (``exclude`` -1: every engine)."""

    transition: Transition
    after: CoordVars
    broadcasts: tuple[tuple[int, int], ...]


def coordinator_fire(table: Table, v: CoordVars, event: CoordEvent, args: Mapping[str, Any]) -> CoordFired:
    """Apply one message to the coordinator. Pure.

    Args:
        table: from :func:`coordinator_table`.
        v: the variables before.
        event: the message kind; ``args`` its fields (``wave``; ``exclude`` for FIRST_REQ, ``sender`` for
            start_wave), ints.

    Raises:
        KeyError: an argument the row needs is missing.
        ValueError: no row for ``(v.state, event)`` (the tables above cover every pair; a table built
            elsewhere might not).
    """
    tr = select_transition(table, v.state, event, v, args, COORD_GUARDS)
    if tr is None:
        raise ValueError(
            f"coordinator: no row for {event.value} in state {v.state.value} (args {dict(args)})"
        )
    after = apply_transition(v, tr, args, COORD_UPDATES)
    out = tuple(
        (after.current_wave, -1 if BROADCASTS[e] == "none" else int(args[BROADCASTS[e]]))
        for e in tr.effects
        if e in BROADCASTS
    )
    return CoordFired(tr, after, out)


def coordinator_digest(latches: bool, excludes: bool) -> str:
    """SHA-256 of the coordinator table for these flags."""
    table = coordinator_table(latches, excludes)
    return table_digest(
        ((s, e, tr) for (s, e), trs in sorted(table.items()) for tr in trs),
        registry_digest(__name__, "COORD_GUARDS", "COORD_UPDATES"),
    )


__all__ = [
    "BROADCASTS",
    "COORD_GUARDS",
    "COORD_UPDATES",
    "MESSAGE_FIELDS",
    "PUBLISH",
    "CoordEvent",
    "CoordFired",
    "CoordState",
    "CoordVars",
    "coordinator_digest",
    "coordinator_fire",
    "coordinator_table",
]
