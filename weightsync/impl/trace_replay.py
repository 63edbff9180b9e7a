"""The offline half of the runtime checker: :func:`replay_trace` validates a recorded trace by re-firing every
step on the rank tables (the runtime half, :class:`~weightsync.impl.checked.CheckedEngine`, writes such
traces)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.spec.calls import CALL_EVENT
from weightsync.spec.collectives import DP_KINDS, KIND_OF_DONE
from weightsync.spec.rank import (
    RankMachine,
    RankVars,
    dp_peers,
    get_variant,
    rank_machines,
    relabel_weight_version,
    select,
)
from weightsync.spec.states import PauseState, RankEvent, RankState

#: the DP collectives' completion events -> their kinds (spec/collectives.py)
_DONE_OF = {ev: kind for ev, kind in KIND_OF_DONE.items() if kind in DP_KINDS}
_DP_KINDS = DP_KINDS


def vars_to_dict(v: RankVars) -> dict[str, Any]:
    """RankVars as a JSON-able dict (enum values), the format of trace records."""
    out: dict[str, Any] = {}
    for k, x in v._asdict().items():
        out[k] = x.value if isinstance(x, RankState | PauseState) else x
    return out


def dict_to_vars(d: dict[str, Any]) -> RankVars:
    """The inverse of :func:`vars_to_dict`."""
    v = RankVars(**{k: d[k] for k in RankVars._fields if k in d})
    return v._replace(state=RankState(v.state), pause_state=PauseState(v.pause_state))


_CALLS = {str(e.value) for e in CALL_EVENT.values()}  # the controller calls (spec/controller.py)


@dataclass
class Divergence:
    """The first step of a trace that is not an edge of the model.

    Attributes:
        line: 1-based line number in the trace file.
        step: 0-based index of the transition among the trace's transitions.
        rank: the rank of the offending step.
        event: its event.
        reason: why it is not an edge.
        state: the rank's variables (model state) before the step.
        legal: the events legal there (by the table).
    """

    line: int
    step: int
    rank: int
    event: str
    reason: str
    state: dict[str, Any]
    legal: list[str]

    def describe(self) -> str:
        """One human-readable line."""
        return (
            f"step {self.step} (line {self.line}): rank {self.rank} {self.event}: {self.reason}; "
            f"state {self.state.get('state')} {self.state}; legal events there: {', '.join(self.legal)}"
        )


@dataclass
class ReplayResult:
    """Outcome of :func:`replay_trace`.

    Attributes:
        path: the trace file.
        ok: every step was an edge.
        steps: records checked (transitions and relabels).
        ranks: number of ranks.
        variant: the variant in the header.
        divergence: the first bad step, if any.
        collectives: DP collective entries checked.
        notes: what could not be checked.
        relabels: ``update_weight_version`` records applied (``kind="relabel"``; no transition).
    """

    path: str
    ok: bool
    steps: int
    ranks: int
    variant: str
    divergence: Divergence | None = None
    collectives: int = 0
    notes: list[str] = field(default_factory=list)
    relabels: int = 0


def _replay_relabel(rec: dict[str, Any], machines: list[RankMachine]) -> str | None:
    """Apply one ``kind="relabel"`` record (:func:`~weightsync.spec.rank.relabel_weight_version`) to its
    rank; why it does not replay, or None."""
    r = rec.get("rank")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(machines):
        return f"relabel record with rank {r!r} outside [0, {len(machines)})"
    m = machines[r]
    if "vars_before" in rec and dict(rec["vars_before"]) != vars_to_dict(m.vars):
        return f"recorded state {rec['vars_before']} differs"
    try:
        m.vars = relabel_weight_version(m.vars, rec.get("weight_version"))  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    if "vars_after" in rec and dict(rec["vars_after"]) != vars_to_dict(m.vars):
        return f"the spec gives {vars_to_dict(m.vars)}, trace says {rec['vars_after']}"
    return None


#: ``validate(step_index, record, machines) -> reason or None``: an extra per-step check (the model's).
StepValidator = Callable[[int, dict[str, Any], list[RankMachine]], str | None]


def _observed_differs(observed: Any, v: RankVars, when: str) -> str:
    """Why the engine's reported variables ``observed`` (a partial :func:`vars_to_dict`) differ from the
    table's ``v`` (``""`` when they agree or nothing was reported)."""
    if not observed:
        return ""
    table = vars_to_dict(v)
    bad = {k: (x, table.get(k, "<no such variable>")) for k, x in dict(observed).items() if table.get(k) != x}
    if not bad:
        return ""
    shown = ", ".join(f"{k}: engine {g!r}, table {w!r}" for k, (g, w) in sorted(bad.items()))
    return f"the engine reported {when} the event {shown}"


def replay_trace(
    path: str | Path, validate: StepValidator | None = None, variant: str | None = None
) -> ReplayResult:
    """Validate one JSONL trace (see the module docstring). Ranks interleave in file order.

    ``variant``: replay against this variant's table instead of the header's. A record may carry
    ``observed_before`` / ``observed``: some of the rank's variables as the engine itself reported them
    before / after the event (a real vLLM engine, :mod:`weightsync.vllm_tools.trace`); each must equal the
    table's value there, field by field.

    The header's ``lockstep`` (default True) says whether the ``dp_size`` engines are one DP world or each
    a world of one (:func:`~weightsync.spec.rank.rank_machines`); a DP collective is matched within its
    world (:func:`~weightsync.spec.rank.dp_peers`).

    Raises:
        ValueError: the file has no header line or a line is not JSON (input error, not a divergence).
    """
    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    recs: list[tuple[int, dict[str, Any]]] = []
    header: dict[str, Any] | None = None
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{i}: not JSON: {exc}") from exc
        if obj.get("kind") == "header":
            if header is None:
                header = obj
            continue
        recs.append((i, obj))
    if header is None:
        raise ValueError(f"{p}: no header line (kind=header with variant, dp_size, sync_interval)")
    variant = str(header["variant"]) if variant is None else variant
    n = int(header["dp_size"])
    k = int(header["sync_interval"])
    table = get_variant(variant).table
    machines = rank_machines(n, variant, k, lockstep=bool(header.get("lockstep", True)))
    for m, init in zip(machines, header.get("init") or [], strict=False):
        m.vars = dict_to_vars(init)
    entered: list[dict[int, str]] = [{} for _ in range(n)]  # rank -> {coll_seq: kind}
    res = ReplayResult(str(p), True, 0, n, variant)

    def diverge(line: int, step: int, rank: int, event: str, reason: str, v: RankVars) -> ReplayResult:
        legal = sorted({e.value for (s, e) in table if s == v.state})
        res.ok = False
        res.divergence = Divergence(line, step, rank, event, reason, vars_to_dict(v), legal)
        return res

    prepare = getattr(validate, "prepare", None)
    if callable(prepare):  # a validator that looks ahead (the model's, for the members' entry counts)
        prepare([rec for _, rec in recs])
    for step, (line, rec) in enumerate(recs):
        res.steps = step + 1
        if rec.get("kind") == "relabel":  # update_weight_version: no transition (spec relabel_weight_version)
            why = _replay_relabel(rec, machines)
            if why is not None:
                r = rec.get("rank")
                state = machines[r].vars if isinstance(r, int) and 0 <= r < n else RankVars()
                return diverge(line, step, r if isinstance(r, int) else -1, "relabel", why, state)
            res.relabels += 1
            continue
        try:
            r = int(rec["rank"])
            event = RankEvent(rec["event"])
            args = dict(rec.get("args", {}))
        except (KeyError, ValueError) as exc:
            return diverge(line, step, -1, str(rec.get("event")), f"malformed record: {exc}", RankVars())
        if not 0 <= r < n:
            return diverge(line, step, r, event.value, f"rank {r} outside [0, {n})", RankVars())
        m = machines[r]
        before = m.vars
        if "vars_before" in rec and dict(rec["vars_before"]) != vars_to_dict(before):
            return diverge(line, step, r, event.value, f"recorded state {rec['vars_before']} differs", before)
        differs = _observed_differs(rec.get("observed_before"), before, "before")
        if differs:
            return diverge(line, step, r, event.value, differs, before)
        kind = _DONE_OF.get(event.value)
        if kind is not None:
            seq = int(rec.get("coll_seq", 0)) - 1  # the DONE record carries the next sequence number
            for q in dp_peers(machines, r):
                if entered[q].get(seq) != kind:
                    what = entered[q].get(seq, "nothing")
                    return diverge(
                        line,
                        step,
                        r,
                        event.value,
                        f"{kind}#{seq} completed while rank {q} had entered {what} at #{seq} "
                        "(collective not matched by every rank)",
                        before,
                    )
        tr = select(table, before, event, {"rank": m.rank, "dp_size": m.dp_size, "sync_interval": k, **args})
        if tr is None:
            return diverge(line, step, r, event.value, "no transition of the table (illegal here)", before)
        if validate is not None:
            why = validate(step, rec, machines)
            if why:
                return diverge(line, step, r, event.value, why, before)
        m.fire(event, **args)
        if "vars_after" in rec and dict(rec["vars_after"]) != vars_to_dict(m.vars):
            return diverge(
                line,
                step,
                r,
                event.value,
                f"table gives {vars_to_dict(m.vars)}, trace says {rec['vars_after']}",
                before,
            )
        differs = _observed_differs(rec.get("observed"), m.vars, "after")
        if differs:
            return diverge(line, step, r, event.value, differs, before)
        coll = str(rec.get("collective", ""))
        if coll and rec.get("observed_before") is not None and coll != m.vars.collective:  # engine-reported
            differs = f"the engine entered {coll}, the table {m.vars.collective or 'no collective'}"
            return diverge(line, step, r, event.value, differs, before)
        if coll in _DP_KINDS:
            entered[r][int(rec.get("coll_seq", 0))] = coll
            res.collectives += 1
    return res


__all__ = ["Divergence", "ReplayResult", "StepValidator", "replay_trace"]
