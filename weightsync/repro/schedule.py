"""The model -> real-process compiler behind ``weightsync repro`` on both engines (glue between
:mod:`weightsync.model` and the drivers in :mod:`weightsync.repro.engine` and :mod:`weightsync.repro.vllm.run`;
it imports neither the implementation nor vLLM).

A model counterexample (``weightsync check --variant V --ranks 2``, one pause mode) is compiled from its
**labels and states** (the model's successor function replayed along the labels,
:func:`weightsync.model.check.replay_labels`; no step text is parsed) into :class:`Action` s, one per model
step. Each names the driver action and what must be observed after it:

- for every engine: the table rows the step fires (``fired``: rank, event, guard, the rank's variables after
  the row), every rank's variables and blocking collective after the step, what the step consumes from a
  channel (``channel``, ``message``) and every channel's contents after it (``channels``), the coordinator's
  and the front-end's ``(current_wave, engines_running)``, and the collective the trainer is in;
- for vLLM: the probe records that must follow (``expect``) and vLLM's variables (``model_vars``), see
  :mod:`weightsync.repro.vllm.run`.

Messages are compared in one plain form (:func:`wire`): ``("ADD", req, wave)``, ``("ABORT", req)``,
``("START_DP_WAVE", wave, exclude)``, ``(call,)``, ``("FIRST_REQ", exclude, wave)``, ``("wave_complete",
wave)``, ``("start_wave", wave, sender)``. Channels are keyed ``(rank, name)``: ``front`` (front-end -> rank),
``control`` (controller -> rank), ``wave`` (coordinator -> rank), ``coord`` (rank -> coordinator; rank -1: the
front-end's FIRST_REQ).

:func:`fix_divergence` says where a fix's model leaves the same labels and which of its table rows differ;
:func:`fix_schedule` compiles the labels on the fix's model up to that step and the step itself on the
buggy model's terms; :func:`final_state` is where the model says the ranks end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from weightsync.model.check import check
from weightsync.model.labels import replay_labels
from weightsync.model.system import CALL_EVENT, DONE_EVENT, G, Model, message_event
from weightsync.model.system.effects import collective_args as model_collective_args
from weightsync.spec.collectives import done_args
from weightsync.spec.front_end import FrontEvent
from weightsync.spec.rank import RankVars
from weightsync.spec.states import RankEvent

#: the rank variables vLLM has under the same name, compared between the model and the engine
COMPARED = ("engines_running", "current_wave", "pending_pause", "ignore_start_dp_wave", "pause_state")
#: observations taken before the event in vLLM (the probe records them on entry)
BEFORE = frozenset({"step", "resume"})
CALL_METHOD = {"pause": "pause_scheduler", "resume": "resume_scheduler"}
#: the client->engine messages the driver holds (everything else, e.g. ``get_supported_tasks`` or the
#: driver's own ``weightsync_release``, passes)
HELD_KINDS = frozenset({"ADD", "ABORT", *CALL_METHOD.values()})
#: the engines a schedule is compiled for, and the driver action of each model label kind on the reference
#: engine (the vLLM driver's are set in :func:`action`)
ENGINES = ("vllm", "reference")
REFERENCE_KIND = {
    "send": "add",
    "fan": "call",
    "fe": "fe",
    "recv": "release",
    "step": "step",
    "done": "observe",
    "coord": "coord",
    "refresh": "refresh",
}

#: the guard :data:`Fired` names for an event no row of the table takes (the model's rank goes to error)
ILLEGAL = "(illegal)"
#: a channel: (rank, name); rank -1 with ``coord``: the front-end's FIFO to the coordinator
Channel = tuple[int, str]
#: a table row fired by a model step: (rank, event, guard, the rank's variables after the row)
Fired = tuple[int, str, str, dict[str, Any]]


@dataclass
class Action:
    """One compiled model step: what the driver does and what must be observed after it.

    Attributes:
        step: 1-based index of the model step.
        label: the model's label (plain list).
        text: the model's step text (for the report only).
        kind: driver action: ``add``, ``call``, ``send``, ``release``, ``observe``, ``coord``, ``refresh``
            (vLLM), or ``add``, ``call``, ``fe``, ``release``, ``step``, ``observe``, ``coord``, ``refresh``
            (reference, :data:`REFERENCE_KIND`).
        rank: the rank acted on (-1: none / every rank / the front-end).
        arg: the action's argument (the call, the held message kind, the collective).
        expect: (vLLM) ``(rank, ev, fields)`` probe records that must follow, in order per rank.
        model_vars: (vLLM) the model's compared variables per rank (after the step; before it for BEFORE).
        coord: the coordinator's (current_wave, engines_running) after the step.
        channel: the channel the step takes a message from (recv, coord), else ``(-1, "")``.
        message: that message (:func:`wire`), or for ``send`` the ADD sent.
        fired: the table rows the step fires (see :data:`Fired`; guard :data:`ILLEGAL` for an event no
            row takes), in order; an outcome a row's effect causes (a worker's finish) is not listed but
            shows in ``vars_after``.
        vars_after: every rank's variables after the step (plain values: enums as their values).
        blocked_after: every rank's collective after the step ("" when none).
        channels: every non-empty channel's messages after the step (:func:`wire`).
        front: the front-end's believed (current_wave, engines_running) after the step.
        trainer: the collective the trainer is in after the step ("" when none).
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
    channel: Channel = (-1, "")
    message: tuple[Any, ...] = ()
    fired: list[Fired] = field(default_factory=list)
    vars_after: dict[int, dict[str, Any]] = field(default_factory=dict)
    blocked_after: dict[int, str] = field(default_factory=dict)
    channels: dict[Channel, list[tuple[Any, ...]]] = field(default_factory=dict)
    front: tuple[int, bool] = (0, False)
    trainer: str = ""


@dataclass
class FinalState:
    """Where the model's run of a schedule ends.

    Attributes:
        blocked: every rank's collective ("" when none).
        vars: every rank's variables (plain values).
        channels: every non-empty channel's messages (:func:`wire`).
        trainer: the collective the trainer is in ("" when none).
        terminal: no transition of the model is enabled (a deadlock), so letting every message flow and
            every rank step cannot change it.
        requests: requests the front-end sent.
    """

    blocked: dict[int, str]
    vars: dict[int, dict[str, Any]]
    channels: dict[Channel, list[tuple[Any, ...]]]
    trainer: str
    terminal: bool
    requests: int


def _vars(rk: Any) -> dict[str, Any]:
    v = rk.vars
    return {k: (int(getattr(v, k)) if k == "pause_state" else getattr(v, k)) for k in COMPARED}


def plain_vars(v: RankVars) -> dict[str, Any]:
    """A rank's variables as plain values (enums as their values; the engines report theirs so too)."""
    return {k: (x.value if isinstance(x, Enum) else x) for k, x in v._asdict().items()}


def wire(m: tuple[Any, ...]) -> tuple[Any, ...]:
    """A model message in the plain form both drivers compare (see the module docstring)."""
    k = m[0]
    if k == "ADD":
        return ("ADD", int(m[1]), int(m[2]))
    if k == "ABORT":
        return ("ABORT", int(m[1]))
    if k == "W":
        return ("START_DP_WAVE", int(m[1]), int(m[2]))
    if k == "U":
        return (str(m[1]),)
    if k == "FIRST_REQ":
        return ("FIRST_REQ", int(m[1]), int(m[2]))
    if k == "wave_complete":
        return ("wave_complete", int(m[1]))
    return (str(k), int(m[1]), int(m[2]))  # start_wave(wave, sender)


def channel_names(model: Model) -> dict[int, str]:
    """The name of each rank input FIFO of ``model`` (per-socket channels only).

    Raises:
        ValueError: ``model`` does not use per-socket channels (one FIFO per socket, as both engines).
    """
    if model.config.channels != "per-socket":
        raise ValueError(
            f"channels {model.config.channels!r}: the engines have one FIFO per socket (per-socket)"
        )
    return {model.f_add: "front", model.f_ctrl: "control", model.f_wave: "wave"}


def channels(model: Model, s: G) -> dict[Channel, list[tuple[Any, ...]]]:
    """Every non-empty channel of ``s`` and its messages, oldest first (:func:`wire`)."""
    names = channel_names(model)
    out: dict[Channel, list[tuple[Any, ...]]] = {}
    for i, rk in enumerate(s.ranks):
        for f, q in enumerate(rk.inq):
            if q:
                out[(i, names[f])] = [wire(m) for m in q]
        if rk.outq:
            out[(i, "coord")] = [wire(m) for m in rk.outq]
    if s.coord_q[0]:
        out[(-1, "coord")] = [wire(m) for m in s.coord_q[0]]
    return out


def collective_args(model: Model, s: G, kind: str) -> tuple[tuple[str, Any], ...]:
    """The arguments every member's outcome event of collective ``kind`` carries in ``s`` (besides
    ``has_work``): the DP sync's sums, the resume barrier's maxima (the model's joint completion,
    :func:`weightsync.model.system.effects.collective_args`, over the spec's reductions)."""
    return model_collective_args(s.ranks, kind)


def fired_events(
    model: Model, s: G, label: Any, t: G
) -> list[tuple[int, RankEvent, tuple[tuple[str, Any], ...]]]:
    """The table events (rank, event, arguments) the model edge ``s --label--> t`` fires, in order.

    Raises:
        ValueError: a label no engine driver drives (an injected failure, a timeout, a client abort, a
            retried or extra controller call).
    """
    lab = list(label)
    kind = lab[0]
    if lab[-1] == "fail":
        raise ValueError(f"label {lab!r}: injected failures are not driven on real processes")
    if kind == "recv":
        i = int(lab[1])
        rk = s.ranks[i]
        ev, extra = message_event(model, rk, rk.inq[int(lab[2])][0])
        return [(i, ev, extra)]
    if kind == "step":
        i = int(lab[1])
        return [(i, RankEvent.STEP, (("has_work", bool(model._has_work(s.ranks[i]))),))]
    if kind == "done":
        coll = str(lab[1])
        common = collective_args(model, s, coll)
        return [
            (i, DONE_EVENT[coll], done_args(coll, common, bool(model._has_work(r))))
            for i, r in enumerate(s.ranks)
        ]
    if kind == "fe":
        ev = CALL_EVENT[str(lab[1])]
        return [(i, ev, model.call_extra(r, ev)) for i, r in enumerate(s.ranks)]
    if kind == "fan":
        # a call the model delivers at once (a no-op resume) is received with the fan-out
        ev = CALL_EVENT[str(lab[1])]
        f = model.f_ctrl
        return [
            (i, ev, model.call_extra(r, ev))
            for i, r in enumerate(s.ranks)
            if len(t.ranks[i].inq[f]) == len(r.inq[f])
        ]
    if kind in ("send", "coord", "refresh"):
        return []
    raise ValueError(f"label {lab!r} is not driven on real processes")


def compile_schedule(model: Model, labels: list[Any], texts: list[str], engine: str = "vllm") -> list[Action]:
    """The driver actions of ``labels`` on ``model`` for ``engine`` (see the module docstring), from the
    model's states.

    Raises:
        ValueError: a label is not an edge of ``model`` (name and index), or one the driver cannot drive.
    """
    states, bad = replay_labels(model, labels)
    if bad is not None:
        raise ValueError(f"label {bad + 1} {labels[bad]!r} is not an edge of {model.config.variant}")
    out: list[Action] = []
    for k, lab in enumerate(labels):
        s, t = states[k], states[k + 1]
        out.append(action(model, k + 1, list(lab), texts[k] if k < len(texts) else "", s, t, engine))
    return out


def action(model: Model, step: int, lab: list[Any], text: str, s: G, t: G, engine: str = "vllm") -> Action:
    """The :class:`Action` of the model edge ``s --lab--> t`` (step ``step``, 1-based) for ``engine``.

    Raises:
        ValueError: an unknown engine, or a label or message its driver cannot drive (named with the step).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    kind = lab[0]
    try:
        fired = fired_events(model, s, lab, t)
    except ValueError as exc:
        raise ValueError(f"step {step}: {exc}") from None
    a = Action(step, lab, text, kind, coord=(int(t.coord.current_wave), bool(t.coord.engines_running)))
    for i, ev, extra in fired:
        tr, after = model.fire(i, s.ranks[i].vars, ev, extra)  # no row: illegal, the rank -> error
        a.fired.append((i, ev.value, tr.guard if tr is not None else ILLEGAL, plain_vars(after)))
    a.vars_after = {i: plain_vars(r.vars) for i, r in enumerate(t.ranks)}
    a.blocked_after = {i: r.blocked for i, r in enumerate(t.ranks)}
    a.front = (int(t.front.believed_wave), bool(t.front.believed_running))
    a.trainer = str(t.trainer.blocked)
    if engine == "reference":
        a.channels = channels(model, t)
        _reference(model, a, lab, s, t)
    else:
        _vllm(model, a, lab, s, t)
    return a


def _reference(model: Model, a: Action, lab: list[Any], s: G, t: G) -> None:
    kind = lab[0]
    a.kind = REFERENCE_KIND[kind]
    if kind in ("send", "recv", "step"):
        a.rank = int(lab[1])
    if kind == "send":
        a.message = wire(t.ranks[a.rank].inq[model.f_add][-1])
    elif kind == "recv":
        f = int(lab[2])
        a.channel = (a.rank, channel_names(model)[f])
        a.message = wire(s.ranks[a.rank].inq[f][0])
    elif kind == "coord":
        src = int(lab[1])
        a.rank, a.channel = src, (src, "coord")
        a.message = wire(s.coord_q[int(lab[2])][0] if src < 0 else s.ranks[src].outq[0])
    elif kind in ("fan", "fe"):
        if kind == "fan" and int(lab[2]) >= 0:
            raise ValueError(f"step {a.step}: a fan-out to one rank ({lab!r}) is not driven")
        a.arg = str(lab[1])
    elif kind == "done":
        a.arg = str(lab[1])
    entered = t.trainer.blocked
    if entered and entered != s.trainer.blocked and entered != "weight_broadcast":
        raise ValueError(f"step {a.step}: the trainer entering {entered} is not driven")


def _vllm(model: Model, a: Action, lab: list[Any], s: G, t: G) -> None:
    kind = lab[0]
    step = a.step
    if kind == "send":
        a.kind, a.rank = "add", int(lab[1])
        # the front-end's table (spec/front_end.py) decides: FIRST_REQ goes out when its row sends one (not
        # while the front-end-pause gate holds the request, nor while it believes the engines running)
        effects, _ = model._front(s.front, FrontEvent.SEND_REQUEST, target=a.rank)
        a.arg = {"first_req": "send_first_req" in effects}
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
        a.coord = (int(s.coord.current_wave), bool(s.coord.engines_running))
    else:
        raise ValueError(f"step {step}: label {lab!r} is not driven on vLLM")


def final_state(model: Model, labels: list[Any]) -> FinalState:
    """Where the model's run of ``labels`` ends (see :class:`FinalState`).

    Raises:
        ValueError: a label is not an edge of ``model``.
    """
    states, bad = replay_labels(model, labels)
    if bad is not None:
        raise ValueError(f"label {bad + 1} {labels[bad]!r} is not an edge of {model.config.variant}")
    end = states[-1]
    return FinalState(
        {i: r.blocked for i, r in enumerate(end.ranks)},
        {i: plain_vars(r.vars) for i, r in enumerate(end.ranks)},
        channels(model, end) if model.config.channels == "per-socket" else {},
        str(end.trainer.blocked),
        not model.successors(end),
        int(end.front.next_request),
    )


def model_counterexample(variant: str, mode: str = "keep", of: str | None = None) -> dict[str, Any]:
    """The model's shortest counterexample of ``variant`` with 2 ranks in ``mode`` (check's JSON): of
    property ``of``, or (None) the most specific violation.

    Raises:
        RuntimeError: the model finds none (the variant is verified), or none of ``of``.
    """
    res = check(variant, 2, mode=mode, workers=1, progress=False, counterexample_of=of)
    cx = res.get("counterexample")
    if not cx or (of is not None and cx["property"] != of):
        what = "no counterexample" if of is None else f"no counterexample of {of}"
        raise RuntimeError(f"{variant} ({mode}): the model finds {what} (verdict {res['verdict']})")
    return dict(cx)


def _jsonable(x: Any) -> Any:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else x


__all__ = [
    "BEFORE",
    "CALL_METHOD",
    "COMPARED",
    "ENGINES",
    "HELD_KINDS",
    "ILLEGAL",
    "REFERENCE_KIND",
    "Action",
    "Channel",
    "FinalState",
    "Fired",
    "action",
    "channels",
    "collective_args",
    "compile_schedule",
    "final_state",
    "fired_events",
    "model_counterexample",
    "plain_vars",
    "wire",
]
