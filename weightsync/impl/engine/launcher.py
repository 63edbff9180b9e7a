"""The launcher and message router of a reference DP cluster: it spawns the coordinator and the engine ranks,
routes their outputs (transition records, token deltas, replies, failures) and, in repro mode, holds every
engine- and coordinator-bound message for a schedule to release (:class:`Launcher`; the client,
:class:`~weightsync.impl.engine.client.DPEngineClient`, adds the front-end and the RPC fan-out)."""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch.multiprocessing as tmp

from weightsync.impl.engine.config import EngineConfig, EngineQueues
from weightsync.impl.engine.coordinator import run_coordinator
from weightsync.impl.engine.messages import (
    EngineFailure,
    RankRecord,
    RelabelRecord,
    Shutdown,
    Stats,
    StepOutputs,
    TransitionRecord,
    UtilityReply,
)
from weightsync.impl.engine.process import run_engine
from weightsync.impl.engine.tracing import open_trace
from weightsync.spec.errors import (
    IncompleteUpdateError,
    LocalProtocolError,
    PeerFailedError,
    RemoteProtocolError,
    TransferTimeoutError,
    WeightSyncError,
    WireMismatchError,
)
from weightsync.spec.front_end import RANK_EFFECT_EVENT, FrontEvent, FrontVars
from weightsync.spec.rank import get_variant

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


class Launcher:
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
        # the system trace (weightsync.impl.engine.tracing): the front-end's and the controller's records
        self._trace_front = open_trace(cfg.system_trace, "front")
        self._trace_ctrl = open_trace(cfg.system_trace, "ctrl")

    def _front_stats(self, st: Stats) -> None:
        """The coordinator's stats reach the front-end (:class:`~weightsync.impl.engine.front_end.FrontEnd`)."""
        raise NotImplementedError

    def _front_gate(self, event: FrontEvent) -> None:
        """A rank row's front-end effect reaches the front-end (:class:`~weightsync.impl.engine.front_end.FrontEnd`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Launcher:
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
                self.cfg.system_trace,
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

    def __enter__(self) -> Launcher:
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
        """Repro mode: ``rank`` may take ``value`` acting steps (-1: any number; see ``GatedEngineCore.may_step``)."""
        gate = self.step_gates[rank]
        with gate.get_lock():
            gate.value = value

    def step_gate(self, rank: int) -> int:
        """Repro mode: the permits left on ``rank``'s step gate (-1: open)."""
        return int(self.step_gates[rank].value)
