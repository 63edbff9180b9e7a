"""Counterexamples as people and replay read them: the shortest path to a violation as concrete edges of the
model (re-derived under symmetry reduction), numbered step texts, structured step records and labels."""

from __future__ import annotations

import itertools
from typing import Any

from weightsync.model.explorer import Exploration, Violation
from weightsync.model.properties import PROPERTIES
from weightsync.model.system import G, Label, Model, describe
from weightsync.spec.rank_vars import wave_dropped_for_good
from weightsync.spec.states import RankState


def concrete_path(model: Model, ex: Exploration[G], i: int, symmetry: bool) -> list[tuple[G, Label, G]]:
    """The shortest path to state ``i`` as concrete ``(state, label, next_state)`` edges of ``model``.

    Under symmetry reduction the stored states are canonical; the path is re-derived concretely by
    choosing, at every step, a successor whose canonical form is the next stored state."""
    path = ex.path(i)
    out: list[tuple[G, Label, G]] = []
    if not symmetry:
        for (_, a), (lab, b) in itertools.pairwise(path):
            out.append((ex.states[a], lab, ex.states[b]))
        return out
    cur = model.initial()
    for _, b in path[1:]:
        target = ex.states[b]
        for lab, t in model.successors(cur):
            if model.canon(t) == target:
                out.append((cur, lab, t))
                cur = t
                break
        else:  # pragma: no cover - canon not in the orbit
            raise RuntimeError("cannot concretize a symmetric counterexample path")
    return out


def unreduced_edges(
    model: Model, edges: list[tuple[G, Label, G]], edge_last: bool
) -> list[tuple[G, Label, G]]:
    """A path of ``model`` built with the silent-wave reduction (:mod:`~weightsync.model.system.reduction`)
    as a path of the same model without it: after each step, the START_DP_WAVE receipts the reduction stands
    for that the rank can make now (those at a head) are put back as ``("recv", i, f)`` steps of their own
    (none after the last step when ``edge_last``: the violation is that edge's), so the labels replay on the
    unreduced model (``weightsync repro``); every state it reaches has the reduced path's
    :meth:`~weightsync.model.system.reduction.SilentWaves.normal_form` (it may still hold messages the
    reduction removed from behind others, or from a blocked rank).

    Raises:
        RuntimeError: a step is not a move of the unreduced model, or it does not reach the reduced path's
            normal form (a defect of the reduction)."""
    full = Model(model.config, table=model.table, guards=model.guards, updates=model.updates)
    fw = model.f_wave
    out: list[tuple[G, Label, G]] = []
    cur = full.initial()

    def take(label: Label) -> None:
        nonlocal cur
        nxt = dict(full.successors(cur)).get(label)
        if nxt is None:
            raise RuntimeError(f"{label!r} is not a move of the unreduced model at step {len(out) + 1}")
        out.append((cur, label, nxt))
        cur = nxt

    for k, (_, label, target) in enumerate(edges):
        take(label)
        if edge_last and k == len(edges) - 1:
            break
        while True:
            ranks = cur.ranks
            i = next((i for i, r in enumerate(ranks) if _dropped_head(model, i, r)), -1)
            if i < 0:
                break
            take(("recv", i, fw))
        if model.normal_form(cur) != model.normal_form(target):
            raise RuntimeError(f"the unreduced path leaves the reduced one at step {len(out)}")
    return out


def _dropped_head(model: Model, i: int, r: Any) -> bool:
    """Rank ``i`` (slice ``r``) can receive, and the head of its wave FIFO is a START_DP_WAVE it drops for good."""
    q = r.inq[model.f_wave]
    return (
        bool(q)
        and not r.blocked
        and r.vars.state is not RankState.ERROR
        and q[0][0] == "W"
        and wave_dropped_for_good(r.vars, i, q[0][1], q[0][2])
    )


def counterexample_record(
    model: Model, ex: Exploration[G], v: Violation, *, symmetry: bool = False
) -> dict[str, Any]:
    """A counterexample as a dict: ``property``, ``mode``, ``statement``, ``steps`` (numbered strings) and
    ``records`` (structured :class:`~weightsync.model.system.steps.Step` dicts), and ``labels`` (the model's
    successor labels, for replay)."""
    edges = concrete_path(model, ex, v.state, symmetry)
    if v.label is not None:
        src = edges[-1][2] if edges else model.initial()
        if symmetry:
            cand = [
                (lab, t) for lab, t in model.successors(src) if v.property in model.edge_check(src, lab, t)
            ]
            lab, t = cand[0]
        else:
            lab, t = v.label, v.target
        edges.append((src, lab, t))
    if model.silent_waves:
        edges = unreduced_edges(model, edges, v.label is not None)
        model = Model(model.config, table=model.table, guards=model.guards, updates=model.updates)
    steps = [describe(model, a, lab, b) for a, lab, b in edges]
    texts = [f"{k}. {st.text}" for k, st in enumerate(steps, start=1)]
    final = edges[-1][2] if edges else model.initial()
    texts.append(f"{len(steps) + 1}. => {violation_text(model, v.property, final)}")
    return {
        "property": v.property,
        "mode": model.mode.value,
        "statement": PROPERTIES[v.property][0],
        "steps": texts,
        "records": [st._asdict() for st in steps],
        "labels": [list(lab) for _, lab, _ in edges],
    }


def violation_text(model: Model, prop: str, s: G) -> str:
    """One line describing how ``s`` violates ``prop``."""
    blocked = [f"rank {i} in {r.blocked}" for i, r in enumerate(s.ranks) if r.blocked]
    if s.trainer.blocked:
        blocked.append(f"trainer in {s.trainer.blocked}")
    states = ", ".join(f"rank {i} {r.vars.state.value}" for i, r in enumerate(s.ranks))
    if prop == "no_one_sided_collective":
        return f"one-sided collective: no transition enabled; blocked: {', '.join(blocked)}; {states}"
    if prop == "no_deadlock":
        return f"deadlock: no transition enabled and not a legitimate end; {states}"
    if prop == "collectives_match":
        return f"collectives do not match: {', '.join(blocked)}"
    if prop == "quiescence":
        return f"quiescence violated: a rank stepped into a DP collective; {', '.join(blocked)}"
    if prop.startswith("progress_"):
        return f"{prop}: from here no path reaches the goal ({PROPERTIES[prop][0]}); {states}"
    return f"{prop} violated: {PROPERTIES[prop][0]}; {states}"


__all__ = ["concrete_path", "counterexample_record", "unreduced_edges", "violation_text"]
