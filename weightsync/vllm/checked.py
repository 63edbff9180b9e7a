"""CheckedEngine around a real vLLM 0.32: adapters that give a running ``AsyncLLM`` (or a ``vllm serve``
with ``VLLM_SERVER_DEV_MODE=1``) the engine-client API of :class:`weightsync.impl.checked.CheckedEngine`,
and derive the per-rank table transitions that vLLM itself never reports.

Use :func:`checked_async_llm` (or :func:`checked_http`): every controller call (``pause``, ``resume``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``) is
checked against the table of every DP rank before it reaches vLLM. vLLM has no gate of its own (reference
``vllm-0.32.md`` section 3 item 7: ``collective_rpc`` runs in any state; a ``start_weight_update`` while
serving runs, and so does a resume in the middle of an update; only the worker, once the call has crossed
into the engine, refuses an ``update_weights`` outside a round and a second start, by its own flag), so an
illegal call -- ``update_weights`` while serving, ``start_weight_update`` twice -- raises
:class:`~weightsync.spec.errors.LocalProtocolError` in this process and no message leaves it for vLLM.
A :class:`~weightsync.impl.checked.CheckedEngine` is itself a vLLM ``VLLMWeightSyncClient``, so a trainer
built by ``WeightTransferTrainerFactory.trainer_init(..., client=<checked engine>)`` goes through the checks.

What the adapters **observe** from vLLM, and what they **infer**:

- Observed: that a vLLM call returned, or raised (and its error); ``is_paused()`` right after a pause and a
  resume returned (must be True / False: else the adapter stops, :class:`RemoteProtocolError`);
  ``get_weight_version()`` when attaching and after every finish (must equal the version the table now
  holds); the front-end's count of unfinished requests per DP rank just before every call it sends and just
  after each pause (``AsyncLLM.output_processor`` for one engine, the DP client's
  ``reqs_in_flight`` routing table for several; :class:`HTTPServerAdapter` sees none and records -1).
- Inferred: every table transition. vLLM reports none, so each returned call is mapped onto the table's
  rows from the rank's state, as the reference engine (:mod:`weightsync.impl.engine.core`) would fire them:

  ========================  ====================================================================================
  call returned             transitions recorded on every rank, in lockstep
  ========================  ====================================================================================
  ``pause(mode)``           ``pause`` (args ``mode``, ``clear_cache``, ``running`` = the rank's unfinished count
                            before the call), then ``step`` -> ``dp_sync_done`` (or ``dp_step_done`` and again,
                            with ``sync_interval`` > 1) until the rank is ``verified``: a returned pause *is*
                            phase 2's agreement. The outcome arguments (``sum_unfinished``, ``sum_pending_pause``)
                            are the SUM the table's all-reduce would compute from the ranks' states and counts.
  ``resume()``              ``resume`` -> ``resume_barrier_done`` (``max_unfinished`` from the counts before the
                            call, ``max_wave`` from the ranks' waves): ``running``.
  ``init_weight_transfer``  ``init_weight_transfer_engine`` -> ``transfer_init_done``
  ``start_weight_update``   ``start_weight_update`` (-> ``updating``)
  ``update_weights``        ``update_weights`` -> ``weight_broadcast_done``
  ``finish_weight_update``  ``finish_weight_update`` -> ``finish_done`` (``weight_version``): ``verified``
  a weight call raised      the call's transition, then ``transfer_failed`` (``phase``, ``error``): ``failed``
  ``update_weight_version`` no transition: a relabel record (``relabel_weight_version``) on every rank
  ========================  ====================================================================================

  Each record's ``waiting`` / ``running`` are the front-end's unfinished counts, split by inference: vLLM's
  scheduler split is not visible from the client. Requests kept by ``pause(mode="keep")`` count as running
  (frozen); requests still unfinished after an ``abort`` or ``wait`` pause returned count as waiting (held:
  the only split under which a returned pause agrees with the table). The waves, the step counter and the
  sync cadence are the table's, not vLLM's: a dense vLLM engine has no DP waves at all (reference section
  3), and the adapters model each returned pause with ``sync_interval=1`` by default (one inferred sync step
  per pause; vLLM's real cadence, 16 steps, is invisible to a client).

Rules of the adapters:

1. **Refusals stay local.** A call with no row in some rank's state raises ``LocalProtocolError`` (the
   adapter checks too, so it is safe without CheckedEngine); a call whose row is the table's ``refuse`` (a
   ``failed`` rank asked to pause, resume, update or finish) records that row and raises
   ``LocalProtocolError``. In neither case is vLLM called. A ``resume`` whose row is the local no-op (a
   rank already running, ``two-phase-epoch``'s safe resume) records it and does not call vLLM.
2. **Failures are table events.** A weight call that vLLM answers with an error records the call's row and
   then ``transfer_failed``; the error is raised. A new round (``start_weight_update``) is legal from
   ``failed``. A pause or resume that raises, any call that times out, or an observation that disagrees
   with the table leaves vLLM's state unknown: the adapter records nothing more and refuses every later
   controller call with :class:`RemoteProtocolError` (attach a new adapter to a known state).
3. **No monotonic guard.** vLLM has no monotonic version guard, and the adapters do not emulate the table's
   ``version_older`` row: ``finish_weight_update(monotonic=True)`` raises ``ValueError`` before vLLM is called.
4. **Attach to a serving engine.** The adapter starts every rank at the table's initial state (``running``)
   with vLLM's current ``weight_version``; it refuses an engine that ``is_paused()``.

Known divergence: after a ``finish_weight_update`` that failed in vLLM (e.g. weightsync's backend raising
``IncompleteUpdateError``), vLLM keeps the round open (its worker does not reset ``_weight_update_active``),
while the table has the rank ``failed``; the table then allows only a new ``start_weight_update``, which
vLLM's worker refuses while that round is open. Recovering needs vLLM to abandon the round.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from weightsync.impl.checked import CheckedEngine, vars_to_dict
from weightsync.impl.engine.messages import RankRecord, RelabelRecord, TransitionRecord
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.rank import DEFAULT_VARIANT, RankMachine, relabel_weight_version
from weightsync.spec.states import (
    PauseMode,
    PauseState,
    RankEvent,
    RankState,
    schedulable,
    unfinished_for_sync,
)

T = TypeVar("T")

#: DP collectives (numbered by ``coll_seq``) and the completion event of every collective the table enters
DP_KINDS = frozenset({"dp_step", "dp_sync", "resume_barrier"})
DONE_OF_KIND = {
    "dp_step": RankEvent.DP_STEP_DONE,
    "dp_sync": RankEvent.DP_SYNC_DONE,
    "resume_barrier": RankEvent.RESUME_BARRIER_DONE,
    "weight_broadcast": RankEvent.WEIGHT_BROADCAST_DONE,
    "transfer_init": RankEvent.TRANSFER_INIT_DONE,
}
#: the ``phase`` argument of ``transfer_failed`` for each weight call
PHASE_OF = {
    RankEvent.INIT_TRANSFER: "init",
    RankEvent.START_UPDATE: "start",
    RankEvent.UPDATE_WEIGHTS: "update",
    RankEvent.FINISH_UPDATE: "finish",
}
DEFAULT_TIMEOUT_S = 300.0

#: per-rank front-end counts ``(waiting, running)``; ``(-1, -1)`` when not observable
Counts = tuple[int, int]
UNKNOWN: Counts = (-1, -1)


class VLLMCallError(RuntimeError):
    """``vllm serve`` answered a call with an error status (an ``AsyncLLM`` raises vLLM's own exception).

    Attributes:
        method: the vLLM call.
        detail: vLLM's error text.
    """

    def __init__(self, method: str, detail: str) -> None:
        self.method = method
        self.detail = detail
        super().__init__(f"vLLM {method} failed: {detail}")


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, PauseMode):
        return v.value
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return repr(v)


class VLLMAdapter:
    """The engine-client API of :class:`~weightsync.impl.checked.CheckedEngine` over a vLLM front-end, with
    the table transitions derived from what the controller observes (see the module docstring).

    Subclasses supply the vLLM calls (``_vllm_*``) and the observations (``_unfinished``, ``_is_paused``,
    ``get_weight_version``).

    Attributes:
        dp_size: DP engines behind the front-end (ranks of the table).
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
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = int(dp_size)
        self.variant = variant
        self.sync_interval = int(sync_interval)
        self.timeout_s = float(timeout_s)
        self.machines = [
            RankMachine(r, self.dp_size, variant, self.sync_interval) for r in range(self.dp_size)
        ]
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
        coll = next((e[len("enter_") :] for e in tr.effects if e.startswith("enter_")), "")
        rec = TransitionRecord(
            r,
            self.rank_seq[r],
            event.value,
            {k: _jsonable(v) for k, v in args.items()},
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

    def _refuse_if_failed(
        self, event: RankEvent, args: Sequence[dict[str, Any]], effects: list[tuple[str, ...]]
    ) -> None:
        if not any("refuse" in e for e in effects):
            return
        counts = [self._counts(u) for u in self._unfinished(self.timeout_s)]
        for r, e in enumerate(effects):
            if "refuse" in e:
                self._fire(r, event, dict(args[r]), counts[r])
        failed = [r for r, e in enumerate(effects) if "refuse" in e]
        raise LocalProtocolError(
            f"rank(s) {', '.join(map(str, failed))}: {event.value} refused in state failed (a weight-transfer "
            "round failed; the weights may be partial and are not served); recover with a new round: "
            "start_weight_update -> update_weights -> finish_weight_update (not sent to vLLM)"
        )

    def _lose(self, why: str) -> None:
        self.lost = why

    def _lockstep(self, target: RankState, counts: list[Counts]) -> None:
        """Inferred steps and collective completions, every rank in lockstep, until every rank is in
        ``target`` outside any collective."""
        for _ in range(2 * self.sync_interval + 4):
            if all(m.state is target and not m.vars.collective for m in self.machines):
                return
            kinds = set()
            for r, m in enumerate(self.machines):
                if not m.vars.collective:
                    work = self._has_work(m, counts[r])
                    kinds.add(self._fire(r, RankEvent.STEP, {"has_work": work}, counts[r]).collective)
                else:
                    kinds.add(m.vars.collective)
            if len(kinds) != 1 or "" in kinds or kinds.pop() not in DP_KINDS:
                break
            kind = self.machines[0].vars.collective
            outcome = self._outcome(kind, counts)
            for r, m in enumerate(self.machines):
                args = {"has_work": self._has_work(m, counts[r]), **outcome}
                if kind == "resume_barrier":
                    args = dict(outcome)
                self._fire(r, DONE_OF_KIND[kind], args, counts[r])
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

    def _outcome(self, kind: str, counts: list[Counts]) -> dict[str, int]:
        """The all-reduce outcome of ``kind`` from the members' states and counts (the table's arithmetic)."""
        unfinished = [
            0 if c[0] < 0 else unfinished_for_sync(PauseState(m.vars.pause_state), c[0], c[1])
            for m, c in zip(self.machines, counts, strict=True)
        ]
        if kind == "dp_sync":
            return {
                "sum_unfinished": sum(unfinished),
                "sum_pending_pause": sum(1 for m in self.machines if m.vars.pending_pause),
            }
        if kind == "resume_barrier":
            return {
                "max_unfinished": max(unfinished),
                "max_wave": max(m.vars.current_wave for m in self.machines),
            }
        return {}

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
            probe = [{"mode": m, "clear_cache": bool(clear_cache), "running": 0}] * self.dp_size
            effects = self._preflight(RankEvent.PAUSE, probe)
            self._refuse_if_failed(RankEvent.PAUSE, probe, effects)
            try:
                before, after = self._vllm_pause(m.value, bool(clear_cache), t)
                paused = self._is_paused(t)
            except BaseException as exc:
                self._lose(f"pause_generation raised {type(exc).__name__}: {exc}")
                raise RemoteProtocolError(f"vLLM's {self.lost}") from exc
            if not paused:
                self._lose("pause_generation returned but is_paused() is False")
                raise RemoteProtocolError(f"vLLM's {self.lost}")
            self._held_running = m is PauseMode.KEEP
            for r in range(self.dp_size):
                c = self._counts(before[r])
                args = {"mode": m, "clear_cache": bool(clear_cache), "running": max(0, before[r])}
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
            self._refuse_if_failed(RankEvent.RESUME, probe, effects)
            if not any("enter_resume_barrier" in e for e in effects):
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
        done: RankEvent | None,
        done_args: dict[str, Any],
    ) -> None:
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            probe: list[dict[str, Any]] = [{}] * self.dp_size
            effects = self._preflight(event, probe)
            self._refuse_if_failed(event, probe, effects)
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
                    err = {"phase": PHASE_OF[event], "error": f"{type(exc).__name__}: {exc}"}
                    self._fire(r, RankEvent.TRANSFER_FAILED, err, counts[r])
            raise
        with self._lock:
            for r in range(self.dp_size):
                self._fire(r, event, {}, counts[r])
            if done is not None:
                for r in range(self.dp_size):
                    self._fire(r, done, dict(done_args), counts[r])

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """vLLM's ``init_weight_transfer_engine(WeightTransferInitRequest(init_info))``.

        Raises:
            LocalProtocolError: illegal on some rank (vLLM not called).
            VLLMCallError or vLLM's exception: the engines failed (recorded as ``transfer_failed``).
        """
        self._weight_call(RankEvent.INIT_TRANSFER, init_info, timeout, RankEvent.TRANSFER_INIT_DONE, {})

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        """vLLM's ``start_weight_update()`` (checkpoint format: vLLM 0.32 has no other).

        Raises:
            LocalProtocolError: illegal on some rank, e.g. a second start (vLLM not called).
        """
        self._weight_call(RankEvent.START_UPDATE, None, timeout, None, {})

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """vLLM's ``update_weights(WeightTransferUpdateRequest(update_info))`` (a dict, or a list indexed by
        global worker rank).

        Raises:
            LocalProtocolError: illegal on some rank, e.g. while serving (vLLM not called).
        """
        self._weight_call(RankEvent.UPDATE_WEIGHTS, update_info, timeout, RankEvent.WEIGHT_BROADCAST_DONE, {})

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
        done_args = {"weight_version": weight_version, "monotonic": False}
        self._weight_call(RankEvent.FINISH_UPDATE, weight_version, timeout, RankEvent.FINISH_DONE, done_args)
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


# ====================================================================================== AsyncLLM


class AsyncLLMAdapter(VLLMAdapter):
    """:class:`VLLMAdapter` over an in-process ``vllm.v1.engine.async_llm.AsyncLLM`` that runs on ``loop``
    (another thread; the calls here block until vLLM's coroutine finished, at most the timeout).

    Calls (``v1/engine/async_llm.py``): ``pause_generation(mode=, clear_cache=)``, ``resume_generation()``,
    ``is_paused()``, ``init_weight_transfer_engine(WeightTransferInitRequest)``, ``start_weight_update()``,
    ``update_weights(WeightTransferUpdateRequest)``, ``finish_weight_update(weight_version=)``,
    ``get_weight_version()``. Unfinished counts: the output processor's (one engine) or the DP client's
    ``reqs_in_flight`` per engine identity (several), read on the loop in the same task as the pause.

    Raises:
        ValueError: the engine is paused (rule 4).
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, **kw: Any) -> None:
        self.llm = llm
        self.loop = loop
        self.timeout_s = float(kw.get("timeout_s", DEFAULT_TIMEOUT_S))
        dp = int(llm.vllm_config.parallel_config.data_parallel_size)
        if self._run(llm.is_paused(), self.timeout_s):
            raise ValueError(
                "AsyncLLMAdapter attaches to a serving engine; this one is paused (resume it first)"
            )
        super().__init__(dp, str(self._run(llm.get_weight_version(), self.timeout_s)), **kw)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError(
                "AsyncLLMAdapter calls block; call them from a thread other than the engine's loop"
            )
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def _count_now(self) -> list[int]:
        core = self.llm.engine_core
        inflight = getattr(core, "reqs_in_flight", None)
        if self.dp_size == 1:
            return [int(self.llm.output_processor.get_num_unfinished_requests())]
        if isinstance(inflight, dict):
            out = [0] * self.dp_size
            for ident in inflight.values():
                r = int.from_bytes(bytes(ident), "little")
                if 0 <= r < self.dp_size:
                    out[r] += 1
            return out
        return [-1] * self.dp_size

    def _vllm_pause(self, mode: str, clear_cache: bool, timeout: float) -> tuple[list[int], list[int]]:
        async def go() -> tuple[list[int], list[int]]:
            before = self._count_now()
            await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)
            return before, self._count_now()

        return self._run(go(), timeout)

    def _vllm_resume(self, timeout: float) -> None:
        self._run(self.llm.resume_generation(), timeout)

    def _unfinished(self, timeout: float) -> list[int]:
        async def go() -> list[int]:
            return self._count_now()

        return self._run(go(), timeout)

    def _is_paused(self, timeout: float) -> bool:
        return bool(self._run(self.llm.is_paused(), timeout))

    def get_weight_version(self) -> str:
        return str(self._run(self.llm.get_weight_version(), self.timeout_s))

    def get_weight_versions(self) -> list[str]:
        """Each DP engine's version (vLLM's ``call_utility_all_async("get_weight_version")``, in engine
        order; one entry for a single engine)."""
        core = self.llm.engine_core
        if not hasattr(core, "call_utility_all_async"):
            return [self.get_weight_version()]
        return [str(v) for v in self._run(core.call_utility_all_async("get_weight_version"), self.timeout_s)]

    def _vllm_relabel(self, new_version: str, timeout: float) -> None:
        self._run(self.llm.update_weight_version(new_version), timeout)

    def _vllm_call(self, event: RankEvent, payload: Any, timeout: float) -> None:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        llm = self.llm
        if event is RankEvent.INIT_TRANSFER:
            self._run(llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payload)), timeout)
        elif event is RankEvent.START_UPDATE:
            self._run(llm.start_weight_update(), timeout)
        elif event is RankEvent.UPDATE_WEIGHTS:
            self._run(llm.update_weights(WeightTransferUpdateRequest(update_info=payload)), timeout)
        elif event is RankEvent.FINISH_UPDATE:
            self._run(llm.finish_weight_update(weight_version=payload), timeout)
        else:  # pragma: no cover - internal
            raise AssertionError(event)


# ====================================================================================== HTTP


class HTTPServerAdapter(VLLMAdapter):
    """:class:`VLLMAdapter` over the HTTP routes of ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``
    (``entrypoints/rl/online/api_router.py``): ``POST /pause?mode=&clear_cache=``, ``POST /resume``,
    ``GET /is_paused``, ``POST /init_weight_transfer_engine {"init_info"}``, ``POST /start_weight_update``,
    ``POST /update_weights {"update_info"}``, ``POST /finish_weight_update {"weight_version"}``,
    ``POST /update_weight_version {"new_version"}``, ``GET /weight_info``; ``GET /get_world_size`` with and without DP gives ``dp_size``.

    The server reports no request counts per engine, so every record's counts are -1 (unknown) and the
    outcome arguments are inferred from the returned calls alone (a returned pause: nothing schedulable).

    Raises:
        ValueError: the server is paused (rule 4).
        VLLMCallError: a route answered with an error status.
    """

    def __init__(self, base_url: str, **kw: Any) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(kw.get("timeout_s", DEFAULT_TIMEOUT_S))
        with_dp = int(
            self._request("GET", "/get_world_size?include_dp=true", None, self.timeout_s)["world_size"]
        )
        without = int(
            self._request("GET", "/get_world_size?include_dp=false", None, self.timeout_s)["world_size"]
        )
        if self._is_paused(self.timeout_s):
            raise ValueError(
                "HTTPServerAdapter attaches to a serving engine; this one is paused (POST /resume)"
            )
        super().__init__(max(1, with_dp // max(1, without)), self.get_weight_version(), **kw)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise VLLMCallError(
                path.split("?")[0].lstrip("/"), f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            if "timed out" in str(exc):
                raise TimeoutError(f"{method} {path}: {exc}") from exc
            raise
        return json.loads(raw) if raw else None

    def _vllm_pause(self, mode: str, clear_cache: bool, timeout: float) -> tuple[list[int], list[int]]:
        q = urllib.parse.urlencode({"mode": mode, "clear_cache": str(bool(clear_cache)).lower()})
        self._request("POST", f"/pause?{q}", None, timeout)
        return [-1] * self.dp_size, [-1] * self.dp_size

    def _vllm_resume(self, timeout: float) -> None:
        self._request("POST", "/resume", None, timeout)

    def _unfinished(self, timeout: float) -> list[int]:
        return [-1] * self.dp_size

    def _is_paused(self, timeout: float) -> bool:
        return bool(self._request("GET", "/is_paused", None, timeout)["is_paused"])

    def get_weight_version(self) -> str:
        return str(self._request("GET", "/weight_info", None, self.timeout_s)["weight_version"])

    def _vllm_relabel(self, new_version: str, timeout: float) -> None:
        self._request("POST", "/update_weight_version", {"new_version": new_version}, timeout)

    def _vllm_call(self, event: RankEvent, payload: Any, timeout: float) -> None:
        if event is RankEvent.INIT_TRANSFER:
            self._request("POST", "/init_weight_transfer_engine", {"init_info": payload}, timeout)
        elif event is RankEvent.START_UPDATE:
            self._request("POST", "/start_weight_update", None, timeout)
        elif event is RankEvent.UPDATE_WEIGHTS:
            self._request("POST", "/update_weights", {"update_info": payload}, timeout)
        elif event is RankEvent.FINISH_UPDATE:
            self._request("POST", "/finish_weight_update", {"weight_version": payload}, timeout)
        else:  # pragma: no cover - internal
            raise AssertionError(event)


# ====================================================================================== glue


def checked_async_llm(
    llm: Any, loop: asyncio.AbstractEventLoop, trace_path: str | Path | None = None, **kw: Any
) -> CheckedEngine:
    """A :class:`~weightsync.impl.checked.CheckedEngine` around an :class:`AsyncLLMAdapter` of ``llm``
    (``kw``: ``variant``, ``sync_interval``, ``timeout_s``); ``trace_path``: the JSONL trace that
    ``weightsync replay`` validates."""
    return CheckedEngine(AsyncLLMAdapter(llm, loop, **kw), trace_path=trace_path)


def checked_http(base_url: str, trace_path: str | Path | None = None, **kw: Any) -> CheckedEngine:
    """A :class:`~weightsync.impl.checked.CheckedEngine` around an :class:`HTTPServerAdapter` of a
    ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1``."""
    return CheckedEngine(HTTPServerAdapter(base_url, **kw), trace_path=trace_path)


__all__ = [
    "AsyncLLMAdapter",
    "HTTPServerAdapter",
    "VLLMAdapter",
    "VLLMCallError",
    "checked_async_llm",
    "checked_http",
]
