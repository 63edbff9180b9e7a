"""``weightsync check --engine spin``: one pause mode checked by SPIN, as a
:class:`~weightsync.model.check.ModeResult`."""

from __future__ import annotations

from typing import Any

from weightsync.model.check import ModeResult, violation_text
from weightsync.model.counterexample import unreduced_edges
from weightsync.model.properties import HOLDS, NOT_CHECKED, PROGRESS, PROPERTIES, SAFETY, SOMETIMES, VIOLATED
from weightsync.model.system import Model


def spin_mode(model: Model, options: dict[str, Any] | None = None) -> ModeResult:
    """Check one mode with SPIN (:func:`weightsync.model.spin.run.spin_check`): safety and deadlock; the
    progress properties and the non-vacuity witnesses are not checked. SPIN stops at its first violation,
    so the other safety properties are then "not checked". The counterexample is SPIN's trail replayed on
    the model (:func:`weightsync.model.spin.run.replay`); with the silent-wave reduction, as a path of the
    unreduced model (:func:`~weightsync.model.counterexample.unreduced_edges`).

    Raises:
        SpinError: see ``spin_check`` (``options`` are its keyword arguments)."""
    from weightsync.model.spin.run import spin_check, steps_text

    res = spin_check(model, **(options or {}))
    props: dict[str, str] = {}
    for name in SAFETY:
        if name == res.violation:
            props[name] = VIOLATED
        else:
            props[name] = NOT_CHECKED if res.violation else HOLDS
    for name in (*PROGRESS, *SOMETIMES):
        props[name] = NOT_CHECKED
    cx = None
    if res.violation is not None:
        path, shown = res.path, model
        if model.silent_waves:  # the receipts the reduction stands for, put back as steps
            edge_last = bool(path) and res.violation in model.edge_check(*path[-1])
            path = unreduced_edges(model, path, edge_last)
            shown = Model(model.config, table=model.table, guards=model.guards, updates=model.updates)
        final = path[-1][2] if path else shown.initial()
        texts = steps_text(shown, path)
        texts.append(f"{len(texts) + 1}. => {violation_text(shown, res.violation, final)}")
        cx = {
            "property": res.violation,
            "mode": model.mode.value,
            "statement": PROPERTIES[res.violation][0],
            "steps": texts,
            "labels": [list(lab) for _, lab, _ in path],
            "engine": "spin",
        }
    return ModeResult(
        model.mode,
        res.states - 1,  # SPIN also stores its state before init's first step
        res.transitions - 1,
        res.depth - 1,
        res.seconds,
        props,
        cx,
        True,
        violation_depths={res.violation: len(res.path)} if res.violation else {},
        peak_rss_mb=res.memory_mb,
        levels_expanded=res.depth - 1,
        omission_bound=res.omission_bound,
    )


__all__ = ["spin_mode"]
