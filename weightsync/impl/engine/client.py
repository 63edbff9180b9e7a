"""Front-end client of a DP engine cluster: launches the processes, routes requests, fans out calls.

:class:`DPEngineClient` plays vLLM's ``AsyncLLM`` + DP core client (reference sections 1 and 5):

- ``start()`` spawns one DP coordinator process and ``dp_size`` engine-core processes
  (``torch.multiprocessing`` spawn) and waits until every engine joined its DP group.
- ``add_request`` stamps the request with the front-end's ``current_wave``, sends ADD to one engine (round
  robin unless a rank is given) and, when it believes the engines idle, FIRST_REQ(exclude=that engine,
  wave) to the coordinator; it refreshes its (current_wave, engines_running) belief from coordinator stats.
  The returned :class:`RequestStream` collects token ids, log-probs and weight versions as they stream.
- ``pause / resume / init_weight_transfer_engine / start_weight_update / update_weights /
  finish_weight_update / update_weight_version`` fan out to every rank and return when all have answered; a
  rank that does not answer in time raises :class:`~weightsync.spec.errors.TransferTimeoutError` naming the
  missing ranks. The weight calls are vLLM 0.32's (``v1/engine/async_llm.py:1315-1363``) with the same
  request shapes (:mod:`weightsync.impl.transfer.base`), plus a keyword-only ``timeout``; so the client is a
  vLLM ``VLLMWeightSyncClient`` (:class:`~weightsync.impl.transfer.trainer.WeightSyncClient`) and a
  trainer built by ``trainer_init(..., client=<this client>)`` drives it as it drives vLLM. Versions are
  vLLM's strings (``"default"`` before any); :meth:`DPEngineClient.get_weight_version` is vLLM's consensus
  (:class:`WeightVersionMismatchError` when the ranks differ), :meth:`DPEngineClient.get_weight_versions`
  each rank's.
- Every transition the engines fire (and every relabel by ``update_weight_version``, a
  :class:`~weightsync.impl.engine.messages.RelabelRecord`) is delivered to listeners
  (``add_transition_listener``) in the order each engine reported it; the
  :class:`~weightsync.impl.checked.CheckedEngine` and the trace recorder use this.
- ``hold=True`` (``weightsync repro``) routes every message bound for an engine (front-end input,
  controller input and the coordinator's wave socket) into per-(rank, socket) holding FIFOs, and every
  message bound for the coordinator (FIRST_REQ: ``(-1, "coord")``; an engine's wave_complete / start_wave:
  ``(rank, "coord")``) too; a schedule then releases them one by one with :meth:`DPEngineClient.release`.
  The coordinator's stats are held as well (the front-end's belief changes only at :meth:`refresh`), and
  each engine gets a step gate (:meth:`DPEngineClient.set_step_gate`).
"""

from __future__ import annotations

import itertools
import operator
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import torch.multiprocessing as tmp

from weightsync.impl.engine.coordinator import run_coordinator
from weightsync.impl.engine.core import EngineConfig, EngineQueues, run_engine
from weightsync.impl.engine.messages import (
    AbortMsg,
    AddMsg,
    EngineFailure,
    FirstReq,
    RankRecord,
    RelabelRecord,
    Request,
    Shutdown,
    Stats,
    StepOutputs,
    TransitionRecord,
    UtilityCall,
    UtilityReply,
    request_error,
)
from weightsync.impl.models.sampling import SamplingParams
from weightsync.spec.controller import front_end_answers
from weightsync.spec.errors import (
    IncompleteUpdateError,
    LocalProtocolError,
    PeerFailedError,
    RemoteProtocolError,
    TransferTimeoutError,
    WeightSyncError,
    WireMismatchError,
)
from weightsync.spec.front_end import RANK_EFFECT_EVENT, FrontEvent, FrontVars, front_end_fire
from weightsync.spec.rank import get_variant, version_order
from weightsync.spec.states import PauseMode

SOCKETS = ("front", "control", "wave")
"""Engine input sockets: front-end input, controller input, coordinator wave socket."""
COORD = "coord"
"""Holding socket of coordinator-bound messages (rank -1: the front-end's FIRST_REQ)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RequestStream:
    """Token stream of one request (filled by the client's dispatcher thread).

    Attributes:
        req_id: the request id.
        rank: the engine serving it.
        prompt: the prompt token ids.
        tokens: generated token ids so far.
        logprobs: their float32 log-probabilities.
        versions: the engine weight version (vLLM's string label) that produced each token.
        finish_reason: None while running, then "length", "stop" or "abort"; "error" when the engine
            rejected the request (only for a request that bypassed :meth:`DPEngineClient.add_request`'s
            validation).
        error: with ``finish_reason="error"``, the engine's reason (``"ValueError: ... (rejected by engine
            rank R)"``); else None.
    """

    req_id: str
    rank: int
    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float = 60.0) -> RequestStream:
        """Block until the request finished (any reason); returns self.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self.done.wait(timeout):
            raise TimeoutError(
                f"request {self.req_id} on rank {self.rank} not finished after {timeout:.1f} s "
                f"({len(self.tokens)} tokens so far)"
            )
        return self


class EngineCallError(WeightSyncError):
    """A utility call failed on a rank for a reason without a more specific weightsync error type.

    Attributes:
        rank: the rank that answered with the error.
        method: the call.
        error_type: the remote exception's class name.
    """

    def __init__(self, rank: int, method: str, error_type: str, message: str) -> None:
        self.rank = rank
        self.method = method
        self.error_type = error_type
        super().__init__(f"rank {rank}: {method}: {message}")


class WeightVersionMismatchError(WeightSyncError, RuntimeError):
    """``get_weight_version()``: the ranks report different versions (vLLM's consensus raises
    ``RuntimeError``, ``v1/engine/core_client.py:1271-1277``; this is one too).

    Attributes:
        versions: each rank's version, in rank order.
    """

    def __init__(self, versions: list[str]) -> None:
        self.versions = list(versions)
        shown = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(self.versions))
        super().__init__(
            f"get_weight_version: the engines report different weight versions ({shown}); there is no "
            "consensus (get_weight_versions() lists them)"
        )


def _check_version(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise ValueError(
            f"{what} must be a str (vLLM 0.32's string weight versions), got {type(value).__name__} {value!r}"
        )


def _remote_error(rank: int, method: str, reply: UtilityReply, failure: EngineFailure | None) -> Exception:
    msg = f"rank {rank}: {method}: {reply.error}"
    et = reply.error_type or ""
    if et == "LocalProtocolError":
        return LocalProtocolError(msg)
    if et == "RemoteProtocolError":
        return RemoteProtocolError(msg)
    if et == "TransferTimeoutError":
        missing = failure.missing_ranks if failure else ()
        return TransferTimeoutError(failure.phase if failure else method, missing, 0.0, msg)
    if et == "IncompleteUpdateError":
        return IncompleteUpdateError([msg])
    if et == "PeerFailedError":
        return PeerFailedError([rank], method, str(reply.error))
    if et == "WireMismatchError":
        return WireMismatchError(msg)
    return EngineCallError(rank, method, et, str(reply.error))


class DPEngineClient:
    """Front-end + launcher of a DP engine cluster. See the module docstring.

    Args:
        cfg: cluster configuration (``cfg.model`` is required).
        hold: route every engine-bound message through holding FIFOs (repro mode).
        start_timeout_s: how long ``start`` waits for every engine to come up, seconds.
    """

    def __init__(self, cfg: EngineConfig, hold: bool = False, start_timeout_s: float = 90.0) -> None:
        if cfg.model is None:
            raise ValueError("EngineConfig.model is required")
        if cfg.dp_port == 0:
            cfg = replace(cfg, dp_port=free_port(cfg.host))
        self.cfg = cfg
        self.variant = get_variant(cfg.variant)
        self.dp_size = cfg.dp_size
        self.sync_interval = cfg.sync_interval
        self.hold = hold
        self.routed = hold  # the coordinator's wave socket goes through the client (holdable)
        self.start_timeout_s = start_timeout_s
        self._ctx = tmp.get_context("spawn")
        n = cfg.dp_size
        self.step_gates: list[Any] = [self._ctx.Value("i", -1) for _ in range(n)] if hold else []
        self.queues = [
            EngineQueues(
                self._ctx.Queue(),
                self._ctx.Queue(),
                self._ctx.Queue(),
                self._ctx.Queue(),
                self._ctx.Queue(),
                self.step_gates[r] if hold else None,
            )
            for r in range(n)
        ]
        self._fe2coord = self._ctx.Queue()
        self._stats = self._ctx.Queue()
        self._router_wave = [self._ctx.Queue() for _ in range(n)] if hold else []
        self._router_coord = [self._ctx.Queue() for _ in range(n)] if hold else []
        self.coord_acks = 0  # stats received from the coordinator (repro: one per handled message)
        self.hold_coord = True  # with hold: hold coordinator-bound messages and stats too
        self._held_stats: Stats | None = None
        self._stop = self._ctx.Event()
        self.procs: list[Any] = []
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._futures: dict[int, tuple[int, str, Future[Any]]] = {}
        self.streams: dict[str, RequestStream] = {}
        # the front-end's variables, advanced only by its table (spec/front_end.py)
        self.front = FrontVars()
        self.failures: dict[int, EngineFailure] = {}
        self.rank_vars: list[dict[str, Any]] = [{} for _ in range(n)]
        self._listeners: list[Callable[[RankRecord], None]] = []
        self._failure_listeners: list[Callable[[EngineFailure], None]] = []
        self.held: dict[tuple[int, str], deque[Any]] = {(r, s): deque() for r in range(n) for s in SOCKETS}
        if hold:
            self.held.update({(r, COORD): deque() for r in range(-1, n)})
        self._held_adds: list[tuple[int, Any]] = []  # requests the front-end table held (hold_request)
        self._ready: set[int] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._trans_cv = threading.Condition(self._lock)
        self.transitions: list[TransitionRecord] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> DPEngineClient:
        """Spawn the coordinator and the engines; return once all engines are ready.

        Raises:
            TransferTimeoutError: an engine did not come up within ``start_timeout_s`` (phase ``startup``).
            PeerFailedError: an engine failed during startup.
        """
        wave_out = self._router_wave if self.routed else [q.wave_in for q in self.queues]
        coord_in = self._router_coord if self.routed else [q.to_coord for q in self.queues]
        coord = self._ctx.Process(
            target=run_coordinator,
            args=(
                self._fe2coord,
                coord_in,
                wave_out,
                self._stats,
                self._stop,
                0.001,
                self.routed,
                get_variant(self.cfg.variant).coordinator_latches,
                get_variant(self.cfg.variant).first_req_exclusion,
            ),
            daemon=True,
            name="weightsync-dp-coordinator",
        )
        coord.start()
        self.procs.append(coord)
        for r in range(self.dp_size):
            p = self._ctx.Process(
                target=run_engine,
                args=(self.cfg, r, self.queues[r]),
                daemon=True,
                name=f"weightsync-engine-{r}",
            )
            p.start()
            self.procs.append(p)
        self._thread = threading.Thread(target=self._dispatch, name="weightsync-client", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        with self._lock:
            while len(self._ready) < self.dp_size:
                if self.failures:
                    f = next(iter(self.failures.values()))
                    self.shutdown()
                    raise PeerFailedError(list(self.failures), "startup", f.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.dp_size) if r not in self._ready]
                    self.shutdown()
                    raise TransferTimeoutError("startup", missing, self.start_timeout_s)
                self._trans_cv.wait(min(left, 0.1))
        return self

    def __enter__(self) -> DPEngineClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop every process this client started (Shutdown message, then terminate after ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        for q in self.queues:
            q.control_in.put(Shutdown())
        self._stop.set()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 5.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)

    # ------------------------------------------------------------------ dispatcher
    def _dispatch(self) -> None:
        while not self._closed:
            busy = False
            for r, q in enumerate(self.queues):
                while True:
                    try:
                        msg = q.out.get_nowait()
                    except (queue.Empty, OSError, ValueError):
                        break
                    busy = True
                    self._on_engine_msg(r, msg)
            while True:
                try:
                    st = self._stats.get_nowait()
                except (queue.Empty, OSError, ValueError):
                    break
                busy = True
                assert isinstance(st, Stats)
                with self._lock:
                    self.coord_acks += 1
                    if self.hold and self.hold_coord:
                        self._held_stats = st
                    else:
                        self._front_stats(st)
                    self._trans_cv.notify_all()
            for r, q in enumerate(self.queues if self.routed else []):
                while True:
                    try:
                        cmsg = q.to_coord.get_nowait()
                    except (queue.Empty, OSError, ValueError):
                        break
                    busy = True
                    with self._lock:
                        if self.hold and self.hold_coord:
                            self.held[(r, COORD)].append(cmsg)
                        else:
                            self._router_coord[r].put(cmsg)
                        self._trans_cv.notify_all()
            for r, rq in enumerate(self._router_wave):
                while True:
                    try:
                        wmsg = rq.get_nowait()
                    except (queue.Empty, OSError, ValueError):
                        break
                    busy = True
                    with self._lock:
                        if self.hold:
                            self.held[(r, "wave")].append(wmsg)
                        else:
                            self.queues[r].wave_in.put(wmsg)
                        self._trans_cv.notify_all()
            if not busy:
                time.sleep(0.001)

    def _on_engine_msg(self, rank: int, msg: Any) -> None:
        if isinstance(msg, TransitionRecord | RelabelRecord):
            with self._lock:
                self.rank_vars[rank] = msg.after
                if isinstance(msg, TransitionRecord):
                    self.transitions.append(msg)
                    for eff in msg.effects:  # the rank row's front-end effects run here
                        if eff in RANK_EFFECT_EVENT:
                            self._front_gate(RANK_EFFECT_EVENT[eff])
                for cb in list(self._listeners):
                    cb(msg)
                self._trans_cv.notify_all()
        elif isinstance(msg, StepOutputs):
            with self._lock:
                for d in msg.deltas:
                    s = self.streams.get(d.req_id)
                    if s is None:
                        continue
                    s.tokens.extend(d.tokens)
                    s.logprobs.extend(d.logprobs)
                    s.versions.extend([d.weight_version] * len(d.tokens))
                    if d.finish_reason is not None:
                        s.finish_reason = d.finish_reason
                        s.error = d.error
                        s.done.set()
        elif isinstance(msg, UtilityReply):
            with self._lock:
                if msg.call_id == -1:
                    self._ready.add(rank)
                    self._trans_cv.notify_all()
                    return
                entry = self._futures.pop(msg.call_id, None)
            if entry is None:
                return
            _, method, fut = entry
            if msg.error is None:
                fut.set_result(msg.result)
            else:
                fut.set_exception(_remote_error(rank, method, msg, self.failures.get(rank)))
        elif isinstance(msg, EngineFailure):
            with self._lock:
                self.failures[rank] = msg
                for fcb in list(self._failure_listeners):
                    fcb(msg)
                self._trans_cv.notify_all()

    def add_transition_listener(self, cb: Callable[[RankRecord], None]) -> None:
        """Call ``cb(record)`` for every transition (and relabel) any engine reports (dispatcher thread,
        under a lock)."""
        with self._lock:
            self._listeners.append(cb)

    def add_failure_listener(self, cb: Callable[[EngineFailure], None]) -> None:
        """Call ``cb(failure)`` when an engine reports a failure."""
        with self._lock:
            self._failure_listeners.append(cb)

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str = "condition") -> None:
        """Wait until ``pred()`` (evaluated under the client lock after each engine message) holds.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:.1f} s for {what}")
                self._trans_cv.wait(min(left, 0.05))

    # ------------------------------------------------------------------ sending
    def _send(self, rank: int, sock: str, msg: Any) -> None:
        if self.hold:
            with self._lock:
                self.held[(rank, sock)].append(msg)
            return
        q = self.queues[rank]
        {"front": q.front_in, "control": q.control_in, "wave": q.wave_in}[sock].put(msg)

    def has_held(self, rank: int, sock: str) -> bool:
        """Repro mode: whether a message is held for (rank, socket)."""
        with self._lock:
            return bool(self.held[(rank, sock)])

    def release(self, rank: int, sock: str) -> Any:
        """Repro mode: deliver the oldest held message for (rank, socket); returns it.

        Raises:
            LookupError: nothing is held there.
        """
        with self._lock:
            h = self.held[(rank, sock)]
            if not h:
                raise LookupError(f"no held message for rank {rank} on socket {sock}")
            msg = h.popleft()
        if sock == COORD:
            (self._fe2coord if rank < 0 else self._router_coord[rank]).put(msg)
            return msg
        q = self.queues[rank]
        {"front": q.front_in, "control": q.control_in, "wave": q.wave_in}[sock].put(msg)
        return msg

    def release_all(self) -> int:
        """Repro mode: deliver every held message (per socket in order); returns how many."""
        n = 0
        for r, s in list(self.held):
            while self.held[(r, s)]:
                self.release(r, s)
                n += 1
        return n

    def set_hold(self, hold: bool) -> None:
        """Turn holding on or off (only for a client created with ``hold=True``, whose wave socket is routed).

        Raises:
            ValueError: the client was created without ``hold=True``.
        """
        if not self.routed:
            raise ValueError("set_hold: create the client with hold=True to route the wave socket")
        with self._lock:
            self.hold = hold
            if not hold:
                self.refresh()

    def refresh(self) -> None:
        """Repro mode: adopt the coordinator's latest (held) stats as the front-end's belief."""
        with self._lock:
            if self._held_stats is not None:
                self._front_stats(self._held_stats)
                self._held_stats = None

    def set_step_gate(self, rank: int, value: int) -> None:
        """Repro mode: ``rank`` may take ``value`` acting steps (-1: any number; see ``EngineCore._may_step``)."""
        gate = self.step_gates[rank]
        with gate.get_lock():
            gate.value = value

    def step_gate(self, rank: int) -> int:
        """Repro mode: the permits left on ``rank``'s step gate (-1: open)."""
        return int(self.step_gates[rank].value)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: list[int] | tuple[int, ...],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        rank: int | None = None,
    ) -> RequestStream:
        """Send ADD(request, current_wave) to one engine; FIRST_REQ to the coordinator if idle (s5).

        Returns the request's :class:`RequestStream`.

        Raises:
            ValueError: before anything is sent, naming the value and the rule: a request breaking
                :func:`~weightsync.impl.engine.messages.request_error` for the cluster's model (an empty
                prompt, a token id outside ``[0, vocab_size)`` -- e.g. ``add_request: prompt token id 9999
                at position 3 is outside the vocabulary [0, 64)`` --, a non-int token, a prompt too long
                for ``max_position_embeddings``...), ``params`` not a :class:`SamplingParams`, a
                ``req_id`` already in flight, or a rank outside ``[0, dp_size)``.
        """
        assert self.cfg.model is not None
        if isinstance(prompt, str | bytes) or not hasattr(prompt, "__iter__"):
            raise ValueError(
                f"add_request: prompt must be a sequence of int token ids, got {type(prompt).__name__}"
            )
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ValueError(f"add_request: rank must be an int in [0, {self.dp_size}), got {rank!r}")
        if rank is not None and not 0 <= rank < self.dp_size:
            raise ValueError(f"add_request: rank {rank} outside [0, {self.dp_size})")
        rid = req_id if req_id is not None else f"req-{next(self._ids)}"
        raw = Request(rid, tuple(prompt), params or SamplingParams())
        why = request_error(raw, self.cfg.model.vocab_size, self.cfg.model.max_position_embeddings)
        if why is not None:
            raise ValueError(f"add_request: {why}")
        req = replace(raw, prompt=tuple(operator.index(t) for t in raw.prompt))
        with self._lock:
            prev = self.streams.get(rid)
            if prev is not None and not prev.done.is_set():
                raise ValueError(
                    f"add_request: req_id {rid!r} is already in flight on rank {prev.rank}; request ids must be "
                    "unique among unfinished requests"
                )
            r = next(self._rr) % self.dp_size if rank is None else rank
            stream = RequestStream(rid, r, req.prompt)
            self.streams[rid] = stream
            self._submit(r, req)
        return stream

    @property
    def current_wave(self) -> int:
        """The wave this front-end believes current (stamped on every ADD)."""
        return self.front.current_wave

    @property
    def engines_running(self) -> bool:
        """Whether this front-end believes the engines run (no FIRST_REQ then)."""
        return self.front.engines_running

    def _front_stats(self, st: Stats) -> None:
        """The coordinator's stats through the front-end table (caller holds the lock)."""
        _, self.front = front_end_fire(
            self.front, FrontEvent.STATS, {"wave": st.current_wave, "running": st.engines_running}
        )

    def _submit(self, r: int, req: Any) -> None:
        """One request to rank ``r`` through the front-end table: ADD stamped with the believed wave, a
        FIRST_REQ while the engines are believed idle, or held while the front-end pause gate is closed
        (caller holds the lock)."""
        wave = self.front.current_wave
        tr, self.front = front_end_fire(self.front, FrontEvent.SEND_REQUEST, {"target": r})
        for eff in tr.effects:
            if eff == "hold_request":
                self._held_adds.append((r, req))
            elif eff == "send_add":
                self._send(r, "front", AddMsg(req, wave))
            elif eff == "send_first_req":
                if self.hold and self.hold_coord:
                    self.held[(-1, COORD)].append(FirstReq(r, wave))
                else:
                    self._fe2coord.put(FirstReq(r, wave))
            else:
                raise AssertionError(f"front-end effect {eff!r} has no executor")

    def _front_gate(self, event: FrontEvent) -> None:
        """Close or open the front-end pause gate through the table; opening releases the held requests,
        in order, through :meth:`_submit` (caller holds the lock)."""
        tr, self.front = front_end_fire(self.front, event, {})
        if "release_held" in tr.effects:
            held, self._held_adds = self._held_adds, []
            for r, req in held:
                self._submit(r, req)

    def abort(self, req_id: str) -> None:
        """Send ABORT(req_id) to the engine serving it."""
        s = self.streams[req_id]
        self._send(s.rank, "front", AbortMsg(req_id))

    # ------------------------------------------------------------------ utility calls
    def call_rank(self, rank: int, method: str, **kwargs: Any) -> Future[Any]:
        """Send one utility call to ``rank``; the future resolves with its reply (or the remote error)."""
        cid = next(self._ids)
        fut: Future[Any] = Future()
        with self._lock:
            self._futures[cid] = (rank, method, fut)
        self._send(rank, "control", UtilityCall(cid, method, dict(kwargs)))
        return fut

    def gather(self, method: str, futs: list[Future[Any]], timeout: float) -> list[Any]:
        """Wait for one future per rank; returns their results in rank order.

        Raises:
            TransferTimeoutError: some ranks did not answer within ``timeout`` seconds (named).
            The first remote error otherwise (LocalProtocolError, TransferTimeoutError, ...).
        """
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(futs)
        missing: list[int] = []
        errors: list[BaseException] = []
        for r, f in enumerate(futs):
            try:
                results[r] = f.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                missing.append(r)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        if missing:
            fails = "; ".join(
                f"rank {r} failed in {f.phase}: {f.error}" for r, f in sorted(self.failures.items())
            )
            raise TransferTimeoutError(method, missing, timeout, fails or "no reply")
        return results

    def fan_out(self, method: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Send ``method`` to every rank and wait for all replies (see :meth:`gather`)."""
        t = timeout if timeout is not None else 4 * self.cfg.collective_timeout_s
        futs = [self.call_rank(r, method, **kwargs) for r in range(self.dp_size)]
        return self.gather(method, futs, t)

    def pause(
        self, mode: str | PauseMode = "abort", clear_cache: bool = True, timeout: float | None = None
    ) -> None:
        """``pause_generation(mode, clear_cache)`` on every rank; returns when every rank's pause completed.
        The front-end pause gate (front-end-pause) closes when a rank's row names ``front_end_gate``
        (:meth:`_on_engine_msg`), before that rank's reply."""
        m = PauseMode(mode)
        self._call_all("pause", timeout, mode=m.value, clear_cache=clear_cache)

    def resume(self, timeout: float | None = None) -> None:
        """``resume_generation`` on every rank (the resume barrier); returns when all answered."""
        self._call_all("resume", timeout)

    def _call_all(self, method: str, timeout: float | None, **kwargs: Any) -> None:
        if self.hold and front_end_answers(self.variant.pause_in_front_end, method):
            # repro: the schedule releases these calls one by one; the front-end answers at once
            for r in range(self.dp_size):
                self.call_rank(r, method, **kwargs)
            return
        self.fan_out(method, timeout, **kwargs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """Every rank joins the weight-transfer group (concurrently with the trainer's init); ``init_info``
        is vLLM 0.32's (:class:`~weightsync.impl.transfer.base.InitInfo`: packing fields included)."""
        self.fan_out("init_weight_transfer_engine", timeout, init_info=init_info)

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        """Open an update round on every rank (legal only once every rank is verified), in ``init_info``'s
        format (vLLM 0.32's ``start_weight_update()`` takes no argument)."""
        self.fan_out("start_weight_update", timeout)

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """Every rank receives the weights described by ``update_info`` (concurrently with the trainer): a
        dict, or a list indexed by global worker rank (vLLM's ``v1/worker/gpu_worker.py:1570-1578``)."""
        self.fan_out("update_weights", timeout, update_info=update_info)

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        """Close the round on every rank. ``weight_version`` becomes each rank's version only if its finish
        succeeded; None leaves the version (vLLM 0.32, ``v1/engine/async_llm.py:1351-1355``). ``monotonic``
        (weightsync) refuses a version older than the served one, by the trailing step number
        (:func:`~weightsync.spec.rank.version_order`): the rank then fails the round.

        Raises:
            ValueError: before anything is sent: ``weight_version`` not a str or None; with ``monotonic``, a
                version (this one or a rank's current one) that has no trailing step number.
            The ranks' errors (IncompleteUpdateError, LocalProtocolError for a refused version, ...).
        """
        if weight_version is not None:
            _check_version(weight_version, "finish_weight_update: weight_version")
        if monotonic and weight_version is not None:
            version_order(weight_version)
            for r, v in enumerate(self.get_weight_versions()):
                try:
                    version_order(v)
                except ValueError as exc:
                    raise ValueError(
                        f"finish_weight_update(monotonic=True): rank {r}'s version: {exc}"
                    ) from None
        self.fan_out("finish_weight_update", timeout, weight_version=weight_version, monotonic=monotonic)

    def update_weight_version(self, new_version: str, *, timeout: float | None = None) -> None:
        """Set every rank's version label without updating weights (vLLM 0.32 ``update_weight_version``,
        ``v1/engine/async_llm.py:1357-1359``): legal in any state, no transition
        (:func:`~weightsync.spec.rank.relabel_weight_version`); each rank reports and traces it.

        Raises:
            ValueError: ``new_version`` is not a str (before anything is sent).
        """
        _check_version(new_version, "update_weight_version: new_version")
        self.fan_out("update_weight_version", timeout, new_version=new_version)

    def get_weight_versions(self) -> list[str]:
        """Each rank's weight version, in rank order."""
        return [str(v) for v in self.fan_out("get_weight_version", 10.0)]

    def get_weight_version(self) -> str:
        """The engines' weight version: vLLM 0.32's consensus (``call_utility_consensus_async``,
        ``v1/engine/core_client.py:1271-1277``).

        Raises:
            WeightVersionMismatchError: the ranks report different versions (naming each).
        """
        versions = self.get_weight_versions()
        if any(v != versions[0] for v in versions):
            raise WeightVersionMismatchError(versions)
        return versions[0]

    def trace_to(self, path: str | None) -> None:
        """Every rank appends one JSONL line per transition to ``path`` itself (O_APPEND, written before the
        transition's effects), so file order is a linearization; None stops tracing."""
        self.fan_out("set_trace", 10.0, path=path)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each rank's ``{"vars": RankVars dict, "rank_seq": transitions fired so far}``, in rank order."""
        return list(self.fan_out("snapshot", 10.0))

    def get_state(self) -> list[dict[str, Any]]:
        """Each rank's protocol variables (RankVars as dicts), in rank order."""
        return list(self.fan_out("get_state", 10.0))

    def reference_generate(
        self, rank: int, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[list[int], list[float]]:
        """A fresh single-request run on ``rank``'s current weights (no batching, fresh KV)."""
        toks, lps = self.call_rank(
            rank,
            "reference_generate",
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        ).result(30.0)
        return list(toks), list(lps)
