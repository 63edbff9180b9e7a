"""The table-checking adapter between :class:`~weightsync.impl.checked.CheckedEngine` and a running vLLM:
what it observes and infers, and its rules, are in :mod:`weightsync.vllm_tools.checked`. Its subclasses talk to
vLLM: :mod:`weightsync.vllm_tools.checked.async_llm` and :mod:`weightsync.vllm_tools.checked.http`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from weightsync.impl.engine.messages import RankRecord, RelabelRecord, TransitionRecord
from weightsync.impl.engine.tracing import jsonable
from weightsync.impl.trace_replay import vars_to_dict
from weightsync.spec.calls import CALL_EVENT, worker_outcome
from weightsync.spec.collectives import (
    CALL_FAIL_PHASE,
    COLLECTIVES,
    DONE_EVENT,
    DP_KINDS,
    ENTER_EFFECT,
    contribution,
    done_args,
    outcome_args,
    reduce_values,
)
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.rank import DEFAULT_VARIANT, RankMachine, dp_peers, rank_machines, relabel_weight_version
from weightsync.spec.refusal import refusal_text
from weightsync.spec.states import (
    PAUSE_STATE_OF_MODE,
    Collective,
    PauseMode,
    PauseState,
    RankEvent,
    RankState,
    schedulable,
)

#: the vLLM call of each controller-call event (the inverse of the spec's :data:`CALL_EVENT`)
CALL_OF_EVENT: dict[RankEvent, str] = {e: c for c, e in CALL_EVENT.items()}
#: the rank-table effect of a resume that enters the resume barrier (else the resume is a local no-op)
ENTER_RESUME_BARRIER = COLLECTIVES[Collective.RESUME_BARRIER].enter
DEFAULT_TIMEOUT_S = 300.0

#: per-rank front-end counts ``(waiting, running)``; ``(-1, -1)`` when not observable
Counts = tuple[int, int]
UNKNOWN: Counts = (-1, -1)


class VLLMAdapter:
    """The engine-client API of :class:`~weightsync.impl.checked.CheckedEngine` over a vLLM front-end, with
    the table transitions derived from what the controller observes (see the module docstring).

    Subclasses supply the vLLM calls (``_vllm_*``) and the observations (``_unfinished``, ``_is_paused``,
    ``get_weight_version``).

    Attributes:
        dp_size: DP engines behind the front-end (ranks of the table).
        lockstep: the engines are one DP world (a MoE model) or each a world of one (a dense model); see
            :func:`~weightsync.spec.rank.rank_machines`.
        variant: the table's variant name.
        sync_interval: the table's K for the inferred steps (1: one sync step per pause).
        machines: one :class:`~weightsync.spec.rank.RankMachine` per rank, the adapter's own.
        transitions: every derived record, in report order (a linearization: one controller at a time).
        lost: why vLLM's state is unknown (every later call refused), or None.

    Raises:
        ValueError: the engine is paused when attaching, or ``dp_size`` < 1.
    """

    def __init__(
        self,
        dp_size: int,
        weight_version: str,
        *,
        variant: str = DEFAULT_VARIANT,
        sync_interval: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lockstep: bool = True,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = int(dp_size)
        self.variant = variant
        self.sync_interval = int(sync_interval)
        self.timeout_s = float(timeout_s)
        self.lockstep = bool(lockstep)
        self.machines = rank_machines(self.dp_size, variant, self.sync_interval, lockstep=self.lockstep)
        for m in self.machines:
            m.vars = m.vars._replace(weight_version=str(weight_version))
        self.rank_seq = [0] * self.dp_size
        self.coll_seq = [0] * self.dp_size
        self.transitions: list[TransitionRecord] = []
        self.lost: str | None = None
        self._listeners: list[Callable[[RankRecord], None]] = []
        self._lock = threading.RLock()
        self._held_running = True  # how to split unfinished counts (keep: frozen running; else held waiting)

    # ------------------------------------------------------------------ hooks (subclasses)
    def _vllm_pause(self, mode: str, clear_cache: bool, timeout: float) -> tuple[list[int], list[int]]:
        """Pause vLLM; return the per-rank unfinished counts just before and just after (-1: unknown)."""
        raise NotImplementedError

    def _vllm_resume(self, timeout: float) -> None:
        raise NotImplementedError

    def _vllm_call(self, event: RankEvent, payload: Any, timeout: float) -> None:
        """``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
        ``finish_weight_update`` (``payload``: the init info, None, the update info, the version)."""
        raise NotImplementedError

    def _unfinished(self, timeout: float) -> list[int]:
        raise NotImplementedError

    def _is_paused(self, timeout: float) -> bool:
        raise NotImplementedError

    def get_weight_version(self) -> str:
        """vLLM's ``get_weight_version()`` (a consensus over the engines)."""
        raise NotImplementedError

    def _vllm_relabel(self, new_version: str, timeout: float) -> None:
        """vLLM's ``update_weight_version(new_version)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ CheckedEngine's attach protocol
    def add_transition_listener(self, cb: Callable[[RankRecord], None]) -> None:
        """``cb(record)`` for every derived transition (CheckedEngine feeds its shadows and the trace)."""
        with self._lock:
            self._listeners.append(cb)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each rank's ``{"vars": RankVars dict, "rank_seq": records so far}`` (CheckedEngine starts there)."""
        with self._lock:
            return [
                {"vars": vars_to_dict(m.vars), "rank_seq": self.rank_seq[r]}
                for r, m in enumerate(self.machines)
            ]

    def get_state(self) -> list[dict[str, Any]]:
        """Each rank's table variables (as dicts), in rank order."""
        return [s["vars"] for s in self.snapshot()]

    # ------------------------------------------------------------------ derivation
    def _counts(self, unfinished: int) -> Counts:
        if unfinished < 0:
            return UNKNOWN
        return (0, unfinished) if self._held_running else (unfinished, 0)

    def _fire(self, r: int, event: RankEvent, args: dict[str, Any], counts: Counts) -> TransitionRecord:
        m = self.machines[r]
        before = vars_to_dict(m.vars)
        fired = m.fire(event, **args)
        tr = fired.transition
        coll = next((ENTER_EFFECT[e] for e in tr.effects if e in ENTER_EFFECT), "")
        rec = TransitionRecord(
            r,
            self.rank_seq[r],
            event.value,
            {k: jsonable(v) for k, v in args.items()},
            before,
            vars_to_dict(m.vars),
            tr.guard,
            tuple(tr.effects),
            coll,
            self.coll_seq[r],
            time.time(),
            counts[0],
            counts[1],
        )
        self.rank_seq[r] += 1
        if coll in DP_KINDS:
            self.coll_seq[r] += 1
        self.transitions.append(rec)
        for cb in list(self._listeners):
            cb(rec)
        return rec

    def _preflight(self, event: RankEvent, args: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
        """Rule 1: the row of ``event`` on every rank (their effects), or LocalProtocolError; refuses a
        lost adapter."""
        if self.lost is not None:
            raise RemoteProtocolError(
                f"vLLM's state is unknown ({self.lost}); {event.value} refused: attach a new adapter"
            )
        effects = []
        for r, m in enumerate(self.machines):
            tr = m.select(event, args[r])
            if tr is None:
                raise LocalProtocolError(m.explain_illegal(event, args[r]) + " (not sent to vLLM)")
            effects.append(tuple(tr.effects))
        return effects

    def _refuse(
        self, event: RankEvent, args: Sequence[dict[str, Any]], effects: list[tuple[str, ...]]
    ) -> None:
        if not any("refuse" in e for e in effects):
            return
        counts = [self._counts(u) for u in self._unfinished(self.timeout_s)]
        refused = [r for r, e in enumerate(effects) if "refuse" in e]
        first = self.machines[refused[0]]
        state, row = first.state, first.select(event, args[refused[0]])
        for r in refused:
            self._fire(r, event, dict(args[r]), counts[r])
        text = refusal_text(
            ", ".join(map(str, refused)), event.value, state, event, row.rule if row else "", ""
        )
        raise LocalProtocolError(text + " (not sent to vLLM)")

    def _lose(self, why: str) -> None:
        self.lost = why

    def _lockstep(self, target: RankState, counts: list[Counts]) -> None:
        """Inferred steps and collective completions, each DP world in lockstep (every engine, or each
        engine alone: :func:`~weightsync.spec.rank.dp_peers`), until every rank is in ``target`` outside
        any collective."""
        for world in sorted({tuple(dp_peers(self.machines, r)) for r in range(self.dp_size)}):
            self._lockstep_world(target, world, counts)

    def _lockstep_world(self, target: RankState, world: tuple[int, ...], counts: list[Counts]) -> None:
        machines = [self.machines[r] for r in world]
        for _ in range(2 * self.sync_interval + 4):
            if all(m.state is target and not m.vars.collective for m in machines):
                return
            kinds = set()
            for r, m in zip(world, machines, strict=True):
                if not m.vars.collective:
                    work = self._has_work(m, counts[r])
                    kinds.add(self._fire(r, RankEvent.STEP, {"has_work": work}, counts[r]).collective)
                else:
                    kinds.add(m.vars.collective)
            if len(kinds) != 1 or "" in kinds or kinds.pop() not in DP_KINDS:
                break
            kind = machines[0].vars.collective
            outcome = self._outcome(kind, [(m, counts[r]) for r, m in zip(world, machines, strict=True)])
            for r, m in zip(world, machines, strict=True):
                args = dict(done_args(kind, tuple(outcome.items()), self._has_work(m, counts[r])))
                self._fire(r, DONE_EVENT[kind], args, counts[r])
        states = [
            f"rank {r}: {m.state.value} {m.vars.collective or ''}".strip()
            for r, m in enumerate(self.machines)
        ]
        self._lose(f"no table path to {target.value} for the returned call ({'; '.join(states)})")
        raise RemoteProtocolError(f"vLLM's call returned but {self.lost}")

    @staticmethod
    def _has_work(m: RankMachine, c: Counts) -> bool:
        if c[0] < 0:
            return False  # unknown counts: a returned pause means nothing is schedulable (inference)
        return schedulable(PauseState(m.vars.pause_state), c[0], c[1])

    def _outcome(self, kind: str, members: list[tuple[RankMachine, Counts]]) -> dict[str, int]:
        """The all-reduce outcome of ``kind`` from its members' machines and counts (one DP world): the
        spec's contributions and reduction (:mod:`weightsync.spec.collectives`); an unknown count
        contributes no unfinished work (a returned pause: nothing schedulable, see :meth:`_has_work`)."""
        contributions = [
            contribution(
                kind,
                PauseState(m.vars.pause_state),
                max(0, c[0]),
                max(0, c[1]),
                bool(m.vars.pending_pause),
                int(m.vars.current_wave),
            )
            for m, c in members
        ]
        return dict(outcome_args(kind, reduce_values(kind, contributions)))

    # ------------------------------------------------------------------ the engine-client API
    def pause(
        self, mode: str | PauseMode = "abort", clear_cache: bool = True, timeout: float | None = None
    ) -> None:
        """vLLM's ``pause_generation(mode=..., clear_cache=...)``; on return every rank is ``verified``.

        Raises:
            LocalProtocolError: illegal or refused on some rank (vLLM not called).
            RemoteProtocolError: vLLM's pause raised, timed out, or it returned but ``is_paused()`` is False.
        """
        m = PauseMode(mode)
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            probe = [{"mode": m, "clear_cache": bool(clear_cache), "running": 0, "waiting": 0}] * self.dp_size
            effects = self._preflight(RankEvent.PAUSE, probe)
            self._refuse(RankEvent.PAUSE, probe, effects)
            try:
                before, after = self._vllm_pause(m.value, bool(clear_cache), t)
                paused = self._is_paused(t)
            except BaseException as exc:
                self._lose(f"pause_generation raised {type(exc).__name__}: {exc}")
                raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
            if not paused:
                self._lose("pause_generation returned but is_paused() is False")
                raise RemoteProtocolError(f"vLLM's {self.lost}")
            # a mode that freezes running requests (PAUSED_ALL) holds them; the others drain them
            self._held_running = PAUSE_STATE_OF_MODE[m] is PauseState.PAUSED_ALL
            for r in range(self.dp_size):
                c = self._counts(before[r])
                # vLLM reports one unfinished count per rank: passed as ``running`` (under the fixed
                # variants' wait, queued requests drain like running ones: the same target state)
                args = {
                    "mode": m,
                    "clear_cache": bool(clear_cache),
                    "running": max(0, before[r]),
                    "waiting": 0,
                }
                self._fire(r, RankEvent.PAUSE, args, c)
            self._lockstep(RankState.VERIFIED, [self._counts(a) for a in after])

    def resume(self, timeout: float | None = None) -> None:
        """vLLM's ``resume_generation()``; on return every rank is ``running`` (rule 1: a local no-op row is
        recorded without calling vLLM).

        Raises:
            LocalProtocolError: illegal or refused on some rank (vLLM not called).
            RemoteProtocolError: vLLM's resume raised, timed out, or ``is_paused()`` is still True.
        """
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            probe: list[dict[str, Any]] = [{}] * self.dp_size
            effects = self._preflight(RankEvent.RESUME, probe)
            self._refuse(RankEvent.RESUME, probe, effects)
            if not any(ENTER_RESUME_BARRIER in e for e in effects):
                counts = [self._counts(u) for u in self._unfinished(t)]
                for r in range(self.dp_size):
                    self._fire(r, RankEvent.RESUME, {}, counts[r])
                return
            try:
                counts = [self._counts(u) for u in self._unfinished(t)]
                self._vllm_resume(t)
                paused = self._is_paused(t)
            except BaseException as exc:
                self._lose(f"resume_generation raised {type(exc).__name__}: {exc}")
                raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
            if paused:
                self._lose("resume_generation returned but is_paused() is True")
                raise RemoteProtocolError(f"vLLM's {self.lost}")
            for r in range(self.dp_size):
                self._fire(r, RankEvent.RESUME, {}, counts[r])
            self._lockstep(RankState.RUNNING, counts)

    def _weight_call(
        self,
        event: RankEvent,
        payload: Any,
        timeout: float | None,
        outcome: tuple[RankEvent, dict[str, Any]] | None = None,
    ) -> None:
        """Rules 1-2 for the weight call ``event``; once vLLM returned, the call's row on every rank, then
        the completion (:data:`~weightsync.spec.collectives.DONE_EVENT`) of the collective that row entered
        (the table's, e.g. ``weight_broadcast``), then ``outcome`` (the workers' outcome event and its
        arguments: a finish's ``finish_done``)."""
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            probe: list[dict[str, Any]] = [{}] * self.dp_size
            effects = self._preflight(event, probe)
            self._refuse(event, probe, effects)
            counts = [self._counts(u) for u in self._unfinished(t)]
        # not under the lock: update_weights runs for as long as the trainer sends
        try:
            self._vllm_call(event, payload, t)
        except TimeoutError as exc:
            with self._lock:
                self._lose(f"{event.value} timed out after {t:.1f} s (it may still be running in vLLM)")
            raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
        except BaseException as exc:
            with self._lock:
                for r in range(self.dp_size):
                    self._fire(r, event, {}, counts[r])
                    err = {"phase": CALL_FAIL_PHASE[event], "error": f"{type(exc).__name__}: {exc}"}
                    self._fire(r, RankEvent.TRANSFER_FAILED, err, counts[r])
            raise
        with self._lock:
            entered = [self._fire(r, event, {}, counts[r]).collective for r in range(self.dp_size)]
            for r, kind in enumerate(entered):
                if kind:
                    self._fire(r, DONE_EVENT[kind], {}, counts[r])
            if outcome is not None:
                done, done_args = outcome
                for r in range(self.dp_size):
                    self._fire(r, done, dict(done_args), counts[r])

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """vLLM's ``init_weight_transfer_engine(WeightTransferInitRequest(init_info))``.

        Raises:
            LocalProtocolError: illegal on some rank (vLLM not called).
            vLLM's exception (over HTTP: :class:`~weightsync.vllm_tools.checked.http.VLLMCallError`): the engines failed (recorded as ``transfer_failed``).
        """
        self._weight_call(RankEvent.INIT_TRANSFER, init_info, timeout)

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        """vLLM's ``start_weight_update()`` (checkpoint format: vLLM 0.32 has no other).

        Raises:
            LocalProtocolError: illegal on some rank, e.g. a second start (vLLM not called).
        """
        self._weight_call(RankEvent.START_UPDATE, None, timeout)

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """vLLM's ``update_weights(WeightTransferUpdateRequest(update_info))`` (a dict, or a list indexed by
        global worker rank).

        Raises:
            LocalProtocolError: illegal on some rank, e.g. while serving (vLLM not called).
        """
        self._weight_call(RankEvent.UPDATE_WEIGHTS, update_info, timeout)

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        """vLLM's ``finish_weight_update(weight_version=...)``; then ``get_weight_version()`` must equal the
        version the table holds.

        Raises:
            ValueError: ``monotonic=True`` (rule 3), or ``weight_version`` not a str or None.
            LocalProtocolError: illegal on some rank (vLLM not called).
            RemoteProtocolError: the version vLLM reports afterwards is not the table's.
        """
        if monotonic:
            raise ValueError("vLLM has no monotonic weight_version guard and the adapter does not emulate it")
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(
                f"finish_weight_update: weight_version must be a str or None, got {weight_version!r}"
            )
        done = worker_outcome("finish_weight_update", {"weight_version": weight_version})
        self._weight_call(RankEvent.FINISH_UPDATE, weight_version, timeout, done)
        self._observe_version("finish_weight_update")

    def update_weight_version(self, new_version: str, *, timeout: float | None = None) -> None:
        """vLLM's ``update_weight_version(new_version)`` (``v1/engine/async_llm.py:1357-1359``): a label set
        in any state, no transition. Each rank applies :func:`~weightsync.spec.rank.relabel_weight_version`
        and reports a :class:`~weightsync.impl.engine.messages.RelabelRecord`; then ``get_weight_version()``
        must equal it.

        Raises:
            ValueError: ``new_version`` is not a str (vLLM not called).
            RemoteProtocolError: the adapter lost vLLM's state, the call timed out, or vLLM reports another
                version afterwards.
        """
        if not isinstance(new_version, str):
            raise ValueError(f"update_weight_version: new_version must be a str, got {new_version!r}")
        if self.lost is not None:
            raise RemoteProtocolError(
                f"vLLM's state is unknown ({self.lost}); update_weight_version refused: attach a new adapter"
            )
        t = self.timeout_s if timeout is None else float(timeout)
        try:
            self._vllm_relabel(new_version, t)
        except TimeoutError as exc:
            with self._lock:
                self._lose(f"update_weight_version timed out after {t:.1f} s")
            raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
        with self._lock:
            for r, m in enumerate(self.machines):
                before = vars_to_dict(m.vars)
                m.vars = relabel_weight_version(m.vars, new_version)
                rec = RelabelRecord(
                    r, self.rank_seq[r], new_version, before, vars_to_dict(m.vars), time.time()
                )
                self.rank_seq[r] += 1
                for cb in list(self._listeners):
                    cb(rec)
        self._observe_version("update_weight_version")

    def _observe_version(self, after: str) -> None:
        with self._lock:
            want = {str(m.vars.weight_version) for m in self.machines}
        try:
            got = self.get_weight_version()
        except BaseException as exc:
            with self._lock:
                self._lose(f"get_weight_version raised {type(exc).__name__}: {exc}")
            raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
        if want != {got}:
            with self._lock:
                self._lose(f"after {after} vLLM reports version {got!r}, the table {sorted(want)}")
            raise RemoteProtocolError(f"vLLM's state diverged: {self.lost}")


__all__ = [
    "CALL_OF_EVENT",
    "DEFAULT_TIMEOUT_S",
    "ENTER_RESUME_BARRIER",
    "UNKNOWN",
    "Counts",
    "VLLMAdapter",
]
