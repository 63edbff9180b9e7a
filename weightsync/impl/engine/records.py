"""The per-rank trace records of the reference engine (``weightsync replay`` on per-rank traces, and the
records a rank reports to its client): JSON forms of :class:`~weightsync.impl.engine.messages.TransitionRecord`
and :class:`~weightsync.impl.engine.messages.RelabelRecord`."""

from __future__ import annotations

from typing import Any

from weightsync.impl.engine.messages import RankRecord, TransitionRecord
from weightsync.impl.engine.tracing import jsonable


def vars_dict(v: Any) -> dict[str, Any]:
    """A RankVars as a JSON-able dict (enums as values)."""
    return {k: jsonable(x) for k, x in v._asdict().items()}


#: A rank's weight version before any update (vLLM 0.32 ``EngineCore._weight_version``, ``v1/engine/core.py:141``).
INITIAL_WEIGHT_VERSION = "default"


def record_line(rec: RankRecord) -> dict[str, Any]:
    """The JSONL trace record of a transition (:func:`trace_line`) or of a relabel: ``kind="relabel"``,
    ``rank``, ``rank_seq``, ``weight_version`` (the new label), ``vars_before`` / ``vars_after``, ``t``
    (``weightsync replay`` applies :func:`~weightsync.spec.rank.relabel_weight_version` to it)."""
    if isinstance(rec, TransitionRecord):
        return trace_line(rec)
    return {
        "kind": "relabel",
        "rank": rec.rank,
        "rank_seq": rec.rank_seq,
        "weight_version": rec.weight_version,
        "vars_before": rec.before,
        "vars_after": rec.after,
        "t": rec.t,
    }


def trace_line(rec: TransitionRecord) -> dict[str, Any]:
    """The JSONL trace record of one transition (rank, seq, state before/after, event, wave, collective, time).

    Fields: ``kind="transition"``, ``rank``, ``rank_seq``, ``event``, ``args``, ``before`` / ``after`` (states),
    ``vars_before`` / ``vars_after`` (RankVars), ``guard``, ``effects``, ``wave`` (current_wave after),
    ``collective`` (DP/transfer collective entered, or ""), ``coll_seq`` (this rank's DP collective sequence
    number before the effects), ``t`` (seconds since the epoch), ``waiting`` / ``running`` (the scheduler's
    queue lengths before the effects; for a collective's completion, at entry).
    """
    return {
        "kind": "transition",
        "rank": rec.rank,
        "rank_seq": rec.rank_seq,
        "event": rec.event,
        "args": rec.args,
        "before": rec.before["state"],
        "after": rec.after["state"],
        "vars_before": rec.before,
        "vars_after": rec.after,
        "guard": rec.guard,
        "effects": list(rec.effects),
        "wave": rec.after["current_wave"],
        "collective": rec.collective,
        "coll_seq": rec.coll_seq,
        "t": rec.t,
        "waiting": rec.waiting,
        "running": rec.running,
    }
