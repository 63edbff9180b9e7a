"""The runtime-checked engine wrapper (the offline trace validation is :mod:`weightsync.impl.trace_replay`).

:class:`CheckedEngine` wraps any object with the engine-client methods (``pause``, ``resume``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
``add_request``...) -- our :class:`~weightsync.impl.engine.client.DPEngineClient`, or later a real vLLM
``AsyncLLM`` adapter -- and checks every call against the spec table of every rank:

- It keeps one shadow :class:`~weightsync.spec.rank.RankMachine` per rank, fed with the transitions the
  engine reports (``add_transition_listener``); each reported transition is re-fired on the shadow and its
  resulting variables must equal the reported ones (else :class:`~weightsync.spec.errors.RemoteProtocolError`
  is raised at the next call, and recorded in :attr:`CheckedEngine.violations`).
- A call is legal only if, on every rank, the event is legal in the shadow state *after* the calls still in
  flight to that rank (sent but not yet reported as fired). An illegal call -- ``update_weights`` while
  running, ``start_weight_update`` twice, ``resume`` while a pause is still in flight -- raises
  :class:`~weightsync.spec.errors.LocalProtocolError` before the wrapped engine sees it.
- With ``trace_path``, one JSONL line per transition goes to a single append-only file: a header line, then
  (rank, rank_seq, state before, event, state after, wave, collective kind/seq, time). If the engine can
  write the lines itself (``trace_to``; our engines append with O_APPEND before running the transition's
  effects), file order is a linearization of the run; otherwise the wrapper writes them as reported.
- ``update_weight_version`` (vLLM 0.32: a label, any state) is no transition: the engine reports a
  :class:`~weightsync.impl.engine.messages.RelabelRecord`, the shadow applies
  :func:`~weightsync.spec.rank.relabel_weight_version` (its variables must equal the reported ones) and
  the trace gets a ``kind="relabel"`` line, which :func:`~weightsync.impl.trace_replay.replay_trace` applies the same way.
- The weight calls are vLLM 0.32's (``init_weight_transfer_engine(dict)``, ``start_weight_update()``,
  ``update_weights(dict | list)``, ``finish_weight_update(weight_version)``) with a keyword-only
  ``timeout``: a CheckedEngine is a vLLM ``VLLMWeightSyncClient``, so a trainer built with
  ``trainer_init(..., client=<checked engine>)`` goes through the checks.

:func:`~weightsync.impl.trace_replay.replay_trace` validates a recorded trace: every step re-fired on the rank tables must reproduce the
recorded variables, and DP collectives must rendezvous (every rank enters the same (kind, seq) before any
rank completes it). An optional ``validate`` callback (``weightsync replay`` passes the model checker's)
checks each step against the model's composition of the ranks too (``weightsync replay`` passes
:class:`weightsync.model.replay.TraceChecker`: collective outcomes from the members' entry states, blocked
ranks, scheduler arguments); a validator with a ``prepare(records)`` method gets every record first. The
first divergence is reported with the state and the legal events there.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from weightsync.impl.trace_replay import _CALLS, dict_to_vars, vars_to_dict
from weightsync.spec.calls import call_args
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.rank import (
    RankMachine,
    RankVars,
    apply,
    get_variant,
    rank_machines,
    relabel_weight_version,
    select,
)
from weightsync.spec.states import PauseMode, RankEvent


def _header(
    variant: str, dp_size: int, sync_interval: int, init: list[dict[str, Any]] | None, lockstep: bool
) -> dict[str, Any]:
    return {
        "kind": "header",
        "variant": variant,
        "dp_size": dp_size,
        "lockstep": lockstep,
        "sync_interval": sync_interval,
        "init": init,
        "t": time.time(),
    }


class CheckedEngine:
    """See the module docstring.

    Args:
        engine: the wrapped engine client. It must expose ``dp_size``; ``variant`` (a Variant or name) and
            ``sync_interval`` are read from it unless given, and ``lockstep`` (default True: its engines are
            one DP world; False: each is a world of one, :func:`~weightsync.spec.rank.rank_machines`);
            ``add_transition_listener`` feeds the shadows.
        trace_path: JSONL file to append the trace to (None: no trace).
        variant, dp_size, sync_interval: override what the engine reports.

    Raises:
        LocalProtocolError: from any call that is illegal on some rank (the engine is not called).
        RemoteProtocolError: a reported transition disagreed with the table (raised at the next call).
    """

    def __init__(
        self,
        engine: Any,
        trace_path: str | Path | None = None,
        variant: str | None = None,
        dp_size: int | None = None,
        sync_interval: int | None = None,
    ) -> None:
        self.engine = engine
        v = variant if variant is not None else getattr(engine, "variant", "two-phase-epoch")
        self.variant_name: str = v if isinstance(v, str) else str(v.name)
        self.dp_size = int(dp_size if dp_size is not None else engine.dp_size)
        self.sync_interval = int(sync_interval if sync_interval is not None else engine.sync_interval)
        self._table = get_variant(self.variant_name).table
        self.lockstep = bool(getattr(engine, "lockstep", True))
        self.machines = rank_machines(
            self.dp_size, self.variant_name, self.sync_interval, lockstep=self.lockstep
        )
        self._inflight: list[deque[tuple[RankEvent, dict[str, Any]]]] = [deque() for _ in self.machines]
        self._lock = threading.RLock()
        self.violations: list[str] = []
        self.records = 0
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self._engine_writes = False
        # Attach: buffer reports, take each rank's snapshot (vars + transitions so far), start from it.
        self._skip_below: list[int] | None = None
        self._buffer: list[Any] = []
        init: list[dict[str, Any]] | None = None
        self._attaching = True
        if hasattr(engine, "add_transition_listener"):
            engine.add_transition_listener(self._on_transition)
        snaps = engine.snapshot() if hasattr(engine, "snapshot") else None  # not under our lock
        with self._lock:
            if snaps is not None:
                init = [dict(s["vars"]) for s in snaps]
                for m, sn in zip(self.machines, snaps, strict=True):
                    m.vars = dict_to_vars(sn["vars"])
                self._skip_below = [int(s["rank_seq"]) for s in snaps]
            self._attaching = False
            buffered, self._buffer = self._buffer, []
            for rec in buffered:
                self._on_transition(rec)
            if self.trace_path is not None:
                self.trace_path.parent.mkdir(parents=True, exist_ok=True)  # e.g. traces/ in another cwd
                with self.trace_path.open("a", encoding="utf-8") as f:
                    hdr = _header(self.variant_name, self.dp_size, self.sync_interval, init, self.lockstep)
                    f.write(json.dumps(hdr) + "\n")
        if self.trace_path is not None and hasattr(engine, "trace_to"):
            engine.trace_to(str(self.trace_path))
            self._engine_writes = True

    # ------------------------------------------------------------------ shadow machines
    def _on_transition(self, rec: Any) -> None:
        r = int(rec.rank)
        with self._lock:
            if self._attaching:
                self._buffer.append(rec)
                return
            if self._skip_below is not None and int(rec.rank_seq) < self._skip_below[r]:
                return  # already reflected in the snapshot the shadow started from
            m = self.machines[r]
            if not hasattr(rec, "event"):  # a RelabelRecord: update_weight_version, no transition
                label = f"relabel {rec.weight_version!r}"
                if self._follow(m, rec, label, lambda: relabel_weight_version(m.vars, rec.weight_version)):
                    self._record(rec)
                return
            event = RankEvent(rec.event)
            if not self._follow(m, rec, str(rec.event), lambda: m.fire(event, **dict(rec.args)).after):
                return
            infl = self._inflight[r]
            for i, (e, _) in enumerate(infl):
                if e is event:
                    del infl[i]
                    break
            self._record(rec)

    def _follow(self, m: RankMachine, rec: Any, what: str, step: Callable[[], RankVars]) -> bool:
        """Apply one reported record to the shadow ``m`` (``step`` returns its variables afterwards); a
        refusal or a disagreement with the reported variables is a violation. False when it was refused."""
        try:
            m.vars = step()
        except Exception as exc:
            self.violations.append(f"rank {rec.rank} step {rec.rank_seq} ({what}): {exc}")
            return False
        got = vars_to_dict(m.vars)
        if got != dict(rec.after):
            self.violations.append(
                f"rank {rec.rank} step {rec.rank_seq} ({what}): table gives {got}, engine reported {rec.after}"
            )
        return True

    def _record(self, rec: Any) -> None:
        self.records += 1
        if self.trace_path is not None and not self._engine_writes:
            from weightsync.impl.engine.records import record_line

            with self.trace_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record_line(rec), sort_keys=True) + "\n")

    def _check(self, event: RankEvent, ranks: Iterable[int] | None = None, **args: Any) -> None:
        with self._lock:
            if self.violations:
                raise RemoteProtocolError("engine diverged from the table: " + self.violations[0])
            targets = list(range(self.dp_size)) if ranks is None else list(ranks)
            for r in targets:
                m = self.machines[r]
                v: RankVars = m.vars
                full = {"rank": m.rank, "dp_size": m.dp_size, "sync_interval": self.sync_interval}
                pending = []
                for e, a in self._inflight[r]:
                    tr = select(self._table, v, e, {**full, **a})
                    if tr is not None:
                        v = apply(v, tr, {**full, **a})
                    pending.append(e.value)
                tr = select(self._table, v, event, {**full, **args})
                if tr is None:
                    legal = sorted({e.value for (s, e) in self._table if s == v.state and e.value in _CALLS})
                    extra = f" after in-flight call(s) {', '.join(pending)}" if pending else ""
                    raise LocalProtocolError(
                        f"{m.name}: {event.value} is illegal in state {v.state.value}{extra} "
                        f"(variant {self.variant_name}); legal calls there: {', '.join(legal) or 'none'}"
                    )
            for r in targets:
                self._inflight[r].append((event, dict(args)))

    def _done(self, event: RankEvent, ranks: Iterable[int] | None = None) -> None:
        """Drop an in-flight call that failed on the engine side (it will never be reported)."""
        with self._lock:
            for r in list(range(self.dp_size)) if ranks is None else ranks:
                infl = self._inflight[r]
                for i, (e, _) in enumerate(infl):
                    if e is event:
                        del infl[i]
                        break

    def _call(self, event: RankEvent, fn: Callable[[], Any], **args: Any) -> Any:
        self._check(event, **args)
        try:
            return fn()
        except BaseException:
            self._done(event)
            raise

    # ------------------------------------------------------------------ the engine-client API
    def pause(
        self, mode: str | PauseMode = "abort", clear_cache: bool = True, timeout: float | None = None
    ) -> None:
        """Checked ``pause`` (fan-out to every rank)."""
        m = PauseMode(mode)
        # the table's arguments (spec/calls.py call_args); the client does not see the ranks' queues, and
        # a pause's legality does not depend on them (its row does: the engine reports the one it took)
        args = call_args(RankEvent.PAUSE, {"mode": m.value, "clear_cache": clear_cache}, 0, 0)
        self._call(RankEvent.PAUSE, lambda: self.engine.pause(m.value, clear_cache, timeout), **args)

    def resume(self, timeout: float | None = None) -> None:
        """Checked ``resume`` (illegal while a pause is in flight, in two-phase variants)."""
        self._call(RankEvent.RESUME, lambda: self.engine.resume(timeout))

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """Checked ``init_weight_transfer_engine``."""
        self._call(
            RankEvent.INIT_TRANSFER,
            lambda: self.engine.init_weight_transfer_engine(init_info, timeout=timeout),
        )

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        """Checked ``start_weight_update`` (legal only when every rank is verified, or failed)."""
        self._call(RankEvent.START_UPDATE, lambda: self.engine.start_weight_update(timeout=timeout))

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """Checked ``update_weights`` (legal only between start and finish)."""
        self._call(RankEvent.UPDATE_WEIGHTS, lambda: self.engine.update_weights(update_info, timeout=timeout))

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        """Checked ``finish_weight_update`` (``weight_version``, ``monotonic``: see the engine client)."""
        self._call(
            RankEvent.FINISH_UPDATE,
            lambda: self.engine.finish_weight_update(weight_version, monotonic=monotonic, timeout=timeout),
        )

    def update_weight_version(self, new_version: str, *, timeout: float | None = None) -> None:
        """``update_weight_version``: legal in every state (no transition); refused only once the engine
        diverged from the table. The shadows apply it when the engine reports it.

        Raises:
            RemoteProtocolError: the engine diverged earlier.
        """
        with self._lock:
            if self.violations:
                raise RemoteProtocolError("engine diverged from the table: " + self.violations[0])
        self.engine.update_weight_version(new_version, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        # add_request, abort, get_weight_version, ... pass through: ADD/ABORT are legal in every state
        # but error, and the shadow machines see them through the engine's reports.
        return getattr(self.engine, name)


# =============================================================================== replay
