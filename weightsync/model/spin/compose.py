"""The Promela model of one :class:`~weightsync.model.system.Model`: its state as Promela arrays and its
successor function as one ``do`` loop of ``d_step`` moves, each the model's move of the same label, generated
from the spec's tables (:mod:`weightsync.model.spin.tables`) and composed as
:mod:`weightsync.model.system` composes them (FIFOs, scheduler queues, collectives, coordinator, front-end,
controller, trainer).

The encoding is one-to-one: a Promela state holds exactly what a :class:`GlobalState` holds (FIFO slots past
a FIFO's length are 0; a request's place is ``rq_where``/``rq_rank``/``rq_left``/``rq_kv``, so the sorted
queues and the ``done``/``aborted`` sets are read off it), and each move changes what the model's move of
the same label changes (the scratch variables are zeroed after every move, and the per-rank request counters
``r_nw``/``r_nr`` are functions of the request arrays). So with the checks off, SPIN stores the model's
states plus its own state before ``init`` runs (``tests/test_spin.py`` checks it), and with them on, a SPIN trail is a path of the model
(:mod:`weightsync.model.spin.run` replays it on :meth:`Model.successors`).

Checked in Promela: every state invariant and edge check of :class:`~weightsync.model.system.properties.
Properties` and the terminal check (deadlock, one-sided collective); not the progress properties (CTL
``AG EF``, not LTL) nor the non-vacuity witnesses.
"""

from __future__ import annotations

from weightsync.model.spin.build import CAP, Build, UnsupportedModel
from weightsync.model.spin.moves import Moves
from weightsync.model.spin.props import Props
from weightsync.model.system import Model


class PromelaModel(Props, Moves, Build):
    """The Promela text of ``model``.

    Args:
        model: the model (its variant, N, mode, channels and bounds).
        checks: generate the property checks (False: the bare successor function, to count states).
        fifo_capacity: slots of each FIFO (the model's are unbounded; a run that fills one stops with an
            error naming the capacity, never with a verdict).

    Raises:
        UnsupportedModel: a table names an effect the generator does not know (named).
    """

    def __init__(self, model: Model, checks: bool = True, fifo_capacity: int = CAP) -> None:
        Build.__init__(self, model, checks, fifo_capacity)
        self.check_quiet_supported()

    def text(self) -> str:
        """The whole Promela model. With the checks on, the state invariants are one monitor process whose
        only move is enabled in a state that violates one (so it adds no state), the edge checks end each
        move, and the terminal check is the ``else`` of the moves; with them off, a state that violates an
        invariant is marked and not expanded."""
        opts = self.options()
        body = "\n".join(opts)
        terminal = f"  :: else -> {self.terminal_check()}; break\n" if self.checks else ""
        monitor = ""
        init = self.initial()
        if self.m.silent_waves:  # the reduction's drop check on the initial state, its scratch zeroed again
            init += f"; {self.premise_check_initial()}; {self.reset()}"
        if self.checks:
            bad = " || ".join(f"({cond})" for _, cond in self.invariant_conditions())
            monitor = (
                "bit started;\n"
                f"active proctype invariant() {{\nend: do\n  :: d_step {{ started && ({bad}) -> {self.check_state()} }}\n"
                "  od\n}\n"
            )
            init += "; started = 1"
        else:
            init += f"; {self.check_state()}"
        return (
            self.header()
            + self.declarations()
            + monitor
            + "\ninit {\n  d_step { "
            + init
            + " };\n  do\n"
            + body
            + "\n"
            + terminal
            + "  od\n}\n"
        )


__all__ = ["CAP", "PromelaModel", "UnsupportedModel"]
