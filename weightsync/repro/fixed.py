"""A fix against a buggy variant's counterexample: where the fix's model leaves the same labels, which of its
table rows differ there, and the schedule of the labels on the fix's model up to that step
(``weightsync repro two-phase-epoch``, ``repro vllm-0.32 --engine vllm --fix epoch``)."""

from __future__ import annotations

from typing import Any

from weightsync.model.labels import replay_labels
from weightsync.model.system import G, Model, describe
from weightsync.repro.schedule import (
    COMPARED,
    Action,
    _jsonable,
    _vars,
    action,
    compile_schedule,
    fired_events,
)

FIX_VARIANT = {"epoch": "vllm-0.32-epoch"}


#: the buggy variant whose counterexample a fixed variant's ``repro`` drives by default
FIX_OF = {"two-phase-epoch": "two-phase", "vllm-0.32-epoch": "vllm-0.32"}


def fix_divergence(buggy: Model, fixed: Model, labels: list[Any]) -> dict[str, Any]:
    """Where the fix's model leaves the buggy schedule: the first label that is no edge of ``fixed``
    (``impossible_step``, 1-based) and the table rows that fired differently before it (``fix_rows``:
    step, rank, event, the buggy row's variables and the fix's, and the fix's row,
    ``"VARIANT: state --event--> [guard]"``)."""
    _, bad = replay_labels(fixed, labels)
    good = labels if bad is None else labels[:bad]
    sb, _ = replay_labels(buggy, good)
    sf, _ = replay_labels(fixed, good)
    rows: list[dict[str, Any]] = []
    for k in range(len(good)):
        for i in range(buggy.n):
            vb0, vb1 = sb[k].ranks[i].vars, sb[k + 1].ranks[i].vars
            vf0, vf1 = sf[k].ranks[i].vars, sf[k + 1].ranks[i].vars
            if vb0 == vb1 and vf0 == vf1:
                continue
            if _vars(sb[k + 1].ranks[i]) != _vars(sf[k + 1].ranks[i]) or vb1.state != vf1.state:
                rows.append(
                    {
                        "step": k + 1,
                        "rank": i,
                        "label": list(good[k]),
                        "buggy": {c: _jsonable(getattr(vb1, c)) for c in COMPARED},
                        "fix": {c: _jsonable(getattr(vf1, c)) for c in COMPARED},
                        "fix_row": _row_name(fixed, sf[k], good[k], i, sf[k + 1]),
                    }
                )
    return {"impossible_step": None if bad is None else bad + 1, "fix_rows": rows}


def fix_schedule(
    buggy: Model, fixed: Model, labels: list[Any], texts: list[str], engine: str = "vllm"
) -> tuple[list[Action], dict[str, Any]]:
    """The actions a fix's run drives, and :func:`fix_divergence`'s answer: ``labels`` compiled on the fix's
    model up to the step it makes impossible (their text: the fix's model's), then that step on the buggy
    model's terms, with ``texts``' line for it (the driver must find it does not happen).

    Raises:
        ValueError: a label is not an edge of ``buggy``, or one the driver cannot drive.
    """
    div = fix_divergence(buggy, fixed, labels)
    impossible = div["impossible_step"]
    driven = labels if impossible is None else labels[: impossible - 1]
    fs, _ = replay_labels(fixed, driven)  # the steps' text as the fix's model tells them
    ftexts = [
        f"{k + 1}. {describe(fixed, fs[k], tuple(lab), fs[k + 1]).text}" for k, lab in enumerate(driven)
    ]
    actions = compile_schedule(fixed, driven, ftexts, engine)
    if impossible is not None:
        states, bad = replay_labels(buggy, labels[:impossible])
        if bad is not None:
            raise ValueError(f"label {bad + 1} {labels[bad]!r} is not an edge of {buggy.config.variant}")
        text = texts[impossible - 1] if impossible - 1 < len(texts) else ""
        actions.append(
            action(buggy, impossible, list(labels[impossible - 1]), text, states[-2], states[-1], engine)
        )
    return actions, div


def _row_name(model: Model, s: G, label: Any, rank: int, t: G) -> str:
    """The table row rank ``rank`` fired on edge ``label`` from ``s`` to ``t``, ``"VARIANT: state --event-->
    [guard]"`` ("" if the edge fires none of its rows)."""
    for i, ev, extra in fired_events(model, s, label, t):
        if i == rank:
            v = s.ranks[rank].vars
            tr, _ = model.fire(rank, v, ev, extra)
            return f"{model.config.variant}: {v.state.value} --{ev.value}--> [{tr.guard}]" if tr else ""
    return ""


__all__ = ["FIX_OF", "FIX_VARIANT", "fix_divergence", "fix_schedule"]
