"""The silent-wave reduction: a START_DP_WAVE that its rank will drop whenever it takes it is taken at once.

The coordinator broadcasts every START_DP_WAVE to every rank, and most copies are never acted on: the wave
is older than the rank's (a rank moved on), or the broadcast excludes the rank (it reported that wave
itself). In ``two-phase-epoch --mode any --requests 2 --cycles 2 --stray-resume --repeat-resume`` at N = 2,
dropping such copies wherever they sit leaves 2.3x fewer states at BFS level 22, taking them only from the
FIFO heads 1.5x. Where such a message reaches the head of a rank's wave FIFO and the rank can receive (not
blocked, not in ``error``), the successor function receives it at once, as its own silent transition.

Why this is sound for safety and deadlock (and not for progress, which is checked unreduced). Receiving the
message changes nothing but the FIFO (the table's row is silent: same variables, no effect), and it stays
so: :func:`~weightsync.spec.rank_vars.wave_dropped_for_good` holds for the rest of the run, because
``current_wave`` never decreases. So let ``u`` be a state of the full graph and ``r`` the reduced state
that lacks some such messages at the heads of the wave FIFOs: every move of ``u`` other than receiving one
of them is a move of ``r`` with the same effect (no other move reads a rank's wave FIFO), and receiving one
is a stutter step of ``u``. By induction on a path every reachable state ``u`` has such an ``r`` explored.
The invariant holds in ``r`` only if it holds in ``u``: it reads no START_DP_WAVE except as "some
message is queued" (a rank counts as unsettled), where fewer messages can only make it fail; edge checks
read none; a terminal ``u`` has a terminal ``r`` that the terminal check judges alike (a rank that could
receive has empty FIFOs in both). Every reduced state is a state of the full graph, reached by the removed
receipts (:func:`~weightsync.model.counterexample.concrete_path` puts them back), so a violation found is
real. The witness ``sometimes_update_with_wave_in_flight`` reads the messages and is not checked here.

Both premises are checked against the table in use, not assumed: every rank state the exploration reaches
(not blocked, not in ``error``) drops every message the predicate names (:meth:`SilentWaves.check_drops`),
and no transition the exploration computes lowers ``current_wave`` (:meth:`ModelBase.fire`). Checking them
on the reduced graph suffices: the first transition of the full graph that broke one would have its copy,
with the same variables, in the reduced graph (the induction above holds up to it). A table that breaks
one raises :class:`~weightsync.model.system.premise.ReductionPremiseError`.

This is a reduction by stuttering equivalence rather than a partial-order reduction: receiving the message is
invisible and commutes with every other move, but a rank's step into a collective disables it for a while,
so a singleton ample set would break condition C1; the argument above does not need C1.
"""

from __future__ import annotations

from weightsync.model.system.base import ModelBase
from weightsync.model.system.premise import ReductionPremiseError
from weightsync.model.system.state import GlobalState, Rank
from weightsync.spec.rank_vars import RankVars, wave_dropped_for_good
from weightsync.spec.states import RankEvent, RankState


class SilentWaves(ModelBase):
    """The silent-wave reduction's part of :class:`~weightsync.model.system.Model` (see the module
    docstring); active when the model was built with ``silent_waves=True``."""

    def quiet(self, s: GlobalState) -> GlobalState:
        """``s`` with every rank's wave FIFO rid of the START_DP_WAVE messages at its head that the rank drops
        for good (:meth:`quiet_rank`); ``s`` itself when there are none.

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
        """Rank ``i``'s slice ``r`` without the START_DP_WAVE messages at the head of its wave FIFO for which
        :func:`~weightsync.spec.rank_vars.wave_dropped_for_good` holds, when the rank can receive (not
        blocked, not in ``error``); ``r`` itself otherwise. A message of another kind (one shared FIFO under
        ``ordered`` channels) or one the rank may act on ends the run of removals.

        Raises:
            ReductionPremiseError: see :meth:`check_drops`."""
        if r.blocked or r.vars.state is RankState.ERROR:
            return r
        v = r.vars
        if (i, v) not in self._drops_checked:
            self.check_drops(i, v)
        fw = self.f_wave
        q = r.inq[fw]
        if not q:
            return r
        key = (i, r)
        k = self._quiet_cache.get(key)
        if k is None:
            k = 0
            while k < len(q) and q[k][0] == "W" and wave_dropped_for_good(v, i, q[k][1], q[k][2]):
                k += 1
            self._quiet_cache[key] = k
        return r if k == 0 else r.with_inq((*r.inq[:fw], q[k:], *r.inq[fw + 1 :]))

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
