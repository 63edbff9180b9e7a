"""The model's successor function replayed along a counterexample's labels: the states it visits (the repro
schedule compiler and the trace tools read a counterexample through these, never through its step text)."""

from __future__ import annotations

from typing import Any

from weightsync.model.system import G, Label, Model


def step_edge(model: Model, s: G, label: Label) -> G | None:
    """Validate one recorded step: the successor of ``s`` along ``label`` if that is an edge of the model,
    else None (trace validation / replay)."""
    lab = tuple(label)
    for l2, t in model.successors(s):
        if l2 == lab:
            return t
    return None


def replay_labels(model: Model, labels: list[Any]) -> tuple[list[G], int | None]:
    """Replay a label sequence from the initial state; returns the visited states and the index of the
    first label that is not an edge (None when every step is an edge)."""
    cur = model.initial()
    seen = [cur]
    for k, lab in enumerate(labels):
        nxt = step_edge(model, cur, lab)
        if nxt is None:
            return seen, k
        cur = nxt
        seen.append(cur)
    return seen, None


__all__ = ["replay_labels", "step_edge"]
