"""The protocol variants (a rank table plus the facts the model needs about it), the spec digest, and the
sans-IO ``RankMachine``.

Everything that affects a DP engine rank's protocol transitions lives in :mod:`weightsync.spec` (h11
``_state.py`` style), by concern: the local variables (vLLM's names), the named guards, the named updates
and the effect names in :mod:`weightsync.spec.rank_vars`; the tables, keyed by ``(RankState, RankEvent)``,
in :mod:`weightsync.spec.rank_tables` (two-phase and the historical designs) and
:mod:`weightsync.spec.rank_vllm032` (vLLM 0.32 and its fix). This module re-exports their public names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.spec.rank_tables import Table as Table
from weightsync.spec.rank_tables import _engine_pause_table
from weightsync.spec.rank_tables import front_end_pause_table as front_end_pause_table
from weightsync.spec.rank_tables import two_phase_table as two_phase_table
from weightsync.spec.rank_vars import EFFECT_RANKS as EFFECT_RANKS
from weightsync.spec.rank_vars import EFFECTS as EFFECTS
from weightsync.spec.rank_vars import GUARDS as GUARDS
from weightsync.spec.rank_vars import UPDATES as UPDATES
from weightsync.spec.rank_vars import Args as Args
from weightsync.spec.rank_vars import RankVars as RankVars
from weightsync.spec.rank_vars import __name__ as GUARDS_MODULE
from weightsync.spec.rank_vars import effect_acts_on as effect_acts_on
from weightsync.spec.rank_vars import relabel_weight_version as relabel_weight_version
from weightsync.spec.rank_vars import version_order as version_order
from weightsync.spec.rank_vllm032 import vllm032_table as vllm032_table
from weightsync.spec.states import LOCAL_CALLS, RankEvent, RankState
from weightsync.spec.table import (
    Fired,
    TableMachine,
    Transition,
    apply_transition,
    registry_digest,
    select_transition,
    table_digest,
)


@dataclass(frozen=True)
class Variant:
    """A protocol variant: a table plus the facts the model needs about it.

    Attributes:
        name: CLI name.
        description: one line.
        source: where it comes from.
        table: ``{(RankState, RankEvent): (Transition, ...)}``.
        pause_in_front_end: pause/resume are answered by the API front-end without reaching engines.
        resume_barrier_carries_wave: the resume all-reduce also carries MAX(current_wave).
        expected: what the model checker should find under per-socket channels ("verified" or
            "counterexample").
        verified_channels: channel semantics under which the variant is expected to verify.
        coordinator_latches: the DP coordinator sets engines_running when it broadcasts START_DP_WAVE for a
            FIRST_REQ (before vLLM's fix of issue #51476); False: only the engines' own reports
            (start_wave, wave_complete) move it (vLLM 0.32 ``v1/engine/coordinator.py:363-375``).
        first_req_exclusion: the START_DP_WAVE the coordinator broadcasts for a FIRST_REQ excludes the rank the
            request went to. False: vLLM 0.32, where the front-end names the target by its bytes identity
            and the engine compares it with its int index (``v1/engine/core_client.py:1592`` ->
            ``v1/engine/core.py:2288``), so the exclusion never matches and the target takes the wave too. weightsync's two-phase-epoch
            drops it on purpose: with the exclusion the target rank drops the wake-up, the client aborts the
            request before that rank steps, and its woken peer steps alone into ``dp_step`` (a one-sided
            collective; ``proofs`` row ``client-abort``).
        worker_flags_decide: weight-transfer calls reach the table with the worker's state as arguments
            (``worker``, ``worker_initialized``) and the table's rows decide by them (vLLM 0.32: no engine-level
            gate, the worker checks only its own flags).
        untracked_replies: the model accounts for the deferred replies of untracked calls (a second pause, an
            early or retried resume) per rank, so a reply they cause is not a spurious reply; a refused resume
            does not end the rank's pause (the vllm-0.32 variants, whose refusals are error replies).
        front_end_latches: the front-end sets ``engines_running`` when it forwards a FIRST_REQ (vLLM 0.32
            ``v1/engine/core_client.py:1546``). With vLLM 0.32's coordinator, which neither latches nor
            publishes for a FIRST_REQ, a front-end that latches believes paused, idle engines running until
            the coordinator's 5 s poll timeout (``v1/engine/coordinator.py:264-290``; vLLM issue #51481).
            False: weightsync's patch ``0004``, the belief comes only from the coordinator's stats.
    """

    name: str
    description: str
    source: str
    table: Table = field(repr=False)
    pause_in_front_end: bool = False
    resume_barrier_carries_wave: bool = False
    expected: str = "counterexample"
    verified_channels: tuple[str, ...] = ()
    coordinator_latches: bool = True
    first_req_exclusion: bool = True
    worker_flags_decide: bool = False
    untracked_replies: bool = False
    front_end_latches: bool = True

    def expected_verdict(self, channels: str) -> str:
        """ "verified" if the variant should verify under ``channels``, else "counterexample"."""
        return "verified" if channels in self.verified_channels else "counterexample"

    def digest(self) -> str:
        """SHA-256 of this variant's table rows (sorted)."""
        rows = sorted(
            ((s, e, tr) for (s, e), trs in self.table.items() for tr in trs),
            key=lambda r: (r[0].value, r[1].value),
        )
        # Environment flags added later enter the digest only when they differ from their defaults, so the
        # digests of the variants that predate them do not move.
        extra = [
            f"{name}={getattr(self, name)}"
            for name, default in (
                ("worker_flags_decide", False),
                ("untracked_replies", False),
                ("front_end_latches", True),
            )
            if getattr(self, name) != default
        ]
        return table_digest(
            rows,
            self.name,
            str(self.pause_in_front_end),
            str(self.resume_barrier_carries_wave),
            str(self.coordinator_latches),
            str(self.first_req_exclusion),
            *extra,
            registry_digest(GUARDS_MODULE, "GUARDS", "UPDATES"),
        )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "two-phase-epoch",
            "two-phase pause/resume whose resume barrier agrees on the wave (MAX(current_wave) + 1), a "
            "resume that is a no-op on a running rank (a barrier from verified, refused elsewhere), and vLLM 0.32's "
            "non-latching coordinator",
            "weightsync: closes the resume-time race of two-phase and the stray-resume deadlock",
            two_phase_table(epoch=True, safe_resume=True, mirror_start_wave=True),
            resume_barrier_carries_wave=True,
            expected="verified",
            verified_channels=("per-socket", "ordered"),
            coordinator_latches=False,
            first_req_exclusion=False,
            untracked_replies=True,
            front_end_latches=False,
        ),
        Variant(
            "two-phase",
            "vLLM's two-phase pause/resume as shipped: honour waves until consensus, resume is a barrier",
            "vLLM PR #39366",
            two_phase_table(epoch=False),
            verified_channels=(),  # ordered channels close its resume-time race, not wait_drains
        ),
        Variant(
            "front-end-pause",
            "pause held in the API front-end; engines keep stepping and honouring waves",
            "vLLM PR #28037 (before PR #34125); the blog's DP=2 scenario",
            front_end_pause_table(),
            pause_in_front_end=True,
        ),
        Variant(
            "idle-fast-path",
            "engine pause returns at once when idle; a late START_DP_WAVE re-arms it",
            "vLLM issue #36594",
            _engine_pause_table(ignore_waves_while_paused=False),
        ),
        Variant(
            "ignore-wave",
            "a paused engine ignores START_DP_WAVE at once",
            "vLLM PR #36608 (closed, rejected)",
            _engine_pause_table(ignore_waves_while_paused=True),
        ),
        Variant(
            "vllm-0.32",
            "vLLM 0.32 as shipped: sync at step 1 and every K, non-latching coordinator, rank 0's mirror "
            "start_wave, a FIRST_REQ exclusion that never matches, resume errors and a second pause accepted, "
            "weight calls in any state, non-sticky errors",
            "vLLM 0.32.0 v1/engine/core.py:2143-2427, coordinator.py:197-466, core_client.py:1582-1596",
            vllm032_table(epoch=False),
            # ordered channels close its resume-time race, but not its front-end's stale belief
            # (front_end_belief), which needs no reordering
            verified_channels=(),
            coordinator_latches=False,
            first_req_exclusion=False,
            worker_flags_decide=True,
            untracked_replies=True,
        ),
        Variant(
            "vllm-0.32-epoch",
            "weightsync's fix on vLLM 0.32: the resume all-reduce agrees on MAX(current_wave) + 1 and resets the "
            "step counter; a resume is a no-op on a running rank; weight calls only inside a pause; a pause or "
            "resume during an update refused",
            "weightsync on vLLM 0.32.0 (the environment of vllm-0.32 unchanged)",
            vllm032_table(epoch=True),
            resume_barrier_carries_wave=True,
            expected="verified",
            verified_channels=("per-socket", "ordered", "one-api-server"),
            coordinator_latches=False,
            first_req_exclusion=False,
            untracked_replies=True,
            front_end_latches=False,
        ),
    )
}

DEFAULT_VARIANT = "two-phase-epoch"


def get_variant(name: str) -> Variant:
    """The variant called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known variants).
    """
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown protocol variant {name!r}; known variants: {', '.join(VARIANTS)}"
        ) from None


def spec_digest() -> str:
    """One digest over the whole protocol (``weightsync prove --check``): every variant's rank table, the
    worker table, the DP coordinator's table for each flag combination the variants use, the front-end's
    and the controller's tables, and the collectives' data. (The mutation report has its own digest of the
    rank and worker tables: :func:`weightsync.model.mutation.mutation_digest`.)"""
    from weightsync.spec.collectives import collectives_digest
    from weightsync.spec.controller import controller_digest
    from weightsync.spec.coordinator import coordinator_digest
    from weightsync.spec.front_end import front_end_digest
    from weightsync.spec.worker import worker_table_digest

    combos = sorted({(v.coordinator_latches, v.first_req_exclusion) for v in VARIANTS.values()})
    front_ends = sorted({v.front_end_latches for v in VARIANTS.values()})
    return table_digest(
        (),
        *(v.digest() for v in VARIANTS.values()),
        worker_table_digest(),
        *(coordinator_digest(*flags) for flags in combos),
        *(front_end_digest(latches) for latches in front_ends),
        controller_digest(),
        collectives_digest(),
    )


def select(
    table: Table,
    v: RankVars,
    event: RankEvent,
    args: Args,
    guards: Mapping[str, Callable[[RankVars, Args], bool]] = GUARDS,
) -> Transition | None:
    """The transition ``event`` takes from ``v`` under ``table`` (first guard that holds), or None.

    ``guards`` defaults to :data:`GUARDS`; the model checker's mutation test passes an extended registry.
    """
    return select_transition(table, v.state, event, v, args, guards)


def apply(
    v: RankVars,
    tr: Transition,
    args: Args,
    updates: Mapping[str, Callable[[RankVars, Args], RankVars]] = UPDATES,
) -> RankVars:
    """Apply ``tr``'s updates to ``v`` and move to its target (pure; used by the model's hot loop)."""
    return apply_transition(v, tr, args, updates)


class RankMachine(TableMachine[RankState, RankEvent]):
    """Sans-IO protocol machine of one DP engine rank.

    ``fire(event, **args)`` returns a :class:`~weightsync.spec.table.Fired`; the caller runs
    ``fired.transition.effects`` (see :data:`EFFECTS`). No I/O, no torch, no threads.

    Args:
        rank: DP rank index (0 is the rank that emits wave_complete).
        dp_size: number of DP ranks.
        variant: protocol variant name (default ``two-phase-epoch``).
        sync_interval: K, the DP sync all-reduce cadence in steps (PR #21617: 32; vLLM 0.32: 16).
        name: how errors name the machine (default ``rank <rank>``).

    Raises:
        ValueError: unknown variant, rank outside ``[0, dp_size)``, or ``sync_interval < 1``.
        LocalProtocolError / RemoteProtocolError from ``fire`` (then the machine is in ``error``).
    """

    def __init__(
        self,
        rank: int,
        dp_size: int,
        variant: str = DEFAULT_VARIANT,
        sync_interval: int = 32,
        name: str | None = None,
    ) -> None:
        if not 0 <= rank < dp_size:
            raise ValueError(f"rank {rank} is outside [0, dp_size={dp_size})")
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        self.variant = get_variant(variant)
        self.rank = rank
        self.dp_size = dp_size
        self.sync_interval = sync_interval
        super().__init__(
            f"rank {rank}" if name is None else name,
            self.variant.table,
            GUARDS,
            UPDATES,
            RankVars(),
            LOCAL_CALLS,
            RankState.ERROR,
        )

    def _with_rank(self, args: Mapping[str, Any]) -> dict[str, Any]:
        full = {"rank": self.rank, "dp_size": self.dp_size, "sync_interval": self.sync_interval}
        full.update(args)
        return full

    def select(self, event: RankEvent, args: Mapping[str, Any]) -> Transition | None:
        """The row ``event`` would take now (``rank``, ``dp_size``, ``sync_interval`` supplied), or None."""
        return super().select(event, self._with_rank(args))

    def explain_illegal(self, event: RankEvent, args: Mapping[str, Any]) -> str:
        """The error text of an illegal ``event`` (see :meth:`TableMachine.explain_illegal`)."""
        return super().explain_illegal(event, self._with_rank(args))

    def fire(self, event: RankEvent, **args: Any) -> Fired:
        """Fire ``event``; ``rank``, ``dp_size`` and ``sync_interval`` are supplied automatically."""
        args.setdefault("rank", self.rank)
        args.setdefault("dp_size", self.dp_size)
        args.setdefault("sync_interval", self.sync_interval)
        return super().fire(event, **args)


def rank_machines(
    n: int, variant: str = DEFAULT_VARIANT, sync_interval: int = 32, *, lockstep: bool = True
) -> list[RankMachine]:
    """One machine per DP engine behind a front-end with ``n`` engines (list index: the engine's index).

    ``lockstep`` True: the engines are the ranks of one DP world, rank ``r`` of ``n`` (a MoE model: vLLM
    0.32 runs each as a ``DPEngineCoreProc``, ``v1/engine/core.py:1473-1476``). False: they are
    independent (a dense model: each is an ``EngineCoreProc`` that
    ``ParallelConfig.reconfigure_for_independent_dp_rank`` made ``data_parallel_size`` 1, rank 0,
    ``v1/engine/core.py:1477-1482``, ``config/parallel.py:1172-1181``), so each is rank 0 of a world of
    one: no DP collective with its peers, and the transfer-init gate does not apply.

    Raises:
        ValueError: ``n`` < 1, or as :class:`RankMachine`.
    """
    if n < 1:
        raise ValueError(f"a front-end has at least one engine, got {n}")
    if lockstep:
        return [RankMachine(r, n, variant, sync_interval) for r in range(n)]
    return [RankMachine(0, 1, variant, sync_interval, f"engine {i} (a DP world of one)") for i in range(n)]


def dp_peers(machines: Sequence[RankMachine], r: int) -> list[int]:
    """The engines (indices into ``machines``, built by :func:`rank_machines`) in engine ``r``'s DP world,
    the members of its DP collectives: every engine when they step in lockstep, ``r`` alone when each is a
    world of one (``dp_size`` 1)."""
    return [r] if machines[r].dp_size == 1 else list(range(len(machines)))
