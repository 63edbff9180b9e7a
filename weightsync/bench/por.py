"""``weightsync bench por``: how much a partial-order reduction could take out of the model, measured.

Issue 19 item 2 asks for ample sets (conditions C0-C3: non-empty, persistent, invisible, the cycle
proviso). This bench measures, on the model itself, what ample sets of the shapes a process-based
reduction can form would save, before any proof of their conditions: every configuration is explored
breadth-first several times with the same successor function (:meth:`Model.successors`, silent-wave
reduction on, no symmetry), and the runs differ only in which successors of a state they expand.

- ``full``: every enabled move (the baseline; its count is ``weightsync check``'s with ``--silent-waves``
  and no symmetry).
- ``collective_first``: where a collective completion or timeout is enabled, only those. While every
  member of a collective is blocked in it, nothing but a completion or a timeout moves a member, which is
  as close to condition C1 as any move of this model comes.
- ``quiet_step_first`` (a ceiling, not sound): a rank's loop step alone, for the first rank that has a
  step enabled and nothing queued on any of its FIFOs. It ignores C1 for the messages that other processes
  may still send to that rank.
- ``rank_persistent`` (sound for deadlock, not for the invariants; run without the cycle proviso, which
  deadlock does not need): the moves of one rank, where nothing
  outside them can touch that rank or what its moves read before it moves (:func:`rank_persistent_set`
  gives the conditions and why they suffice). This is the one place where the README's argument leaves an
  enabled move out: the client has sent everything and the controller waits for this rank's reply.
- ``one_rank_first`` (a ceiling, not sound): the moves of the first rank that has one enabled, alone. It
  ignores C1 for every receipt: the order in which a rank takes messages from different senders is then
  fixed, which is the race the checker exists to explore.

Each restricted run but ``rank_persistent``'s keeps the cycle proviso (C3): a restricted set is expanded
only when every successor it leads to is new, otherwise the state is expanded in full. A state violating an invariant is not
expanded (as :func:`~weightsync.model.explorer.explore`). The figures are state counts and, per strategy,
``ratio`` = full states / its states, measured in this process; ``proper`` counts the states a
restricted set was used at. ``violations`` lists the state properties each run found violated, and
``terminals`` the terminal checks (``no_deadlock``, ``no_one_sided_collective``) of the states without
successors it reached.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from weightsync.model.system import Bounds, Config, Model
from weightsync.model.system.state import (
    ANY_MODE,
    CALL_EVENT,
    ENTER_EFFECT,
    SENT,
    TRANSFER_KINDS,
    GlobalState,
    Label,
    ModeSetting,
)
from weightsync.spec.front_end import RANK_EFFECT_EVENT
from weightsync.spec.states import PauseMode

#: The successors of a state, as :meth:`Model.successors` gives them.
Successors = list[tuple[Label, GlobalState]]
#: A strategy: (model, state, its successors) -> the successors to expand in place of all (None: all).
Strategy = Callable[[Model, GlobalState, Successors], Successors | None]


def _collective_first(model: Model, s: GlobalState, succ: Successors) -> Successors:
    return [e for e in succ if e[0][0] in ("done", "timeout")]


def rank_persistent_set(model: Model, s: GlobalState, succ: Successors) -> Successors | None:
    """The enabled moves of the first rank ``i`` at which nothing outside them can, before ``i`` moves,
    write rank ``i``'s slice or anything its moves read, or read what they write (None where no rank
    qualifies, or the model is not of the shape the argument covers). Such a set is persistent (every
    sequence of other moves commutes with each of its moves and leaves it enabled), so a search expanding
    only it at a state reaches every state without successors that the full search reaches: a deadlock or
    one-sided collective is kept (Godefroid's persistent sets; no cycle proviso is needed for that). It is
    not sound for the invariants: the rank's moves change fields they read (condition C2 fails).

    Conditions, each with the part of :class:`Model` that makes it suffice (per-socket channels; the model's
    FIFOs from a sender to a receiver have one writer each, and a receipt of a FIFO's head commutes with an
    append to its tail):

    - the client can send no request and no abort: ``send_moves`` and ``abort_moves`` (the only writers of
      rank ``i``'s ADD FIFO, and readers of its queues) stay disabled;
    - the controller has no move and rank ``i``'s call status is ``SENT``: ``controller_moves`` reads the
      controller, every status, the trainer's status and whether a request was sent, and with rank ``i``
      unanswered its event stays "not answered", so nothing writes rank ``i``'s controller FIFO or status,
      and the controller phase that rank ``i``'s reply may read stays;
    - no failure can be injected any more (``ctrl.failures_used``, read by every failing receipt);
    - neither a rank nor the trainer is in a weight-transfer collective, and no other rank has a controller
      call queued whose receipt may enter one: timeouts (which read every rank's state and status) stay
      disabled, because only such a receipt enters a weight-transfer collective (which calls, and that no
      other row enters one, is read from the table: :func:`_transfer_entry_calls`);
    - rank ``i``'s START_DP_WAVE FIFO holds a message, or the coordinator can broadcast nothing before ``i``
      moves: its FIFOs are empty (rank ``i``'s too) and every other rank is blocked in a collective, which
      it leaves only by a completion that needs rank ``i``;
    - the variant's rank table has no front-end effect (``front_end_gate``: a rank move would write the
      front-end, which the refresh reads).

    Rank ``i`` is not blocked (it has moves), so no collective completes before it moves; the coordinator's
    receipt from rank ``i``'s FIFO to it commutes with ``i`` appending to it; other ranks write their own
    slices, their FIFOs to the coordinator and the ``done``/``aborted`` sets, none of which rank ``i``'s
    moves read.
    """
    entry_calls = _transfer_entry_calls(model)
    if model.config.channels != "per-socket" or entry_calls is None:
        return None
    front = s.front
    if front.next_request < model.requests or len(front.client_aborted) < model.client_aborts:
        return None
    if s.ctrl.failures_used < model.failures or s.trainer.blocked:
        return None
    ranks = s.ranks
    if any(r.blocked in TRANSFER_KINDS for r in ranks) or model.controller_moves(s):
        return None
    fc, fw = model.f_ctrl, model.f_wave
    for i, r in enumerate(ranks):
        if r.status != SENT or r.blocked:
            continue
        others = [x for j, x in enumerate(ranks) if j != i]
        if any(m[1] in entry_calls for x in others for m in x.inq[fc]):
            continue
        if not r.inq[fw] and (any(s.coord_q) or r.outq or any(x.outq or not x.blocked for x in others)):
            continue
        mine = [e for e in succ if e[0][0] in ("recv", "step") and e[0][1] == i]
        if mine:
            return mine
    return None


_ENTRY_CALLS: weakref.WeakKeyDictionary[Model, frozenset[str] | None] = weakref.WeakKeyDictionary()


def _transfer_entry_calls(model: Model) -> frozenset[str] | None:
    """The controller calls whose receipt may enter a weight-transfer collective under the model's rank
    table; None when a row outside a controller call's receipt enters one, or a row names a front-end
    effect (two premises of :func:`rank_persistent_set`). Computed once a model."""
    if model in _ENTRY_CALLS:
        return _ENTRY_CALLS[model]
    call_of = {ev: call for call, ev in CALL_EVENT.items()}
    calls: set[str] | None = set()
    for (_, event), rows in model.table.items():
        for tr in rows:
            enters = any(ENTER_EFFECT.get(e) in TRANSFER_KINDS for e in tr.effects)
            if any(e in RANK_EFFECT_EVENT for e in tr.effects) or (enters and event not in call_of):
                calls = None
                break
            if enters and calls is not None:
                calls.add(call_of[event])
        if calls is None:
            break
    _ENTRY_CALLS[model] = frozen = None if calls is None else frozenset(calls)
    return frozen


def _quiet_step_first(model: Model, s: GlobalState, succ: Successors) -> Successors | None:
    for label, t in succ:
        if label[0] == "step" and not any(s.ranks[label[1]].inq):
            return [(label, t)]
    return None


def _one_rank_first(model: Model, s: GlobalState, succ: Successors) -> Successors | None:
    for label, _ in succ:
        if label[0] in ("recv", "step"):
            i = label[1]
            return [e for e in succ if e[0][0] in ("recv", "step") and e[0][1] == i]
    return None


#: The strategies, in the order they run (``full`` first: the baseline of every ratio).
STRATEGIES: dict[str, Strategy | None] = {
    "full": None,
    "collective_first": _collective_first,
    "rank_persistent": rank_persistent_set,
    "quiet_step_first": _quiet_step_first,
    "one_rank_first": _one_rank_first,
}
#: The strategies that ignore condition C1 (ceilings: what they save, a sound reduction cannot exceed on
#: that shape of set; their verdicts are not verdicts).
CEILINGS = ("quiet_step_first", "one_rank_first")
#: The strategies whose sets are persistent but may hold moves the invariants see: their terminal verdicts
#: (deadlock, one-sided collective) are verdicts, their invariant violations are not.
DEADLOCK_ONLY = ("rank_persistent",)


def restricted_bfs(model: Model, strategy: Strategy | None, proviso: bool = True) -> dict[str, Any]:
    """Breadth-first exploration of ``model`` expanding, at each state, the successors ``strategy`` picks
    when they are fewer than all and (with ``proviso``, the cycle proviso) every one is new, else all of
    them. A search for deadlocks alone needs no proviso: a path from ``s`` to a state without successors
    takes a move of a persistent set of ``s`` (each stays enabled until one is taken), which commutes to
    the front, so a successor in the set is one move nearer (Godefroid, LNCS 1032, on persistent sets).
    Both runs leave a state violating an invariant unexpanded, so ``run_por_bench`` compares their
    terminal verdicts rather than assume them equal.

    Returns:
        ``states`` (distinct states reached), ``proper`` (states expanded with the restricted set),
        ``violations`` (sorted names of the state properties violated in some reached state),
        ``terminals`` (sorted names of the terminal checks failed by a reached state without successors)
        and ``seconds`` (wall time).
    """
    t0 = time.perf_counter()
    init = model.initial()
    seen = {init}
    queue = deque([init])
    proper = 0
    violated: set[str] = set()
    terminals: set[str] = set()
    while queue:
        s = queue.popleft()
        bad = model.invariant(s)
        if bad:
            violated.update(bad)
            continue
        succ = model.successors(s)
        if not succ:
            terminals.update(model.terminal_check(s))
            continue
        if strategy is not None:
            picked = strategy(model, s, succ)
            if picked and len(picked) < len(succ) and (not proviso or all(t not in seen for _, t in picked)):
                succ = picked
                proper += 1
        for _, t in succ:
            if t not in seen:
                seen.add(t)
                queue.append(t)
    return {
        "states": len(seen),
        "proper": proper,
        "violations": sorted(violated),
        "terminals": sorted(terminals),
        "seconds": round(time.perf_counter() - t0, 2),
    }


#: The configurations: (variant, ranks, pause mode or any, requests); ``quick`` takes the first two.
CONFIGS: tuple[tuple[str, int, ModeSetting, int], ...] = (
    ("two-phase", 2, PauseMode.KEEP, 1),
    ("two-phase-epoch", 2, ANY_MODE, 1),
    ("two-phase-epoch", 3, PauseMode.KEEP, 1),
)


def run_por_bench(quick: bool = False) -> dict[str, Any]:
    """Every strategy of :data:`STRATEGIES` on every configuration of :data:`CONFIGS` (the first two with
    ``quick``), in this process.

    Returns:
        ``rows``: one per configuration (``variant``, ``ranks``, ``mode``, ``requests``, and per strategy its
        :func:`restricted_bfs` figures with ``ratio``, full states over its states); ``ceilings``: the
        strategies that ignore C1; ``deadlock_only``: the strategies sound for deadlock and not for the
        invariants; ``ok``: the collective set found the violations ``full`` found, and every strategy
        sound for deadlock (the collective set too) its terminal verdicts.
    """
    rows = []
    ok = True
    for variant, n, mode, requests in CONFIGS[:2] if quick else CONFIGS:
        config = Config(variant, n, mode, "per-socket", Bounds(requests=requests))
        row: dict[str, Any] = {"variant": variant, "ranks": n, "mode": mode.value, "requests": requests}
        for name, strategy in STRATEGIES.items():
            row[name] = restricted_bfs(Model(config, silent_waves=True), strategy, name not in DEADLOCK_ONLY)
        for name in STRATEGIES:
            row[name]["ratio"] = round(row["full"]["states"] / row[name]["states"], 3)
        ok = ok and row["collective_first"]["violations"] == row["full"]["violations"]
        ok = ok and all(
            row[name]["terminals"] == row["full"]["terminals"]
            for name in ("collective_first", *DEADLOCK_ONLY)
        )
        rows.append(row)
    return {"rows": rows, "ceilings": list(CEILINGS), "deadlock_only": list(DEADLOCK_ONLY), "ok": ok}


__all__ = [
    "CEILINGS",
    "CONFIGS",
    "DEADLOCK_ONLY",
    "STRATEGIES",
    "rank_persistent_set",
    "restricted_bfs",
    "run_por_bench",
]
