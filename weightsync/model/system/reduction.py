"""The silent-wave reduction: a START_DP_WAVE that its rank will drop whenever it takes it is set aside.

The coordinator broadcasts every START_DP_WAVE to every rank, and most copies are never acted on: the wave
is older than the rank's (the rank moved on), or the broadcast excludes the rank (it reported that wave
itself). Every successor the model computes is passed through :meth:`SilentWaves.quiet`, which removes such
messages from the wave FIFOs (:meth:`SilentWaves.quiet_rank` says which). Measured with the compact engine
(safety and deadlock, 2026-12-06): ``two-phase-epoch`` keep N = 2, 89,598 states unreduced, 21,032
reduced; N = 3 with symmetry 371,117 and 60,125.

Why this is sound for safety and deadlock (not for progress, which stays on the unreduced or
symmetry-reduced graph). Receiving such a message changes nothing but its FIFO (the table's row is silent:
same variables, no effect), and that stays so for the rest of the run:
:func:`~weightsync.spec.rank_vars.wave_dropped_for_good` keeps holding because ``current_wave`` never
decreases. Call two states equivalent when they have the same :meth:`SilentWaves.normal_form` (every such
message removed). Then every move of a full state ``u`` other than receiving such a message is a move, with
the same effect on the normal form, of every equivalent state (no other move reads a rank's wave FIFO), and
receiving one is a stutter step; so every reachable ``u`` has an equivalent explored state ``r``, by
induction on the path, and conversely every explored state is equivalent to a reachable one. The
invariant reads START_DP_WAVE only as "the rank has a message queued" and "the rank has a wave or a request
queued", of a rank that is not blocked. A removed message is one that only START_DP_WAVE messages precede,
so it is received, as a stutter step, before any message of another kind; the full state with such
messages received from the heads of the FIFOs of the ranks that can receive (stutter steps away) answers
both questions as the reduced state does, and a full state that still holds them may answer yes where the
reduced one says no (a rank that answers yes is "unsettled", which only ever makes the invariant hold). So
a failure of the invariant in a full state shows in its explored equivalent, and one in an explored state
is one of a full state, the one with those receipts made. Edge checks read no START_DP_WAVE; a state
without successors has, for each rank that could receive, no message left in either graph, so the
terminal check judges ``u`` and ``r`` alike. (One exception to "agree": a rank that enters ``error`` by
its receipt of the message ahead keeps, in the full graph, a removed message it will never receive; but a
state with a rank in ``error`` violates ``phase_bracketing`` in both graphs and is not expanded, so only
which other properties are reported there may differ, never whether one is violated.) Counterexamples are put back onto the unreduced model (the
removed receipts as steps of their own, :func:`~weightsync.model.counterexample.unreduced_edges`) and
``tests/test_model_reduction.py`` replays them there. The witness ``sometimes_update_with_wave_in_flight`` reads the messages and is not checked here.

Both premises are checked against the table in use, not assumed: every rank state the exploration reaches
(not blocked, not in ``error``) drops every message the predicate names (:meth:`SilentWaves.check_drops`),
and no transition the exploration computes lowers ``current_wave`` (:meth:`ModelBase.fire`). Checking them
on the reduced graph suffices: the first transition of the full graph that broke one would have its copy,
with the same variables, in the reduced graph (the induction above holds up to it). A table that breaks
one raises :class:`~weightsync.model.system.premise.ReductionPremiseError`.

This is a reduction by stuttering equivalence, not a partial-order reduction: receiving the message is
invisible and commutes with every other move, but a rank's step into a collective disables it for a while,
so as a singleton ample set it would break condition C1; the argument above does not need C1.
"""

from __future__ import annotations

from typing import Any

from weightsync.model.system.base import ModelBase
from weightsync.model.system.premise import ReductionPremiseError
from weightsync.model.system.state import GlobalState, Rank
from weightsync.spec.rank_vars import RankVars, wave_dropped_for_good
from weightsync.spec.states import RankEvent, RankState


def _kept(i: int, v: RankVars, q: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...] | None:
    """Rank ``i``'s wave FIFO ``q`` after :meth:`SilentWaves.quiet_rank`'s removals (the rank's variables
    ``v``); None when it removes none."""
    kept = []
    only_waves = True
    for m in q:
        if m[0] == "W":
            if only_waves and wave_dropped_for_good(v, i, m[1], m[2]):
                continue
        else:
            only_waves = False
        kept.append(m)
    return None if len(kept) == len(q) else tuple(kept)


class SilentWaves(ModelBase):
    """The silent-wave reduction's part of :class:`~weightsync.model.system.Model` (see the module
    docstring); active when the model was built with ``silent_waves=True``."""

    def quiet(self, s: GlobalState) -> GlobalState:
        """``s`` with every rank's wave FIFO rid of the START_DP_WAVE messages :meth:`quiet_rank` removes;
        ``s`` itself when there are none.

        Raises:
            ReductionPremiseError: a rank's state where the table acts on such a message."""
        ranks = s.ranks
        new: list[Rank] | None = None
        for i, r in enumerate(ranks):
            q = self.quiet_rank(i, r)
            if q is not r:
                if new is None:
                    new = list(ranks)
                new[i] = q
        return s if new is None else s.with_ranks(tuple(new))

    def quiet_rank(self, i: int, r: Rank) -> Rank:
        """Rank ``i``'s slice ``r`` without the START_DP_WAVE messages in its wave FIFO for which
        :func:`~weightsync.spec.rank_vars.wave_dropped_for_good` holds and that only START_DP_WAVE messages
        precede (``r`` itself when there are none). Under ``per-socket`` and ``one-api-server`` channels the
        wave FIFO holds nothing else, so every such message goes; under ``ordered`` ones a message of another
        kind keeps those behind it. Those at the head are receipts the rank could make now (or once it
        leaves its collective), each a stutter step; one behind a START_DP_WAVE that stays reaches the head,
        and is received as a stutter step, before any message of another kind does, so the invariant's "a
        message is queued" and "a wave or a request is queued" of a rank that can receive agree with a state
        of the full graph (the module docstring). A rank in ``error`` receives nothing and keeps its
        messages.

        Raises:
            ReductionPremiseError: see :meth:`check_drops`."""
        v = r.vars
        if v.state is RankState.ERROR:
            return r
        if not r.blocked and (i, v) not in self._drops_checked:
            self.check_drops(i, v)
        fw = self.f_wave
        q = r.inq[fw]
        if not q:
            return r
        key = (i, q, v)
        cache = self._quiet_cache
        kept = cache[key] if key in cache else cache.setdefault(key, _kept(i, v, q))
        return r if kept is None else r.with_inq((*r.inq[:fw], kept, *r.inq[fw + 1 :]))

    def normal_form(self, s: GlobalState) -> GlobalState:
        """``s`` with every START_DP_WAVE that its rank drops for good removed (ranks in ``error`` aside),
        wherever it is and whether or not the rank can receive: a full state and the reduced state that
        stands for it (:meth:`quiet`) have the same normal form."""
        fw = self.f_wave
        ranks = []
        for i, r in enumerate(s.ranks):
            v = r.vars
            q = r.inq[fw]
            if v.state is not RankState.ERROR and q:
                q = tuple(m for m in q if not (m[0] == "W" and wave_dropped_for_good(v, i, m[1], m[2])))
                r = r.with_inq((*r.inq[:fw], q, *r.inq[fw + 1 :]))
            ranks.append(r)
        return s.with_ranks(tuple(ranks))

    def check_drops(self, i: int, v: RankVars) -> None:
        """The premise at one rank state: rank ``i`` with variables ``v`` drops, through a silent row (same
        variables, no effect), every START_DP_WAVE(wave, exclude) that
        :func:`~weightsync.spec.rank_vars.wave_dropped_for_good` names: each wave up to ``v.current_wave``
        (a message the predicate names has a wave no newer than the rank's at the time, and the rank's only
        grows) and each ``exclude`` (-1 or a rank).

        Raises:
            ReductionPremiseError: the table acts on one (names the rank, the state, the message and the row).
        """
        for wave in range(v.current_wave + 1):
            for exclude in range(-1, self.n):
                if not wave_dropped_for_good(v, i, wave, exclude):
                    continue
                tr, after = self.fire(i, v, RankEvent.START_DP_WAVE, (("exclude", exclude), ("wave", wave)))
                if tr is None or after != v or tr.effects:
                    row = "no row (illegal)" if tr is None else f"row {tr.guard!r} -> {tr.target.value}"
                    raise ReductionPremiseError(
                        f"rank {i} in {v.state.value} (current_wave={v.current_wave}) acts on "
                        f"START_DP_WAVE(wave={wave}, exclude={exclude}): {row}; the silent-wave reduction needs "
                        "it dropped (vLLM 0.32 v1/engine/core.py:2284-2297); check without it"
                    )
        self._drops_checked.add((i, v))
