"""The model -> real-process compiler for driving a real vLLM through a model counterexample (glue between
:mod:`weightsync.model` and :mod:`weightsync.vllm`; it imports neither the implementation nor vLLM).

The model's shortest counterexample (``weightsync check --variant vllm-0.32 --ranks 2``, one pause mode) is
compiled from its **labels and states** (the model's successor function replayed along the labels,
:func:`weightsync.model.check.replay_labels`; no step text is parsed) into :class:`Action` s, one per model
step, each naming the driver action and the engine records that must follow (see
:mod:`weightsync.vllm.repro` for the driver and the table of actions). :func:`fix_divergence` says where a
fix's model leaves the same labels and which of its table rows differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.model.check import check, replay_labels
from weightsync.model.system import G, Model, message_event
from weightsync.spec.states import RankEvent, unfinished_for_sync

#: the rank variables vLLM has under the same name, compared between the model and the engine
COMPARED = ("engines_running", "current_wave", "pending_pause", "ignore_start_dp_wave", "pause_state")
#: observations taken before the event in vLLM (the probe records them on entry)
BEFORE = frozenset({"step", "resume"})
FIX_VARIANT = {"epoch": "vllm-0.32-epoch"}
CALL_METHOD = {"pause": "pause_scheduler", "resume": "resume_scheduler"}
#: the client->engine messages the driver holds (everything else, e.g. ``get_supported_tasks`` or the
#: driver's own ``weightsync_release``, passes)
HELD_KINDS = frozenset({"ADD", "ABORT", *CALL_METHOD.values()})


@dataclass
class Action:
    """One compiled model step: what the driver does and which engine records must follow.

    Attributes:
        step: 1-based index of the model step.
        label: the model's label (plain list).
        text: the model's step text (for the report only).
        kind: driver action: ``add``, ``call``, ``send``, ``release``, ``observe``, ``coord``, ``refresh``.
        rank: the rank acted on (-1: none / every rank).
        arg: the action's argument (the call, the held message kind, the collective).
        expect: ``(rank, ev, fields)`` engine records that must follow, in order per rank.
        model_vars: the model's compared variables per rank (after the step; before it for BEFORE events).
        coord: the coordinator's (current_wave, engines_running) after the step.
    """

    step: int
    label: list[Any]
    text: str
    kind: str
    rank: int = -1
    arg: Any = None
    expect: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    model_vars: dict[int, dict[str, Any]] = field(default_factory=dict)
    coord: tuple[int, bool] = (0, False)


def _vars(rk: Any) -> dict[str, Any]:
    v = rk.vars
    return {k: (int(getattr(v, k)) if k == "pause_state" else getattr(v, k)) for k in COMPARED}


def compile_schedule(model: Model, labels: list[Any], texts: list[str]) -> list[Action]:
    """The driver actions of ``labels`` on ``model`` (see the module docstring), from the model's states.

    Raises:
        ValueError: a label is not an edge of ``model`` (name and index), or one the driver cannot drive.
    """
    states, bad = replay_labels(model, labels)
    if bad is not None:
        raise ValueError(f"label {bad + 1} {labels[bad]!r} is not an edge of {model.config.variant}")
    out: list[Action] = []
    for k, lab in enumerate(labels):
        s, t = states[k], states[k + 1]
        out.append(action(model, k + 1, list(lab), texts[k] if k < len(texts) else "", s, t))
    return out


def action(model: Model, step: int, lab: list[Any], text: str, s: G, t: G) -> Action:
    """The :class:`Action` of the model edge ``s --lab--> t`` (step ``step``, 1-based).

    Raises:
        ValueError: a label or message the vLLM driver cannot drive (named with the step).
    """
    kind = lab[0]
    a = Action(step, lab, text, kind, coord=(int(t.coord[0]), bool(t.coord[1])))
    if kind == "send":
        a.kind, a.rank = "add", int(lab[1])
        a.arg = {"first_req": not bool(s.front[1])}
    elif kind == "fan":
        if int(lab[2]) >= 0:
            raise ValueError(f"step {step}: a fan-out to one rank ({lab!r}) is not driven on vLLM")
        a.kind, a.arg = "call", str(lab[1])
    elif kind == "recv":
        i, f = int(lab[1]), int(lab[2])
        m = s.ranks[i].inq[f][0]
        a.rank = i
        if m[0] == "W":
            a.kind, a.arg = "release", "START_DP_WAVE"
            a.expect = [(i, "START_DP_WAVE", {"wave": int(m[1]), "held": False})]
        elif m[0] == "ADD":
            a.kind, a.arg = "send", "ADD"
            a.expect = [(i, "ADD", {})]
        elif m[0] == "U" and m[1] in CALL_METHOD:
            a.kind, a.arg = "send", CALL_METHOD[m[1]]
            a.expect = [(i, "pause" if m[1] == "pause" else "resume", {})]
        else:
            raise ValueError(f"step {step}: rank {i} receives {m!r}, which the vLLM driver does not send")
        ev = a.expect[0][1]
        a.model_vars = {i: _vars(s.ranks[i] if ev in BEFORE else t.ranks[i])}
    elif kind == "step":
        i = int(lab[1])
        a.kind, a.rank = "observe", i
        a.expect = [
            (
                i,
                "step",
                {"has_work": bool(model._has_work(s.ranks[i])), "sync": t.ranks[i].blocked == "dp_sync"},
            )
        ]
        a.model_vars = {i: _vars(s.ranks[i])}
    elif kind == "done":
        coll = str(lab[1])
        a.kind, a.arg = "observe", coll
        ev, fields = {
            "dp_sync": ("step_done", {"synced": True}),
            "dp_step": ("step_done", {"synced": False}),
            "resume_barrier": ("resume_done", {"barrier": True}),
        }.get(coll, ("", {}))
        if not ev:
            raise ValueError(f"step {step}: collective {coll} is not driven on vLLM")
        a.expect = [(i, ev, fields) for i in range(model.n)]
        a.model_vars = {i: _vars(t.ranks[i]) for i in range(model.n)}
    elif kind == "coord":
        src = int(lab[1])
        a.kind, a.rank = "coord", src
        if src < 0:
            f = int(lab[2])
            m = s.coord_q[f][0]
            if m[0] != "FIRST_REQ":
                raise ValueError(f"step {step}: the coordinator receives {m!r} from the front-end")
            a.arg = "FIRST_REQ"
            fw = model.f_wave
            for j in range(model.n):
                if len(t.ranks[j].inq[fw]) > len(s.ranks[j].inq[fw]):
                    w = t.ranks[j].inq[fw][-1]
                    a.expect.append((j, "START_DP_WAVE", {"wave": int(w[1]), "held": True}))
        else:
            a.arg = str(s.ranks[src].outq[0][0])
    elif kind == "refresh":
        a.kind = "refresh"
        a.coord = (int(s.coord[0]), bool(s.coord[1]))
    else:
        raise ValueError(f"step {step}: label {lab!r} is not driven on vLLM")
    return a


def model_counterexample(variant: str, mode: str = "keep") -> dict[str, Any]:
    """The model's shortest counterexample of ``variant`` with 2 ranks in ``mode`` (check's JSON).

    Raises:
        RuntimeError: the model finds none (the variant is verified).
    """
    res = check(variant, 2, mode=mode, workers=1, progress=False)
    cx = res.get("counterexample")
    if not cx:
        raise RuntimeError(
            f"{variant} ({mode}): the model finds no counterexample (verdict {res['verdict']})"
        )
    return dict(cx)


def fix_divergence(buggy: Model, fixed: Model, labels: list[Any]) -> dict[str, Any]:
    """Where the fix's model leaves the buggy schedule: the first label that is no edge of ``fixed``
    (``impossible_step``, 1-based) and the table rows that fired differently before it (``fix_rows``:
    step, rank, event, the buggy row's guard and the fix's)."""
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
                        "fix_row": _row_name(fixed, sf[k], good[k], i),
                    }
                )
    return {"impossible_step": None if bad is None else bad + 1, "fix_rows": rows}


def _jsonable(x: Any) -> Any:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else x


def _row_name(model: Model, s: G, label: Any, rank: int) -> str:
    """The guard of the table row rank ``rank`` fired on edge ``label`` from ``s`` ("" if none of its)."""
    lab = list(label)
    rk = s.ranks[rank]
    kind = lab[0]
    extra: tuple[tuple[str, Any], ...]
    if kind == "recv" and int(lab[1]) == rank:
        ev, extra = message_event(model, rk, rk.inq[int(lab[2])][0])
    elif kind == "done" and lab[1] == "resume_barrier":
        ev = RankEvent.RESUME_BARRIER_DONE
        ranks = s.ranks
        mu = max(unfinished_for_sync(r.vars.pause_state, len(r.waiting), len(r.running)) for r in ranks)
        extra = (("max_unfinished", mu), ("max_wave", max(r.vars.current_wave for r in ranks)))
    else:
        return ""
    tr, _ = model.fire(rank, rk.vars, ev, extra)
    return f"{model.config.variant}: {rk.vars.state.value} --{ev.value}--> [{tr.guard}]" if tr else ""


__all__ = [
    "BEFORE",
    "CALL_METHOD",
    "COMPARED",
    "FIX_VARIANT",
    "HELD_KINDS",
    "Action",
    "action",
    "compile_schedule",
    "fix_divergence",
    "model_counterexample",
]
