"""Transition descriptions: :class:`Step` records, message text and the message -> table event mapping."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from weightsync.model.system.effects import collective_args
from weightsync.model.system.state import (
    CALL_EVENT,
    PAUSE,
    TRANSFER_KINDS,
    GlobalState,
    Label,
    ModeSetting,
    Rank,
)
from weightsync.spec.collectives import COLLECTIVES
from weightsync.spec.states import Collective, PauseMode, RankEvent

if TYPE_CHECKING:
    from weightsync.model.system.model import Model


class Step(NamedTuple):
    """One counterexample step as a structured record.

    Attributes:
        process: who acts ("rank 1", "controller", "front-end", "coordinator", "trainer", "ranks 0,1").
        action: what it does ("receives", "steps", "enters", "fans out", "sends", "completes", ...).
        message: the message, call or collective involved (e.g. ``START_DP_WAVE(wave=1, exclude=0)``).
        detail: what the table did (guard, state change, effects) or the coordinator's reaction.
        lane_from: Mermaid lane of the sender for message arrows ("" for notes).
        lanes: Mermaid lanes the step concerns.
    """

    process: str
    action: str
    message: str
    detail: str
    lane_from: str
    lanes: tuple[str, ...]

    @property
    def text(self) -> str:
        """The human-readable one-liner, e.g. ``rank 1 receives START_DP_WAVE(wave=1, exclude=0) (...)``."""
        base = f"{self.process} {self.action} {self.message}".rstrip()
        return f"{base} ({self.detail})" if self.detail else base


def fmt_msg(m: tuple[Any, ...], mode: ModeSetting) -> str:
    """A message as text: ``ADD(req=0, wave=1)``, ``START_DP_WAVE(wave=1, exclude=0)``, ``pause(keep)``...
    (a pause names the mode its message carries, else the model's ``mode``)."""
    k = m[0]
    if k == "ADD":
        return f"ADD(req={m[1]}, wave={m[2]})"
    if k == "W":
        return f"START_DP_WAVE(wave={m[1]}, exclude={m[2]})"
    if k == "U":
        return f"pause({m[3] if len(m) > 3 else mode.value})" if m[1] == "pause" else str(m[1])
    if k == "FIRST_REQ":
        return f"FIRST_REQ(exclude={m[1]}, wave={m[2]})"
    if k == "ABORT":
        return f"ABORT(req={m[1]})"
    return f"{k}(wave={m[1]})"


def _label_mode(label: Label, at: int, mode: ModeSetting) -> str:
    """The pause mode a controller label names at index ``at`` (:data:`ANY_MODE`), else the model's."""
    return str(label[at]) if len(label) > at else str(mode.value)


def _lane_of_sender(m: tuple[Any, ...]) -> str:
    return {"ADD": "front-end", "ABORT": "front-end", "W": "coordinator", "U": "controller"}.get(m[0], "")


def message_event(
    model: Model, rank: Rank, m: tuple[Any, ...]
) -> tuple[RankEvent, tuple[tuple[str, Any], ...]]:
    """The table event and its arguments when a rank whose slice is ``rank`` receives message ``m``."""
    if m[0] == "ADD":
        return RankEvent.ADD, (("wave", m[2]),)
    if m[0] == "ABORT":
        return RankEvent.ABORT, ()
    if m[0] == "W":
        return RankEvent.START_DP_WAVE, (("exclude", m[2]), ("wave", m[1]))
    ev = CALL_EVENT[m[1]]
    return ev, model.call_extra(rank, ev, PauseMode(m[3]) if len(m) > 3 else None)


def _in_spec_order(kind: str, outcome: tuple[tuple[str, Any], ...]) -> list[tuple[str, Any]]:
    """The outcome arguments in the spec's order (``sum_unfinished`` before ``sum_pending_pause``)."""
    names = COLLECTIVES[Collective(kind)].outcome
    return sorted(outcome, key=lambda nv: names.index(nv[0]))


def describe(model: Model, s: GlobalState, label: Label, t: GlobalState) -> Step:
    """The :class:`Step` record of the edge ``s --label--> t`` (a successor of ``model``)."""
    kind = label[0]
    mode = model.mode

    def rank_detail(i: int, event: RankEvent, extra: tuple[tuple[str, Any], ...]) -> str:
        before = s.ranks[i].vars
        tr, after = model.fire(i, before, event, extra)
        if tr is None:
            return f"illegal in {before.state.value}: protocol error, rank {i} -> error"
        d = f"{tr.guard}: {before.state.value}->{after.state.value}"
        eff = [e for e in tr.effects if e not in ("execute_step",) and not e.startswith("enter_")]
        if eff:
            d += "; " + ", ".join(eff)
        if before.current_wave != after.current_wave:
            d += f"; wave {before.current_wave}->{after.current_wave}"
        if before.engines_running != after.engines_running:
            d += f"; engines_running={after.engines_running}"
        return d

    if kind == "recv":
        i, f = label[1], label[2]
        m = s.ranks[i].inq[f][0]
        ev, extra = message_event(model, s.ranks[i], m)
        d = rank_detail(i, ev, extra)
        if t.ranks[i].blocked and not s.ranks[i].blocked:
            d += f"; enters {t.ranks[i].blocked}"
        return Step(f"rank {i}", "receives", fmt_msg(m, mode), d, _lane_of_sender(m), (f"rank {i}",))
    if kind == "step":
        i = label[1]
        rank = s.ranks[i]
        has = model._has_work(rank)
        d = rank_detail(i, RankEvent.STEP, (("has_work", has),))
        batch = "a real batch" if has else "a dummy batch"
        after = t.ranks[i]
        msg = after.blocked if after.blocked else ""
        return Step(f"rank {i}", f"steps ({batch}) and enters", msg, d, "", (f"rank {i}",))
    if kind == "done":
        k = label[1]
        members = ",".join(str(i) for i in range(model.n))
        proc = f"ranks {members}" + (" and trainer" if k in TRANSFER_KINDS else "")
        outcome = collective_args(s.ranks, k)
        args = "(" + ", ".join(f"{n}={v}" for n, v in _in_spec_order(k, outcome)) + ")" if outcome else ""
        states = ", ".join(
            f"r{i}:{t.ranks[i].vars.state.value}/w{t.ranks[i].vars.current_wave}" for i in range(model.n)
        )
        lanes = tuple(f"rank {i}" for i in range(model.n)) + (("trainer",) if k in TRANSFER_KINDS else ())
        return Step(proc, "complete", k + args, states, "", lanes)
    if kind == "coord":
        src, f = label[1], label[2]
        m = s.coord_q[f][0] if src < 0 else s.ranks[src].outq[0]
        frm = "front-end" if m[0] == "FIRST_REQ" else f"rank {m[2]}"
        wave0, running0 = s.coord[:2]
        wave1, running1 = t.coord[:2]
        bc = [
            fmt_msg(q[-1], mode)
            for q, q0 in zip((r.inq[-1] for r in t.ranks), (r.inq[-1] for r in s.ranks), strict=True)
            if len(q) > len(q0)
        ]
        if (wave0, running0) == (wave1, running1) and not bc:
            d = f"ignored: current_wave={wave0}, running={running0}"
        else:
            d = f"current_wave {wave0}->{wave1}, running {running0}->{running1}"
            if bc:
                d += f"; broadcasts {bc[0]}"
        return Step("coordinator", "receives", fmt_msg(m, mode) + f" from {frm}", d, frm, ("coordinator",))
    if kind == "send":
        i = label[1]
        front = s.front
        wave, request = front.believed_wave, front.next_request
        d = f"stamped with believed wave {wave}"
        if not front.believed_running:
            d += f"; believes engines idle: FIRST_REQ(exclude={i}, wave={wave}) to the coordinator"
        return Step(
            "front-end",
            "sends",
            f"ADD(req={request}, wave={wave}) to rank {i}",
            d,
            "front-end",
            (f"rank {i}",),
        )
    if kind == "refresh":
        return Step(
            "front-end",
            "refreshes",
            "stats",
            f"believes wave={s.coord.current_wave}, running={s.coord.engines_running}",
            "",
            ("front-end",),
        )
    if kind == "fan":
        call, i = label[1], label[2]
        msg = f"pause({_label_mode(label, 3, mode)})" if call == "pause" else call
        if i < 0:
            return Step(
                "controller",
                "fans out",
                f"{msg} to every rank (atomic)",
                "",
                "controller",
                tuple(f"rank {j}" for j in range(model.n)),
            )
        return Step("controller", "fans out", f"{msg} to rank {i}", "", "controller", (f"rank {i}",))
    if kind == "fe":
        call = label[1]
        msg = f"pause({_label_mode(label, 2, mode)})" if call == "pause" else call
        d = "; ".join(
            f"r{i}:{s.ranks[i].vars.state.value}->{t.ranks[i].vars.state.value}" for i in range(model.n)
        )
        return Step(
            "front-end",
            "applies",
            f"{msg} to every rank machine (no message)",
            d,
            "",
            tuple(f"rank {j}" for j in range(model.n)),
        )
    if kind == "trainer":
        if t.trainer.blocked == "transfer_init":
            return Step("trainer", "enters", "transfer_init", "trainer_init", "", ("trainer",))
        return Step("trainer", "enters", "weight_broadcast", "trainer_send_weights", "", ("trainer",))
    if kind in ("retry", "extra"):
        call = label[1]
        msg = f"pause({_label_mode(label, 2, mode)})" if call == "pause" else call
        if kind == "retry":
            why = "a retry while the first is outstanding"
        elif s.ctrl.phase == PAUSE:
            why = "a repeated pause: its first is outstanding or returned, no round begun"
        else:
            why = "while a round is in flight"
        return Step(
            "controller",
            "fans out",
            f"{msg} to every rank again (untracked)",
            why,
            "controller",
            tuple(f"rank {j}" for j in range(model.n)),
        )
    if kind == "end":  # policy one_round only (spec/controller.py)
        return Step("controller", "ends the round", str(label[1]), "", "", ("controller",))
    if kind == "timeout":
        i, k = label[1], label[2]
        who = "trainer" if i < 0 else f"rank {i}"
        return Step(who, "times out of", k, "the collective can never complete", "", (who,))
    if kind == "abort":
        i, r = label[1], label[2]
        return Step(
            "front-end",
            "sends",
            f"ABORT(req={r}) to rank {i}",
            "the client aborts",
            "front-end",
            (f"rank {i}",),
        )
    raise ValueError(f"unknown label {label!r}")  # pragma: no cover
