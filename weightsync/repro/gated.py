"""The engine rank ``weightsync repro`` runs: a step gate on the busy loop, so the driver decides when each
rank takes an acting step (test machinery, kept out of the production loop in
:mod:`weightsync.impl.engine.core`)."""

from __future__ import annotations

from weightsync.impl.engine.core import EngineCore
from weightsync.spec.rank import apply
from weightsync.spec.states import RankEvent


class GatedEngineCore(EngineCore):
    """An :class:`EngineCore` whose STEPs that would act wait for permits on ``queues.step_gate`` (a shared
    int the client sets: -1 steps freely, n >= 0 permits n acting steps;
    :meth:`~weightsync.impl.engine.client.DPEngineClient.set_step_gate`)."""

    def may_step(self) -> bool:
        """Repro step gate (``weightsync repro``): a STEP that would act (the table gives it effects or changes
        the variables; an idle loop pass does neither) fires only while the gate is open (-1) or holds a
        permit (n > 0, consumed here). Asks the table; decides nothing about the protocol."""
        gate = self.q.step_gate
        if gate is None or gate.value < 0:
            return True
        args = {
            "has_work": self.sched.has_work(),
            "rank": self.rank,
            "dp_size": self.cfg.dp_size,
            "sync_interval": self.cfg.sync_interval,
        }
        v = self.machine.vars
        tr = self.machine.select(RankEvent.STEP, args)
        if tr is None or (not tr.effects and apply(v, tr, args) == v):
            return True
        with gate.get_lock():
            if gate.value < 0:
                return True
            if gate.value > 0:
                gate.value -= 1
                return True
        return False


__all__ = ["GatedEngineCore"]
