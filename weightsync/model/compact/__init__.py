"""The compact engine: the model's states as ints, and its transitions memoised per part.

A global state is encoded as one int, ``r_0 + (r_1 << 32) + ... + (r_{N-1} << 32 (N-1)) + (rest << 32 N)``
(:mod:`~weightsync.model.compact.codec`; packed and unpacked as N + 1 native 32-bit fields in C): ``r_i`` is the id of rank ``i``'s :class:`~weightsync.model.system.Rank`
slice and ``rest`` the id of the state outside the ranks (the :class:`~weightsync.model.system.GlobalState`
less ``ranks``: coordinator FIFOs, coordinator, front-end, controller, trainer, finished and aborted
requests). Ids are small ints handed out in order of first appearance by two intern tables (value -> id,
and a list id -> value); a state is hashed and compared as one int. The same slice value has one id, so
equal states have equal encodings, and :meth:`~weightsync.model.compact.codec.Codec.decode` rebuilds the very
:class:`GlobalState` (sharing the interned slices). A memo entry for a part that changes rank ``i`` and the
rest stores the delta ``((r_i' - r_i) << 32 i) + ((rest' - rest) << 32 N)``, so a hit is one int addition.

The successor function calls the model's own parts (:meth:`Model.successors` is their concatenation, in the
same order), so labels, order, states, edge checks, invariants and verdicts are the model's; what changes is
that each part's result is memoised under a key holding only what the part reads, and a hit builds the
successors from ints alone:

- a rank's inputs and step (:meth:`Model.rank_moves`): key ``(i, r_i, rest, busy)``; they read rank ``i``'s
  slice, ``i`` and the rest, and change only those (audited in ``effects.py``; the settle reduction of
  stray/repeated resumes then touches rank ``i`` only, as every explored state is settled). ``busy``: some
  rank is blocked in a weight-transfer collective, the only thing of other ranks an edge check of theirs
  reads (``quiescence``, ``properties.py``). The entry: ``(label, delta, violated)``;
- the coordinator taking from its own FIFOs: key ``rest``; from rank ``i``'s: key ``(i, r_i, rest)``
  (:meth:`Environment.coord_take`); the entry holds the new rest, rank ``i``'s id after the take, and the
  START_DP_WAVE broadcasts, delivered to every rank by a memo ``(r, broadcasts) -> r'``
  (:meth:`Environment.wave_to`);
- the front-end's stats refresh (:meth:`Model.refresh_moves`): key ``rest``;
- whether the controller has a move (:meth:`Environment.controller_moves`), and whether any collective move
  exists (:meth:`Model.collective_moves`), inside a plan per ``(rest, each rank's env class)`` that also
  says which other parts apply (:meth:`~weightsync.model.compact.engine.CompactEngine._plan`);
- a DP collective's completion: the outcome by the members' ids, each member's completion
  (:meth:`RankEffects.complete_member`) by ``(kind, outcome, i, r_i, rest so far)``;
- a controller fan-out, rank by rank given the controller it leaves
  (:meth:`~weightsync.model.compact.engine.CompactEngine._controller`);
- the invariant: by ``(p_0, ..., p_{N-1}, rest projection)`` where ``p_i`` is the id of rank ``i``'s projection on
  the fields :meth:`Properties.invariant` reads; on a miss, each of its groups by its own projections
  (:mod:`~weightsync.model.compact.projections`);
- the canonical form (symmetry), at every N: the ranks' order by memoised keys, the renaming per id and
  permutation (:mod:`~weightsync.model.compact.canon`). At N > 3 the model's order of slices is kept as
  int labels (:class:`~weightsync.model.compact.canon.OrderLabels`), so a sort compares ints, and a rank's
  own move from a canonical state where no message names a rank comes canonical already
  (:meth:`~weightsync.model.compact.canon.CanonicalForm.resorted`: the explorer's lookup then finds it
  without canonicalising it; the successor is the model's up to renaming ranks 1..N-1).

The explorer is :func:`~weightsync.model.explorer.explore_checked` (the successor function hands it
each edge's check); :class:`~weightsync.model.compact.view.DecodedStates` reads the result as
:class:`GlobalState` values for counterexamples, progress checks, export and replay.

Transfer collectives and timeouts, the client's sends and aborts (while any are left), the front-end's
``fe`` calls, and the controller's moves until their rank-by-rank entries are known take the slow path:
decode, run the model's part, encode (slices that did not change keep their id without being hashed). Each memo entry is computed
on a miss by the model's part on the decoded state, and checked there against it (the other ranks must be
unchanged, the rebuilt successor equal to the model's); ``verify=True`` also compares every successor list,
edge check and invariant with a fresh computation of the model (the cache-consistency mode of the tests).
"""

from weightsync.model.compact.codec import FIELD_BITS, Codec, Compact
from weightsync.model.compact.engine import CompactEngine
from weightsync.model.compact.view import DecodedIndex, DecodedStates, explore_compact

__all__ = [
    "FIELD_BITS",
    "Codec",
    "Compact",
    "CompactEngine",
    "DecodedIndex",
    "DecodedStates",
    "explore_compact",
]
