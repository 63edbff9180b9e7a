"""Random schedules over the model's enabled transitions (Hypothesis stateful testing).

Each step draws an index into the enabled transitions sorted by label; every safety invariant is checked
after every step; a stutter rule is enabled only in terminal states, where the state must be a
legitimate end (two-phase-epoch never deadlocks). Reference section 10: preconditions, not ``assume``.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from weightsync.model.system import Bounds, Config, G, Label, Model
from weightsync.spec.states import PauseMode, RankState


class EpochSchedules(RuleBasedStateMachine):
    """two-phase-epoch, N in {2, 3}, every mode, per-socket or ordered channels, 2 requests, 2 cycles."""

    model: Model
    state: G
    enabled: list[tuple[Label, G]]

    @initialize(
        mode=st.sampled_from(list(PauseMode)),
        ranks=st.sampled_from([2, 3]),
        channels=st.sampled_from(["per-socket", "ordered"]),
    )
    def start(self, mode: PauseMode, ranks: int, channels: str) -> None:
        self.model = Model(Config("two-phase-epoch", ranks, mode, channels, Bounds(requests=2, cycles=2)))
        self.state = self.model.initial()
        self._refresh()

    def _refresh(self) -> None:
        self.enabled = sorted(self.model.successors(self.state), key=lambda e: repr(e[0]))

    @precondition(lambda self: bool(getattr(self, "enabled", None)))
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, len(self.enabled) - 1), label="transition")
        label, nxt = self.enabled[k]
        assert self.model.edge_check(self.state, label, nxt) == [], label
        self.state = nxt
        self._refresh()

    @precondition(lambda self: hasattr(self, "enabled") and not self.enabled)
    @rule()
    def stutter(self) -> None:
        assert self.model.is_end(self.state), "a terminal state must be a legitimate end"
        assert all(r.vars.state is RankState.RUNNING for r in self.state.ranks)

    @invariant()
    def safety(self) -> None:
        if hasattr(self, "state"):
            assert self.model.invariant(self.state) == []


EpochSchedules.TestCase.settings = settings(
    max_examples=60, stateful_step_count=120, deadline=None, derandomize=True, database=None
)
TestEpochSchedules = EpochSchedules.TestCase
