"""Trace validation against the model's composition of rank machines (``weightsync replay``).

:func:`weightsync.impl.checked.replay_trace` replays a recorded trace (one JSONL record per transition,
file order a linearization) on one :class:`~weightsync.spec.rank.RankMachine` per rank: each step must be
an edge of its variant's table and reproduce the recorded variables, and a DP collective must be entered
by every rank before any rank completes it. :class:`TraceChecker` is the model's per-step check on top of
that, the part that needs the composition of the ranks rather than one rank's table:

- **Collective outcomes.** A collective completion's outcome arguments must be what the model computes
  from the members' states at entry (:func:`collective_outcome`, the same arithmetic as the model's joint
  completion in :mod:`weightsync.model.system.effects`): ``dp_sync`` -> ``sum_unfinished`` and
  ``sum_pending_pause`` (SUM all-reduce of has-unfinished and pending_pause); ``resume_barrier`` ->
  ``max_unfinished`` and ``max_wave`` (MAX all-reduce). Every member's completion record must carry the
  same outcome, and every member must be blocked in that collective (``vars.collective``) when the first
  completion is recorded.
- **Blocked ranks take no input.** A rank inside a collective (by the table's ``collective`` variable)
  fires only that collective's completion (for a transfer collective, ``transfer_failed`` too: the model's
  failed joint completion); the model's ranks are blocked there.
- **Scheduler arguments.** ``has_work`` of a STEP or a collective completion must equal
  :func:`~weightsync.spec.states.schedulable` of the rank's PauseState and its waiting/running counts.

The members' waiting/running counts come from the trace (``waiting`` / ``running`` of every record: the
rank's scheduler when the record was written; a completion record is written right after the collective
returned, so its counts are the rank's counts at entry). Traces without them get the variable-only checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from weightsync.spec.collectives import DP_KINDS as DP_KINDS
from weightsync.spec.collectives import KIND_OF_DONE as KIND_OF_DONE
from weightsync.spec.collectives import OUTCOME_KINDS as OUTCOME_KINDS
from weightsync.spec.collectives import TRANSFER_KINDS, contribution, outcome_args, reduce_values
from weightsync.spec.rank import RankMachine, RankVars, dp_peers
from weightsync.spec.states import PauseState, RankEvent, schedulable

#: DP collectives with a sequence number shared by the members (``coll_seq`` of the trace)
SEQUENCED_KINDS = DP_KINDS


class Member(NamedTuple):
    """One member's state at entry into a collective: its protocol variables and scheduler queue lengths."""

    vars: RankVars
    waiting: int
    running: int


def collective_outcome(kind: str, members: Sequence[Member]) -> dict[str, int]:
    """The outcome arguments of collective ``kind`` completed by ``members`` (their states at entry).

    ``dp_sync``: SUM of has-unfinished (:func:`~weightsync.spec.states.unfinished_for_sync`) and of
    ``pending_pause``; ``resume_barrier``: MAX of has-unfinished and of ``current_wave``; other kinds carry
    no outcome (``{}``). Pure; the same arithmetic as the model's joint completion.

    Raises:
        ValueError: no members.
    """
    if not members:
        raise ValueError("a collective needs at least one member")
    contribs = [
        contribution(
            kind, m.vars.pause_state, m.waiting, m.running, m.vars.pending_pause, m.vars.current_wave
        )
        for m in members
    ]
    return dict(outcome_args(kind, reduce_values(kind, contribs)))


def _counts(rec: Mapping[str, Any]) -> tuple[int, int] | None:
    w, r = rec.get("waiting"), rec.get("running")
    if isinstance(w, int) and isinstance(r, int) and w >= 0 and r >= 0:
        return w, r
    return None


class TraceChecker:
    """The model's per-step check for :func:`weightsync.impl.checked.replay_trace` (a ``StepValidator``
    with a ``prepare`` hook that receives every record first, in file order).

    Attributes:
        outcomes_checked: collective completions whose outcome arguments were checked.
        has_work_checked: STEP / completion records whose ``has_work`` was checked against the counts.
        notes: what could not be checked (e.g. a trace without scheduler counts).
    """

    def __init__(self) -> None:
        self._done: dict[tuple[str, int], dict[int, Mapping[str, Any]]] = {}
        self._expected: dict[tuple[str, int, int], dict[str, int]] = {}
        self.outcomes_checked = 0
        self.has_work_checked = 0
        self.notes: list[str] = []

    def prepare(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Index every completion record by (kind, seq) and rank (look-ahead for the members' counts)."""
        self._done.clear()
        self._expected.clear()
        for rec in records:
            kind = KIND_OF_DONE.get(str(rec.get("event")))
            if kind in SEQUENCED_KINDS:
                seq = int(rec.get("coll_seq", 0)) - 1  # the completion record carries the next seq
                self._done.setdefault((kind, seq), {})[int(rec.get("rank", -1))] = rec
        if records and _counts(records[0]) is None:
            self.notes.append("trace has no scheduler counts: has-unfinished outcomes not checked")

    def __call__(self, step: int, rec: Mapping[str, Any], machines: list[RankMachine]) -> str | None:
        """Why ``rec`` (step ``step``) is not an edge of the model's composition, or None."""
        r = int(rec["rank"])
        event = str(rec["event"])
        v: RankVars = machines[r].vars
        kind = KIND_OF_DONE.get(event)
        failed_transfer = event == RankEvent.TRANSFER_FAILED.value and v.collective in TRANSFER_KINDS
        if v.collective and kind != v.collective and not failed_transfer:
            # a transfer collective also completes by failing (the model's joint TRANSFER_FAILED)
            return f"rank {r} is blocked in {v.collective}; only {v.collective}_done can fire there"
        counts = _counts(rec)
        if counts is not None and ("has_work" in rec.get("args", {})):
            want = schedulable(PauseState(v.pause_state), *counts)
            got = bool(rec["args"]["has_work"])
            self.has_work_checked += 1
            if got != want:
                return (
                    f"has_work={got} but the rank's scheduler (waiting={counts[0]}, running={counts[1]}, "
                    f"{PauseState(v.pause_state).value}) has work={want}"
                )
        if kind not in OUTCOME_KINDS:
            return None
        assert kind is not None
        seq = int(rec.get("coll_seq", 0)) - 1
        peers = dp_peers(machines, r)  # the collective's members: r's DP world
        key = (kind, seq, peers[0])
        expected = self._expected.get(key)
        if expected is None:  # the first completion: every member must be inside, at entry state
            done = self._done.get((kind, seq), {})
            members: list[Member] = []
            for q in peers:
                m = machines[q]
                if m.vars.collective != kind:
                    return (
                        f"{kind}#{seq} completes while rank {q} is "
                        f"{'in ' + m.vars.collective if m.vars.collective else 'not in a collective'}"
                    )
                qrec = done.get(q)
                if qrec is None:
                    return f"{kind}#{seq} completes on rank {r} but never on rank {q}"
                qc = _counts(qrec)
                members.append(Member(m.vars, *(qc if qc is not None else (0, 0))))
            expected = collective_outcome(kind, members)
            if any(_counts(done[q]) is None for q in done):
                expected = {k: x for k, x in expected.items() if "unfinished" not in k}
            self._expected[key] = expected
            self.outcomes_checked += 1
        args = rec.get("args", {})
        bad = {k: (args.get(k), x) for k, x in expected.items() if args.get(k) != x}
        if bad:
            shown = ", ".join(f"{k}={got} (model: {want})" for k, (got, want) in sorted(bad.items()))
            return f"{kind}#{seq} outcome {shown}, computed from the members' states at entry"
        return None


__all__ = [
    "KIND_OF_DONE",
    "OUTCOME_KINDS",
    "Member",
    "TraceChecker",
    "collective_outcome",
]
