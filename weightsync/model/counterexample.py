"""Counterexamples as people and replay read them: the shortest path to a violation as concrete edges of the
model (re-derived under symmetry reduction), numbered step texts, structured step records and labels."""

from __future__ import annotations

import itertools
from typing import Any

from weightsync.model.explorer import Exploration, Violation
from weightsync.model.properties import PROPERTIES
from weightsync.model.system import G, Label, Model, describe


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


__all__ = ["concrete_path", "counterexample_record", "violation_text"]
