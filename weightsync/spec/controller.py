"""The RL controller's cycle as a table: which call it makes next after each phase.

The controller (an RL orchestrator) drives every engine rank through ``pause -> [init] -> start -> update ->
finish -> resume``, or ``pause -> resume``. Its state is the phase whose call it made last
(:class:`Phase`) and a few counters (:class:`CtrlVars`). It reacts to the outcome of that call on every
rank (and on the trainer for the phases the trainer joins, :data:`TRAINER_COLLECTIVE`): :class:`CtrlEvent`
``DONE`` (every one answered without an error), ``FAILED`` (every one answered and some answered with an
error: a refusal, a failed transfer) or ``WAITING`` (some have not answered yet). Every row names the call
it makes (its target phase's, :data:`PHASE_CALL`) by its effect.

Two users execute the same table (no second copy of these rules anywhere):

- the model (:meth:`weightsync.model.system.environment.Environment._controller`) explores **every** row
  whose guard holds (:func:`controller_choices`), under policy ``recover``;
- the reference implementation (:func:`weightsync.impl.engine.controller.update_round`) takes the
  **first** row whose guard holds (:func:`controller_next`), under policy ``one_round``.

The two policies differ only where a phase failed, and each difference is a named row with a named guard
(``recovers`` / ``gives_up``):

- ``recover`` (the model: a persistent RL controller that recovers without a restart): after a failed
  init it initialises again (the transfer group is gone); after any other failure it carries the round
  through (a failed rank refuses the later calls: ``spec/rank.py`` state ``failed``) and then runs a new
  round with the same version (the version is the count of successful rounds + 1, :func:`call_version`)
  before it resumes, so a resume never meets a failed rank.
- ``one_round`` (``update_round``, one round per call, its caller decides about retries): it resumes only
  when the engines hold a complete set of weights -- the round finished, or it failed before any weight
  moved (``start_weight_update`` failed) -- and otherwise raises at once: after a failed
  ``update_weights`` or ``finish_weight_update`` a resume would serve a mix of old and new weights
  (``UpdateFailedError``), and after a failed pause the ranks may stand in different states (some
  verified, some not), where a resume would send the verified ones alone into the resume barrier (vLLM
  PR #39366's all-reduce, ``v1/engine/core.py:2250-2273`` in vLLM 0.32), so it raises the pause's error.

Bounds of the model enter as arguments (``cycles``, ``stray_resume``, ...); ``update_round`` passes one
cycle, the transfer engine initialised (its trainer's ``trainer_init`` did it) and none of the extra calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, NamedTuple

from weightsync.spec.calls import (
    CALL_EVENT,
    PAUSE_ARGS,
    PHASE_CALL,
    TRAINER_COLLECTIVE,
    Phase,
    front_end_answers,
)
from weightsync.spec.table import (
    ALWAYS,
    Transition,
    apply_transition,
    enabled_transitions,
    registry_digest,
    select_transition,
    table_digest,
)


class CtrlEvent(StrEnum):
    """The outcome of the current phase's call, as the controller sees it."""

    DONE = "done"  # every rank (and the trainer, where it joins) answered without an error; IDLE: always
    FAILED = "failed"  # every one answered, some with an error (a refusal, a failed transfer)
    WAITING = "waiting"  # some have not answered yet


class Policy(StrEnum):
    """Who runs the table (see the module docstring)."""

    RECOVER = "recover"  # the model's RL controller: carry a failed round through, then a new round
    ONE_ROUND = "one_round"  # update_round: one round; resume only if no weight moved or the round finished


#: The table's arguments for one reference-controller cycle (``update_round``, the repro driver finishing a
#: schedule's cycle): policy ``one_round``, one cycle, no extra calls.
ONE_ROUND_ARGS: dict[str, Any] = {
    "policy": Policy.ONE_ROUND,
    "cycles": 1,
    "requests_sent": 1,
    "stray_resume": False,
    "repeat_resume": False,
    "pause_during_update": False,
    "resume_during_update": False,
    "repeat_pause": False,
    "init_while_serving": False,
}


class CtrlVars(NamedTuple):
    """The controller's variables.

    Attributes:
        state: the phase: the call it made last (also :attr:`phase`).
        cycles_started: pause/update/resume cycles begun.
        update_rounds: successful rounds (a finish every rank answered without an error).
        transfer_initialised: ``init_weight_transfer_engine`` has been called.
        stray_resume_used: the one resume no pause preceded was sent (model bound ``stray_resume``).
        repeat_resume_used: the one retried resume was sent (model bound ``repeat_resume``).
        recovering: a round failed and no round has succeeded since.
        extra_used: bits ``X_PAUSE`` / ``X_RESUME`` / ``X_REPEAT_PAUSE`` / ``X_INIT_SERVING_USED``: the
            second pause / the resume during an update / the repeated pause / the init while serving were
            sent (bounds ``pause_during_update`` ... ``init_while_serving``); ``X_INIT_SERVING``: it is now.
    """

    state: Phase = Phase.IDLE
    cycles_started: int = 0
    update_rounds: int = 0
    transfer_initialised: bool = True
    stray_resume_used: bool = False
    repeat_resume_used: bool = False
    recovering: bool = False
    extra_used: int = 0

    @property
    def phase(self) -> Phase:
        """The call the controller made last."""
        return self.state


#: ``extra_used`` bits.
X_PAUSE, X_RESUME, X_REPEAT_PAUSE = 1, 2, 4
X_INIT_SERVING, X_INIT_SERVING_USED = 8, 16


def _serving_init(v: CtrlVars) -> bool:  # the phase init is the one sent while serving, not a lazy one
    return bool(v.extra_used & X_INIT_SERVING)


def controller_event(phase: int, answered: bool, failed: bool) -> CtrlEvent:
    """The controller's event: ``DONE`` in IDLE (no call outstanding), else ``WAITING`` until every one
    ``answered``, then ``FAILED`` if some answer was an error (``failed``), else ``DONE``."""
    if phase == Phase.IDLE:
        return CtrlEvent.DONE
    if not answered:
        return CtrlEvent.WAITING
    return CtrlEvent.FAILED if failed else CtrlEvent.DONE


def init_holds_requests(phase: int, cycles_started: int, answered: Callable[[], bool]) -> bool:
    """An orchestrator that initialises the transfer engine before serving (the row ``init_before_serving``)
    holds client requests until that init answered (``answered`` is asked only then)."""
    return phase == Phase.INIT and cycles_started == 0 and not answered()


Args = Mapping[str, Any]


def _cycles_left(v: CtrlVars, a: Args) -> bool:
    return v.cycles_started < int(a["cycles"])


def _recover(a: Args) -> bool:
    return bool(a["policy"] == Policy.RECOVER)


def _one_round(a: Args) -> bool:
    return bool(a["policy"] == Policy.ONE_ROUND)


#: Arguments: ``policy`` (:class:`Policy`), ``cycles`` (cycles the controller may run), ``requests_sent``
#: (client requests sent so far), and the model's bounds ``stray_resume``, ``repeat_resume``,
#: ``pause_during_update``, ``resume_during_update``, ``repeat_pause`` (bools; ``update_round`` passes
#: False).
CTRL_GUARDS = {
    "cycles_left": _cycles_left,
    "init_before_serving": lambda v, a: (
        _cycles_left(v, a) and not v.transfer_initialised and int(a["requests_sent"]) == 0
    ),
    "stray_resume_left": lambda v, a: bool(a["stray_resume"]) and not v.stray_resume_used,
    "initialised": lambda v, a: v.transfer_initialised,
    "not_initialised": lambda v, a: not v.transfer_initialised,
    "recovering_or_in_cycle": lambda v, a: not _serving_init(v) and (v.recovering or v.cycles_started > 0),
    "in_cycle_not_recovering": lambda v, a: (
        not _serving_init(v) and not v.recovering and v.cycles_started > 0
    ),
    "serving_not_started": lambda v, a: (
        not _serving_init(v) and not v.recovering and v.cycles_started == 0 and _cycles_left(v, a)
    ),
    "init_while_serving_left": lambda v, a: (
        bool(a["init_while_serving"]) and not v.extra_used & X_INIT_SERVING_USED
    ),
    "serving_init_cycles_left": lambda v, a: _serving_init(v) and _cycles_left(v, a),
    "serving_init_over": lambda v, a: _serving_init(v) and not _cycles_left(v, a),
    "retry_resume_left": lambda v, a: bool(a["repeat_resume"]) and not v.repeat_resume_used,
    "extra_pause_left": lambda v, a: bool(a["pause_during_update"]) and not v.extra_used & X_PAUSE,
    "extra_resume_left": lambda v, a: bool(a["resume_during_update"]) and not v.extra_used & X_RESUME,
    "repeat_pause_left": lambda v, a: bool(a["repeat_pause"]) and not v.extra_used & X_REPEAT_PAUSE,
    # the policies (module docstring)
    "recovers": lambda v, a: _recover(a),
    "recovers_serving_init": lambda v, a: _recover(a) and _serving_init(v),
    "recovers_not_serving_init": lambda v, a: _recover(a) and not _serving_init(v),
    "recovers_initialised": lambda v, a: _recover(a) and v.transfer_initialised,
    "recovers_not_initialised": lambda v, a: _recover(a) and not v.transfer_initialised,
    "recovers_cycles_left": lambda v, a: _recover(a) and _cycles_left(v, a),
    "recovers_stray_resume_left": lambda v, a: (
        _recover(a) and bool(a["stray_resume"]) and not v.stray_resume_used
    ),
    "gives_up": lambda v, a: _one_round(a),
    "round_over": lambda v, a: _one_round(a) and not _cycles_left(v, a) and not v.recovering,
    "round_over_failed": lambda v, a: _one_round(a) and not _cycles_left(v, a) and v.recovering,
}
CTRL_UPDATES = {
    "begin_cycle": lambda v, a: v._replace(cycles_started=v.cycles_started + 1),
    "mark_initialised": lambda v, a: v._replace(transfer_initialised=True),
    "use_stray_resume": lambda v, a: v._replace(stray_resume_used=True),
    "use_retry_resume": lambda v, a: v._replace(repeat_resume_used=True),
    "use_extra_pause": lambda v, a: v._replace(extra_used=v.extra_used | X_PAUSE),
    "use_extra_resume": lambda v, a: v._replace(extra_used=v.extra_used | X_RESUME),
    "use_repeat_pause": lambda v, a: v._replace(extra_used=v.extra_used | X_REPEAT_PAUSE),
    "use_init_while_serving": lambda v, a: v._replace(
        extra_used=v.extra_used | X_INIT_SERVING | X_INIT_SERVING_USED
    ),
    "end_serving_init": lambda v, a: v._replace(extra_used=v.extra_used & ~X_INIT_SERVING),
    "forget_initialised": lambda v, a: v._replace(transfer_initialised=False),
    "note_failure": lambda v, a: v._replace(recovering=True),
    "count_round": lambda v, a: v._replace(update_rounds=v.update_rounds + 1, recovering=False),
}
#: Effect names and what the controller does for each (the target phase is the row's).
CTRL_EFFECTS: dict[str, str] = {
    "fan_out": "send the target phase's call to every rank (and let the trainer join where it does); its "
    "answers are the next event",
    "front_end_call": "the API front-end answers the target phase's call itself, applying it to every rank "
    "at once (front-end-pause: vLLM before PR #34125; PR #28037)",
    "retry_resume": "re-send resume to every rank while the first is outstanding (untracked: its answers "
    "are not counted)",
    "extra_pause": "send a second pause to every rank, while a round is in flight or (model bound "
    "repeat_pause) while the first pause is outstanding or after it returned (untracked)",
    "extra_resume": "send resume to every rank while a round is in flight (untracked)",
    "end_round": "the round is over: return",
    "serve_on": "the init sent while serving returned and no cycle is left: the controller is idle while "
    "the engines serve",
    "raise_failure": "the round is over: raise the failed call's error (no weight moved, or a failed pause)",
    "raise_update_failed": "the round is over: raise UpdateFailedError (weights moved; the engines are not "
    "resumed, they would serve a partial update)",
}

_P = Phase
_E = CtrlEvent
Table = dict[tuple[Phase, CtrlEvent], tuple[Transition, ...]]
R9 = (
    "vLLM 0.32 RL API: pause_generation, init/start/update/finish weight calls, resume_generation "
    "(v1/engine/async_llm.py:952-990, 1315-1363)"
)
R_RECOVER = "weightsync (model policy recover)"
R_ONE = "weightsync update_round (policy one_round)"
R_SERVING_INIT = (
    "model bound init_while_serving (a rank inside the transfer group's rendezvous cannot take its part in "
    "a wave's DP step: init before serving with requests held, or while paused)"
)


def controller_table(pause_in_front_end: bool = False) -> Table:
    """The controller's table for a variant (``pause_in_front_end``: the variant's pause and resume are
    answered by the API front-end, :attr:`weightsync.spec.rank.Variant.pause_in_front_end`; no call reaches
    an engine while a round is in flight then, so that table has no untracked calls)."""
    t = Transition

    def call(target: Phase) -> str:
        return "front_end_call" if front_end_answers(pause_in_front_end, PHASE_CALL[target]) else "fan_out"

    def row(guard: str, target: Phase, updates: tuple[str, ...], rule: str) -> Transition:
        return t(guard, target, updates, (call(target),), rule)

    def failed(rows: tuple[Transition, ...]) -> tuple[Transition, ...]:
        """The same moves after a failed call (the controller now recovers), for policy recover."""
        return tuple(
            r._replace(
                guard="recovers" if r.guard == ALWAYS else f"recovers_{r.guard}",
                updates=("note_failure", *r.updates),
                rule=f"{R_RECOVER}: a failed call changes nothing but `recovering`; {r.rule}",
            )
            for r in rows
        )

    untracked: dict[Phase, tuple[Transition, ...]] = {}
    if not pause_in_front_end:
        extras = (
            t(
                "extra_pause_left",
                None,
                ("use_extra_pause",),
                ("extra_pause",),
                "model bound pause_during_update",
            ),
            t(
                "extra_resume_left",
                None,
                ("use_extra_resume",),
                ("extra_resume",),
                "model bound resume_during_update",
            ),
        )
        for p in (_P.START, _P.UPDATE, _P.FINISH):
            untracked[p] = tuple(r._replace(target=p) for r in extras)
        untracked[_P.PAUSE] = (
            t(
                "repeat_pause_left",
                _P.PAUSE,
                ("use_repeat_pause",),
                ("extra_pause",),
                "model bound repeat_pause (a client retry, a second controller, or a pause in another mode "
                "while paused; vLLM 0.32 v1/engine/core.py:2061-2103 applies each pause_scheduler call)",
            ),
        )
        untracked[_P.RESUME] = (
            t(
                "retry_resume_left",
                _P.RESUME,
                ("use_retry_resume",),
                ("retry_resume",),
                "model bound repeat_resume (a client retry, or a second controller)",
            ),
        )

    next_cycle = (
        row("cycles_left", _P.PAUSE, ("begin_cycle",), R9 + ": a new cycle"),
        row(
            "stray_resume_left",
            _P.RESUME,
            ("use_stray_resume",),
            "an orchestrator's `finally` resume (model bound stray_resume)",
        ),
    )
    after_pause = (
        row("initialised", _P.START, (), R9),
        row("not_initialised", _P.INIT, ("mark_initialised",), R9 + ": lazy init, while paused"),
        row(ALWAYS, _P.RESUME, (), R9 + ": pause -> resume"),
    )
    after_init = (
        row(
            "recovering_or_in_cycle",
            _P.START,
            (),
            R9 + "; weightsync: a failed rank needs a new round before it may resume",
        ),
        row("serving_not_started", _P.PAUSE, ("begin_cycle",), R9 + ": the init before serving returned"),
        row("in_cycle_not_recovering", _P.RESUME, (), R9),
        row("serving_init_cycles_left", _P.PAUSE, ("end_serving_init", "begin_cycle"), R9 + ": a new cycle"),
        t("serving_init_over", _P.IDLE, ("end_serving_init",), ("serve_on",), R_SERVING_INIT),
    )
    serving_init = row(
        "init_while_serving_left",
        _P.INIT,
        ("use_init_while_serving",),
        R_SERVING_INIT + ": a restarted trainer reconnects while the engines serve, with no pause",
    )
    end = (
        t("round_over", _P.IDLE, (), ("end_round",), R_ONE + ": the round finished and resumed"),
        t(
            "round_over_failed",
            _P.IDLE,
            (),
            ("raise_failure",),
            R_ONE + ": the round failed before any weight moved; resumed, now the error",
        ),
    )
    give_up = t("gives_up", _P.IDLE, ("note_failure",), ("raise_failure",), R_ONE)
    rows: Table = {
        (_P.IDLE, _E.DONE): (
            next_cycle[0],
            row("init_before_serving", _P.INIT, ("mark_initialised",), R9 + ": init before serving"),
            next_cycle[1],
        ),
        (_P.RESUME, _E.DONE): (*next_cycle, serving_init, *end),
        (_P.RESUME, _E.FAILED): (
            *failed(next_cycle),
            give_up._replace(rule=R_ONE + ": the resume failed; its error"),
        ),
        (_P.PAUSE, _E.DONE): (*after_pause, *untracked.get(_P.PAUSE, ())),
        (_P.PAUSE, _E.FAILED): (
            *failed(after_pause),
            *untracked.get(_P.PAUSE, ()),
            give_up._replace(
                rule=R_ONE + ": a failed pause may leave the ranks in different states; a resume would send "
                "the verified ones alone into the resume barrier, so the pause's error, no resume"
            ),
        ),
        (_P.INIT, _E.DONE): after_init,
        (_P.INIT, _E.FAILED): (
            row(
                "recovers_serving_init",
                _P.PAUSE,
                ("end_serving_init", "forget_initialised"),
                R_SERVING_INIT + ": refused while serving (patch 0008): pause, then the lazy init",
            ),
            row(
                "recovers_not_serving_init",
                _P.INIT,
                ("note_failure",),
                R_RECOVER + ": the transfer group is gone: init again",
            ),
            give_up._replace(rule=R_ONE + ": the init's error"),
        ),
        (_P.START, _E.DONE): (row(ALWAYS, _P.UPDATE, (), R9), *untracked.get(_P.START, ())),
        (_P.START, _E.FAILED): (
            row("recovers", _P.UPDATE, ("note_failure",), R_RECOVER + ": carry the round through"),
            row(
                "gives_up",
                _P.RESUME,
                ("note_failure",),
                R_ONE + ": no weight moved, the engines hold a complete set: resume, then the error",
            ),
            *untracked.get(_P.START, ()),
        ),
        (_P.UPDATE, _E.DONE): (row(ALWAYS, _P.FINISH, (), R9), *untracked.get(_P.UPDATE, ())),
        (_P.UPDATE, _E.FAILED): (
            row("recovers", _P.FINISH, ("note_failure",), R_RECOVER + ": carry the round through"),
            t(
                "gives_up",
                _P.IDLE,
                ("note_failure",),
                ("raise_update_failed",),
                R_ONE + ": weights moved; a resume would serve a partial update",
            ),
            *untracked.get(_P.UPDATE, ()),
        ),
        (_P.FINISH, _E.DONE): (
            row(ALWAYS, _P.RESUME, ("count_round",), R9 + ": the round succeeded"),
            *untracked.get(_P.FINISH, ()),
        ),
        (_P.FINISH, _E.FAILED): (
            row("recovers", _P.START, ("note_failure",), R_RECOVER + ": a new round, the same version"),
            t(
                "gives_up",
                _P.IDLE,
                ("note_failure",),
                ("raise_update_failed",),
                R_ONE + ": the finish failed; a resume would serve a partial update",
            ),
            *untracked.get(_P.FINISH, ()),
        ),
    }
    for p, extra in untracked.items():
        rows[(p, _E.WAITING)] = extra
    return rows


def controller_choices(
    table: Table, v: CtrlVars, event: CtrlEvent, args: Args
) -> list[tuple[Transition, CtrlVars]]:
    """Every row ``event`` may take from ``v`` (each whose guard holds, in table order) with the variables
    after it: the model's nondeterministic choice. Pure."""
    return [
        (tr, apply_transition(v, tr, args, CTRL_UPDATES))
        for tr in enabled_transitions(table, v.phase, event, v, args, CTRL_GUARDS)
    ]


def controller_next(
    table: Table, v: CtrlVars, event: CtrlEvent, args: Args
) -> tuple[Transition, CtrlVars] | None:
    """The first row ``event`` takes from ``v`` with the variables after it, or None (the controller
    waits): the implementation's deterministic choice. Pure."""
    tr = select_transition(table, v.phase, event, v, args, CTRL_GUARDS)
    return None if tr is None else (tr, apply_transition(v, tr, args, CTRL_UPDATES))


def controller_digest() -> str:
    """SHA-256 of both controller tables (every variant uses one of them) and the call maps."""
    parts = [f"{int(p)}={c}" for p, c in PHASE_CALL.items()]
    parts += [f"{c}={e.value}" for c, e in CALL_EVENT.items()]
    parts += [f"{int(p)}={c.value}" for p, c in TRAINER_COLLECTIVE.items()]
    parts += [f"{k}={v}" for k, v in PAUSE_ARGS.items()]
    for fe in (False, True):
        table = controller_table(fe)
        parts.append(
            table_digest(
                (s.name, e, tr._replace(target=tr.target.name))
                for (s, e), trs in sorted(table.items())
                for tr in trs
            )
        )
    parts.append(registry_digest(__name__, "CTRL_GUARDS", "CTRL_UPDATES"))
    return table_digest((), *parts)


__all__ = [
    "CTRL_EFFECTS",
    "CTRL_GUARDS",
    "CTRL_UPDATES",
    "X_INIT_SERVING",
    "X_INIT_SERVING_USED",
    "X_PAUSE",
    "X_REPEAT_PAUSE",
    "X_RESUME",
    "CtrlEvent",
    "CtrlVars",
    "Policy",
    "controller_choices",
    "controller_digest",
    "controller_event",
    "controller_next",
    "controller_table",
    "init_holds_requests",
]
