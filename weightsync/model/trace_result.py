"""The trace walker's verdict (:class:`WalkResult`) and how a mismatch is reported: the model's state as
lines, and the fields where the model and the engine differ."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.model.system import (
    G,
)


@dataclass
class WalkResult:
    """The verdict of :func:`walk_trace`.

    Attributes:
        accepted: every step was an edge of the model and agreed with the records.
        steps: model steps taken.
        first_bad_line: the line of the first record of the step that did not match (None if accepted).
        reason: why it did not match ("" if accepted).
        model_state: the model's state there (one line per process).
        legal: the model's legal steps from that state (their descriptions).
        bad_groups: ``[proc, group]`` of the rejected rank step(s) (a joint completion has one per rank).
        notes: remarks on an accepted walk (stats adoptions moved back, messages left in flight).
    """

    accepted: bool
    steps: int
    first_bad_line: int | None = None
    reason: str = ""
    model_state: list[str] = field(default_factory=list)
    legal: list[str] = field(default_factory=list)
    bad_groups: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dict(self.__dict__)


def _diff(model: Mapping[str, Any], engine: Mapping[str, Any]) -> str:
    keys = sorted(set(model) | set(engine))
    return ", ".join(
        f"{k}: {model.get(k)!r} vs {engine.get(k)!r}" for k in keys if model.get(k) != engine.get(k)
    )


def _state_lines(s: G) -> list[str]:
    out = []
    for i, rk in enumerate(s.ranks):
        v = rk.vars
        out.append(
            f"rank {i}: {v.state.value} wave={v.current_wave} pause_state={v.pause_state.name} "
            f"blocked={rk.blocked or '-'} waiting={len(rk.waiting)} running={len(rk.running)} inputs={list(rk.inq)} "
            f"to_coord={list(rk.outq)}"
        )
    out.append(f"coordinator: (current_wave, engines_running)={tuple(s.coord)} inputs={list(s.coord_q)}")
    front = s.front
    believed = (front.believed_wave, front.believed_running)
    out.append(f"front-end: believed (wave, running)={believed} next_request={front.next_request}")
    out.append(
        f"controller: phase={s.ctrl.phase} cycles_started={s.ctrl.cycles_started} rounds={s.ctrl.update_rounds}"
    )
    return out


__all__ = ["WalkResult"]
