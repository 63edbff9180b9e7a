"""Lamport's TwoPhase commit (``TwoPhase.tla``), the explorer's calibration model.

TLC's published figures for this spec: 3 resource managers -> 288 distinct states, 1,146 states generated,
depth 11; 5 resource managers -> 8,832 distinct states. :func:`weightsync.model.explorer.explore` must
reproduce them (``tests/test_model_calibration.py``); TLC's "generated" count is the initial state plus
every generated successor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

WORKING, PREPARED, COMMITTED, ABORTED = "working", "prepared", "committed", "aborted"
INIT = "init"


class TPState(NamedTuple):
    """``rmState`` (tuple per RM), ``tmState``, ``tmPrepared`` (frozenset) and ``msgs`` (frozenset)."""

    rm: tuple[str, ...]
    tm: str
    prepared: frozenset[int]
    msgs: frozenset[tuple[str, int]]


def initial(n: int) -> TPState:
    """``TPInit``: every RM working, the TM in init, no messages."""
    return TPState((WORKING,) * n, INIT, frozenset(), frozenset())


def successors(s: TPState) -> Iterator[tuple[str, TPState]]:
    """``TPNext`` in a fixed order: TMCommit, TMAbort, then per RM the five RM/TM actions."""
    n = len(s.rm)
    if s.tm == INIT and len(s.prepared) == n:
        yield "TMCommit", s._replace(tm=COMMITTED, msgs=s.msgs | {("Commit", -1)})
    if s.tm == INIT:
        yield "TMAbort", s._replace(tm=ABORTED, msgs=s.msgs | {("Abort", -1)})
    for r in range(n):
        if s.tm == INIT and ("Prepared", r) in s.msgs:
            yield f"TMRcvPrepared({r})", s._replace(prepared=s.prepared | {r})
        if s.rm[r] == WORKING:
            rm = (*s.rm[:r], PREPARED, *s.rm[r + 1 :])
            yield f"RMPrepare({r})", s._replace(rm=rm, msgs=s.msgs | {("Prepared", r)})
            yield f"RMChooseToAbort({r})", s._replace(rm=(*s.rm[:r], ABORTED, *s.rm[r + 1 :]))
        if ("Commit", -1) in s.msgs:
            yield f"RMRcvCommitMsg({r})", s._replace(rm=(*s.rm[:r], COMMITTED, *s.rm[r + 1 :]))
        if ("Abort", -1) in s.msgs:
            yield f"RMRcvAbortMsg({r})", s._replace(rm=(*s.rm[:r], ABORTED, *s.rm[r + 1 :]))


def consistent(s: TPState) -> list[str]:
    """``TPConsistent``: no RM committed while another aborted."""
    return ["consistent"] if COMMITTED in s.rm and ABORTED in s.rm else []
