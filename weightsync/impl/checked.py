"""Runtime-checked engine wrapper and trace validation.

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
  the trace gets a ``kind="relabel"`` line, which :func:`replay_trace` applies the same way.
- The weight calls are vLLM 0.32's (``init_weight_transfer_engine(dict)``, ``start_weight_update()``,
  ``update_weights(dict | list)``, ``finish_weight_update(weight_version)``) with a keyword-only
  ``timeout``: a CheckedEngine is a vLLM ``VLLMWeightSyncClient``, so a trainer built with
  ``trainer_init(..., client=<checked engine>)`` goes through the checks.

:func:`replay_trace` validates a recorded trace: every step re-fired on the rank tables must reproduce the
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.spec.collectives import DP_KINDS, KIND_OF_DONE
from weightsync.spec.controller import CALL_EVENT
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.rank import RankMachine, RankVars, apply, get_variant, relabel_weight_version, select
from weightsync.spec.states import PauseMode, PauseState, RankEvent, RankState

#: the DP collectives' completion events -> their kinds (spec/collectives.py)
_DONE_OF = {ev: kind for ev, kind in KIND_OF_DONE.items() if kind in DP_KINDS}
_DP_KINDS = DP_KINDS


def vars_to_dict(v: RankVars) -> dict[str, Any]:
    """RankVars as a JSON-able dict (enum values), the format of trace records."""
    out: dict[str, Any] = {}
    for k, x in v._asdict().items():
        out[k] = x.value if isinstance(x, RankState | PauseState) else x
    return out


def dict_to_vars(d: dict[str, Any]) -> RankVars:
    """The inverse of :func:`vars_to_dict`."""
    v = RankVars(**{k: d[k] for k in RankVars._fields if k in d})
    return v._replace(state=RankState(v.state), pause_state=PauseState(v.pause_state))


def _header(
    variant: str, dp_size: int, sync_interval: int, init: list[dict[str, Any]] | None
) -> dict[str, Any]:
    return {
        "kind": "header",
        "variant": variant,
        "dp_size": dp_size,
        "sync_interval": sync_interval,
        "init": init,
        "t": time.time(),
    }


class CheckedEngine:
    """See the module docstring.

    Args:
        engine: the wrapped engine client. It must expose ``dp_size``; ``variant`` (a Variant or name) and
            ``sync_interval`` are read from it unless given; ``add_transition_listener`` feeds the shadows.
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
        self.machines = [
            RankMachine(r, self.dp_size, self.variant_name, self.sync_interval) for r in range(self.dp_size)
        ]
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
                with self.trace_path.open("a", encoding="utf-8") as f:
                    hdr = _header(self.variant_name, self.dp_size, self.sync_interval, init)
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
                full = {"rank": r, "dp_size": self.dp_size, "sync_interval": self.sync_interval}
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
                        f"rank {r}: {event.value} is illegal in state {v.state.value}{extra} "
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
        self._call(
            RankEvent.PAUSE,
            lambda: self.engine.pause(m.value, clear_cache, timeout),
            mode=m,
            clear_cache=clear_cache,
            running=0,
        )

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


_CALLS = {str(e.value) for e in CALL_EVENT.values()}  # the controller calls (spec/controller.py)


# =============================================================================== replay


@dataclass
class Divergence:
    """The first step of a trace that is not an edge of the model.

    Attributes:
        line: 1-based line number in the trace file.
        step: 0-based index of the transition among the trace's transitions.
        rank: the rank of the offending step.
        event: its event.
        reason: why it is not an edge.
        state: the rank's variables (model state) before the step.
        legal: the events legal there (by the table).
    """

    line: int
    step: int
    rank: int
    event: str
    reason: str
    state: dict[str, Any]
    legal: list[str]

    def describe(self) -> str:
        """One human-readable line."""
        return (
            f"step {self.step} (line {self.line}): rank {self.rank} {self.event}: {self.reason}; "
            f"state {self.state.get('state')} {self.state}; legal events there: {', '.join(self.legal)}"
        )


@dataclass
class ReplayResult:
    """Outcome of :func:`replay_trace`.

    Attributes:
        path: the trace file.
        ok: every step was an edge.
        steps: records checked (transitions and relabels).
        ranks: number of ranks.
        variant: the variant in the header.
        divergence: the first bad step, if any.
        collectives: DP collective entries checked.
        notes: what could not be checked.
        relabels: ``update_weight_version`` records applied (``kind="relabel"``; no transition).
    """

    path: str
    ok: bool
    steps: int
    ranks: int
    variant: str
    divergence: Divergence | None = None
    collectives: int = 0
    notes: list[str] = field(default_factory=list)
    relabels: int = 0


def _replay_relabel(rec: dict[str, Any], machines: list[RankMachine]) -> str | None:
    """Apply one ``kind="relabel"`` record (:func:`~weightsync.spec.rank.relabel_weight_version`) to its
    rank; why it does not replay, or None."""
    r = rec.get("rank")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(machines):
        return f"relabel record with rank {r!r} outside [0, {len(machines)})"
    m = machines[r]
    if "vars_before" in rec and dict(rec["vars_before"]) != vars_to_dict(m.vars):
        return f"recorded state {rec['vars_before']} differs"
    try:
        m.vars = relabel_weight_version(m.vars, rec.get("weight_version"))  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    if "vars_after" in rec and dict(rec["vars_after"]) != vars_to_dict(m.vars):
        return f"the spec gives {vars_to_dict(m.vars)}, trace says {rec['vars_after']}"
    return None


#: ``validate(step_index, record, machines) -> reason or None``: an extra per-step check (the model's).
StepValidator = Callable[[int, dict[str, Any], list[RankMachine]], str | None]


def _observed_differs(observed: Any, v: RankVars, when: str) -> str:
    """Why the engine's reported variables ``observed`` (a partial :func:`vars_to_dict`) differ from the
    table's ``v`` (``""`` when they agree or nothing was reported)."""
    if not observed:
        return ""
    table = vars_to_dict(v)
    bad = {k: (x, table.get(k, "<no such variable>")) for k, x in dict(observed).items() if table.get(k) != x}
    if not bad:
        return ""
    shown = ", ".join(f"{k}: engine {g!r}, table {w!r}" for k, (g, w) in sorted(bad.items()))
    return f"the engine reported {when} the event {shown}"


def replay_trace(
    path: str | Path, validate: StepValidator | None = None, variant: str | None = None
) -> ReplayResult:
    """Validate one JSONL trace (see the module docstring). Ranks interleave in file order.

    ``variant``: replay against this variant's table instead of the header's. A record may carry
    ``observed_before`` / ``observed``: some of the rank's variables as the engine itself reported them
    before / after the event (a real vLLM engine, :mod:`weightsync.vllm_tools.trace`); each must equal the
    table's value there, field by field.

    Raises:
        ValueError: the file has no header line or a line is not JSON (input error, not a divergence).
    """
    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    recs: list[tuple[int, dict[str, Any]]] = []
    header: dict[str, Any] | None = None
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{i}: not JSON: {exc}") from exc
        if obj.get("kind") == "header":
            if header is None:
                header = obj
            continue
        recs.append((i, obj))
    if header is None:
        raise ValueError(f"{p}: no header line (kind=header with variant, dp_size, sync_interval)")
    variant = str(header["variant"]) if variant is None else variant
    n = int(header["dp_size"])
    k = int(header["sync_interval"])
    table = get_variant(variant).table
    machines = [RankMachine(r, n, variant, k) for r in range(n)]
    for m, init in zip(machines, header.get("init") or [], strict=False):
        m.vars = dict_to_vars(init)
    entered: list[dict[int, str]] = [{} for _ in range(n)]  # rank -> {coll_seq: kind}
    res = ReplayResult(str(p), True, 0, n, variant)

    def diverge(line: int, step: int, rank: int, event: str, reason: str, v: RankVars) -> ReplayResult:
        legal = sorted({e.value for (s, e) in table if s == v.state})
        res.ok = False
        res.divergence = Divergence(line, step, rank, event, reason, vars_to_dict(v), legal)
        return res

    prepare = getattr(validate, "prepare", None)
    if callable(prepare):  # a validator that looks ahead (the model's, for the members' entry counts)
        prepare([rec for _, rec in recs])
    for step, (line, rec) in enumerate(recs):
        res.steps = step + 1
        if rec.get("kind") == "relabel":  # update_weight_version: no transition (spec relabel_weight_version)
            why = _replay_relabel(rec, machines)
            if why is not None:
                r = rec.get("rank")
                state = machines[r].vars if isinstance(r, int) and 0 <= r < n else RankVars()
                return diverge(line, step, r if isinstance(r, int) else -1, "relabel", why, state)
            res.relabels += 1
            continue
        try:
            r = int(rec["rank"])
            event = RankEvent(rec["event"])
            args = dict(rec.get("args", {}))
        except (KeyError, ValueError) as exc:
            return diverge(line, step, -1, str(rec.get("event")), f"malformed record: {exc}", RankVars())
        if not 0 <= r < n:
            return diverge(line, step, r, event.value, f"rank {r} outside [0, {n})", RankVars())
        m = machines[r]
        before = m.vars
        if "vars_before" in rec and dict(rec["vars_before"]) != vars_to_dict(before):
            return diverge(line, step, r, event.value, f"recorded state {rec['vars_before']} differs", before)
        differs = _observed_differs(rec.get("observed_before"), before, "before")
        if differs:
            return diverge(line, step, r, event.value, differs, before)
        kind = _DONE_OF.get(event.value)
        if kind is not None:
            seq = int(rec.get("coll_seq", 0)) - 1  # the DONE record carries the next sequence number
            for q in range(n):
                if entered[q].get(seq) != kind:
                    what = entered[q].get(seq, "nothing")
                    return diverge(
                        line,
                        step,
                        r,
                        event.value,
                        f"{kind}#{seq} completed while rank {q} had entered {what} at #{seq} "
                        "(collective not matched by every rank)",
                        before,
                    )
        tr = select(table, before, event, {"rank": r, "dp_size": n, "sync_interval": k, **args})
        if tr is None:
            return diverge(line, step, r, event.value, "no transition of the table (illegal here)", before)
        if validate is not None:
            why = validate(step, rec, machines)
            if why:
                return diverge(line, step, r, event.value, why, before)
        m.fire(event, **args)
        if "vars_after" in rec and dict(rec["vars_after"]) != vars_to_dict(m.vars):
            return diverge(
                line,
                step,
                r,
                event.value,
                f"table gives {vars_to_dict(m.vars)}, trace says {rec['vars_after']}",
                before,
            )
        differs = _observed_differs(rec.get("observed"), m.vars, "after")
        if differs:
            return diverge(line, step, r, event.value, differs, before)
        coll = str(rec.get("collective", ""))
        if coll and rec.get("observed_before") is not None and coll != m.vars.collective:  # engine-reported
            differs = f"the engine entered {coll}, the table {m.vars.collective or 'no collective'}"
            return diverge(line, step, r, event.value, differs, before)
        if coll in _DP_KINDS:
            entered[r][int(rec.get("coll_seq", 0))] = coll
            res.collectives += 1
    return res
