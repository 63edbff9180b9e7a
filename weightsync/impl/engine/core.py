"""Engine core of one DP rank: the busy loop that turns inputs into spec events and runs the table's effects.

Loop (vLLM 0.32 ``DPEngineCoreProc.run_busy_loop``, ``v1/engine/core.py:2328-2408``):

1. Poll the rank's three input FIFOs -- front-end input (ADD, ABORT), controller input (utility calls) and
   the coordinator's wave socket (START_DP_WAVE) -- starting from a different one each iteration, so no
   order is imposed between sockets. Each message becomes a :class:`~weightsync.spec.states.RankEvent` and
   is fired on the rank's :class:`~weightsync.spec.rank.RankMachine`.
2. Fire ``STEP(has_work)``; the table answers with ``execute_step`` + ``enter_dp_step`` or nothing (idle).
3. Run the returned effects by name (:attr:`EngineCore.effects`, one method per
   :data:`~weightsync.spec.rank.EFFECTS` entry). Collective effects block in the DP group and then fire the
   collective's outcome event (``DP_STEP_DONE``, ``DP_SYNC_DONE``, ``RESUME_BARRIER_DONE``...).

No protocol decision is made here: which event is legal and what follows is the table's. Every fired
transition is reported to the front-end (:class:`~weightsync.impl.engine.messages.TransitionRecord`) before
its effects run. ``update_weight_version`` (vLLM 0.32: a label set in any state, ``v1/engine/core.py:1082``)
is no transition: the rank applies :func:`~weightsync.spec.rank.relabel_weight_version` to its variables
and reports (and traces) a :class:`~weightsync.impl.engine.messages.RelabelRecord`. Versions are vLLM's
strings, ``"default"`` before any (``v1/engine/core.py:141``). When an effect fails (a collective timed out or mismatched, a transfer failed), the rank
reports an :class:`~weightsync.impl.engine.messages.EngineFailure` naming what it was blocked in, answers
every pending call with the error, stops stepping and serves only queries and shutdown.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import time
from collections.abc import Callable
from typing import Any, ClassVar

from weightsync.impl.engine.config import EngineConfig, EngineQueues
from weightsync.impl.engine.messages import (
    AbortMsg,
    AddMsg,
    EngineFailure,
    RelabelRecord,
    Shutdown,
    StartDPWave,
    StartWave,
    StepOutputs,
    TokenDelta,
    TransitionRecord,
    UtilityCall,
    UtilityReply,
    WaveComplete,
)
from weightsync.impl.engine.records import INITIAL_WEIGHT_VERSION, record_line, trace_line, vars_dict
from weightsync.impl.engine.replies import CallReplies
from weightsync.impl.engine.tracing import StepTracer, jsonable, open_trace
from weightsync.spec.calls import CALL_EVENT, DEFERRED_REPLY, call_args, worker_outcome
from weightsync.spec.collectives import (
    DONE_EVENT,
    DP_KINDS,
    ENTER_EFFECT,
    FAIL_PHASE,
    contribution,
    done_args,
    outcome_args,
)
from weightsync.spec.errors import LocalProtocolError
from weightsync.spec.rank import EFFECTS, RankMachine, effect_acts_on, relabel_weight_version
from weightsync.spec.refusal import ILLEGAL_CALL, IllegalCallPolicy, halted_text
from weightsync.spec.states import RankEvent
from weightsync.spec.table import Fired

#: The names of a rank's input sockets, in :meth:`EngineCore.poll`'s order (system trace ``recv.socket``).
_SOCKETS = ("front", "control", "wave")


class _RoundFailed(Exception):
    """Internal: a worker operation failed and TRANSFER_FAILED already fired (stops the outer transition's
    remaining effects)."""


class EngineCore(CallReplies):
    """One DP engine rank (runs in its own process; see :func:`weightsync.impl.engine.process.run_engine`).

    Args:
        cfg: cluster configuration.
        rank: this DP rank.
        queues: its FIFOs.
    """

    def __init__(self, cfg: EngineConfig, rank: int, queues: EngineQueues) -> None:
        import torch

        from weightsync.impl.engine.dp import DPGroup
        from weightsync.impl.engine.scheduler import Scheduler
        from weightsync.impl.engine.weights import make_worker, random_weights
        from weightsync.impl.models.causal_lm import CausalLM

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.rank = rank
        self.q = queues
        self.machine = RankMachine(rank, cfg.dp_size, cfg.variant, cfg.sync_interval)
        self.machine.vars = self.machine.vars._replace(weight_version=INITIAL_WEIGHT_VERSION)
        assert cfg.model is not None
        self.model = CausalLM(cfg.model)
        if cfg.init_seed is not None:
            self.model.load_weights(random_weights(self.model, cfg.init_seed))
        self.sched = Scheduler(self.model, rank, cfg.max_batch)
        self.worker = make_worker(cfg.transfer, self.model, rank)
        self.weight_version: str = INITIAL_WEIGHT_VERSION
        self.sched.weight_version = INITIAL_WEIGHT_VERSION
        self._round_error: BaseException | None = None
        self._op_failed = False  # a worker operation's failure is being fired (TRANSFER_FAILED)  # the last weight-transfer failure (rank `failed`)
        self.dp = DPGroup(
            rank, cfg.dp_size, cfg.host, cfg.dp_port, cfg.collective_timeout_s, cfg.allow_unauthenticated
        )
        self.coll_seq = 0  # DP collectives entered so far (equal on every rank while in lockstep)
        self.rank_seq = 0
        self.failure: EngineFailure | None = None
        self.shutdown = False
        self._ctx_msg: Any = None  # the input being handled (AddMsg, AbortMsg, UtilityCall)
        self._ctx_call: UtilityCall | None = None
        # calls whose reply a later transition's effect gives (spec DEFERRED_REPLY), by that effect
        self._deferred: dict[str, list[UtilityCall]] = {eff: [] for eff in DEFERRED_REPLY.values()}
        self._pending_calls: dict[int, UtilityCall] = {}
        self._poll_start = 0
        self._trace_fd: int | None = None
        # the system trace (module tracing): one group of records per model step of this rank
        self.tracer = StepTracer(
            open_trace(cfg.system_trace, f"rank{rank}"),
            lambda: (len(self.sched.waiting), len(self.sched.running)),
        )
        self._depth = 0
        # one method per effect of the table, named after it (``_<effect>``, spec/rank_vars.py EFFECTS)
        self.effects: dict[str, Callable[[Fired], None]] = {
            name: getattr(self, f"_{name}") for name in EFFECTS if hasattr(self, f"_{name}")
        }
        # the DP collectives' entries (enter_dp_step, enter_dp_sync, enter_resume_barrier) share one method
        entries = {e: functools.partial(self._enter_dp, k) for e, k in ENTER_EFFECT.items() if k in DP_KINDS}
        self.effects.update(entries)
        missing = set(EFFECTS) - set(self.effects)
        if missing:  # the table grew an effect this engine cannot run
            raise NotImplementedError(f"engine rank {rank}: no implementation of effect(s) {sorted(missing)}")
        self.queries: dict[str, Callable[..., Any]] = {
            "get_weight_version": lambda: self.weight_version,
            "update_weight_version": self._relabel,
            "get_state": lambda: vars_dict(self.machine.vars),
            "round_error": lambda: (
                f"{type(self._round_error).__name__}: {self._round_error}" if self._round_error else None
            ),
            "snapshot": lambda: {"vars": vars_dict(self.machine.vars), "rank_seq": self.rank_seq},
            "get_pid": os.getpid,
            "set_trace": self._set_trace,
            "reference_generate": self._reference_generate,
            "counts": lambda: {
                "waiting": len(self.sched.waiting),
                "running": len(self.sched.running),
                "steps": self.sched.steps,
                "coll_seq": self.coll_seq,
            },
        }

    # ------------------------------------------------------------------ firing
    def fire(self, event: RankEvent, **args: Any) -> Fired:
        """Fire ``event`` on the rank machine, report the transition, then run its effects in order."""
        fired = self.machine.fire(event, **args)
        # the scheduler's PauseState mirrors the machine variable (set by the table's updates)
        self.sched.pause_state = fired.after.pause_state
        tr = fired.transition
        coll = next((ENTER_EFFECT[e] for e in tr.effects if e in ENTER_EFFECT), "")
        rec = TransitionRecord(
            self.rank,
            self.rank_seq,
            event.value,
            {k: jsonable(v) for k, v in args.items()},
            vars_dict(fired.before),
            vars_dict(fired.after),
            tr.guard,
            tr.effects,
            coll,
            self.coll_seq,
            time.time(),
            len(self.sched.waiting),
            len(self.sched.running),
        )
        self.rank_seq += 1
        if self._trace_fd is not None:  # log before send: written before any effect of the transition
            line = json.dumps(trace_line(rec), sort_keys=True) + "\n"
            os.write(self._trace_fd, line.encode())
        # an idle loop pass (no effect, no variable changed, no input) is no step of the model
        self.tracer.transition(trace_line(rec), not tr.effects and fired.after == fired.before, self._depth)
        self.q.out.put(rec)
        self._depth += 1
        try:
            for name in tr.effects:
                if effect_acts_on(name, self.rank):
                    self.effects[name](fired)
        finally:
            self._depth -= 1
        self.weight_version = str(self.machine.vars.weight_version)
        self.sched.weight_version = self.weight_version
        return fired

    def _relabel(self, new_version: str) -> None:
        """``update_weight_version(new_version)``: no transition, any state (module docstring); reported
        and traced like one, as a :class:`RelabelRecord`.

        Raises:
            ValueError: ``new_version`` is not a str.
        """
        before = self.machine.vars
        after = relabel_weight_version(before, new_version)
        self.machine.vars = after
        rec = RelabelRecord(
            self.rank, self.rank_seq, new_version, vars_dict(before), vars_dict(after), time.time()
        )
        self.rank_seq += 1
        if self._trace_fd is not None:
            os.write(self._trace_fd, (json.dumps(record_line(rec), sort_keys=True) + "\n").encode())
        self.q.out.put(rec)
        self.weight_version = new_version
        self.sched.weight_version = new_version

    def _transfer_op(self, phase: str, op: Callable[[], None], blocks_in: str = "") -> None:
        """Run a worker operation of a weight-transfer round. If it raises (a timeout, a wire mismatch, an
        incomplete finish, ...), TRANSFER_FAILED fires (the table moves the rank to ``failed`` and replies
        the error) and :class:`_RoundFailed` stops the remaining effects of the calling transition.
        ``blocks_in``: the weight-transfer collective the operation is (the step ends before it and its
        completion, or failure, is the next step)."""
        if blocks_in:
            self.tracer.settle(blocks_in)
        try:
            op()
        except Exception as exc:
            if blocks_in:
                self.tracer.begin(completion=True)
            self._round_error = exc  # the DP board keeps the phase it failed in (repro reports it)
            self._op_failed = True
            try:
                self.fire(RankEvent.TRANSFER_FAILED, phase=phase, error=f"{type(exc).__name__}: {exc}")
            finally:
                self._op_failed = False
            raise _RoundFailed(exc) from exc
        if blocks_in:
            self.tracer.begin(completion=True)

    # ------------------------------------------------------------------ effects
    def _front_end_gate(self, fired: Fired) -> None:
        """The front-end's own gate (front-end-pause): the client's front-end table acts on it, not the rank."""

    _front_end_ungate = _front_end_gate

    def _send_deltas(self, deltas: list[TokenDelta]) -> None:
        self.tracer.outputs(
            [d.req_id for d in deltas if d.finish_reason not in (None, "abort")],
            [d.req_id for d in deltas if d.finish_reason == "abort"],
        )
        if deltas:
            self.q.out.put(StepOutputs(self.rank, tuple(deltas)))

    def _abort_requests(self, fired: Fired) -> None:
        # only the rows of mode=abort name this effect (the table decided; vLLM 0.32 core.py:2088-2092)
        self._send_deltas(self.sched.abort_all())

    def _admit_waiting(self, fired: Fired) -> None:
        self._send_deltas(self.sched.admit_waiting())

    def _queue_request(self, fired: Fired) -> None:
        assert isinstance(self._ctx_msg, AddMsg)
        self.sched.add(self._ctx_msg.request)

    def _abort_request(self, fired: Fired) -> None:
        assert isinstance(self._ctx_msg, AbortMsg)
        self._send_deltas(self.sched.abort(self._ctx_msg.req_id))

    def _to_coord(self, msg: StartWave | WaveComplete) -> None:
        self.tracer.send(msg)
        self.q.to_coord.put(msg)

    def _emit_start_wave(self, fired: Fired) -> None:
        self._to_coord(StartWave(int(fired.after.current_wave), self.rank))

    def _emit_wave_complete(self, fired: Fired) -> None:
        self._to_coord(WaveComplete(int(fired.after.current_wave) - 1))

    def _execute_step(self, fired: Fired) -> None:
        self._send_deltas(self.sched.step())
        if self.cfg.step_sleep_s:
            time.sleep(self.cfg.step_sleep_s)

    def _join(self, kind: str, a: int, b: int) -> tuple[int, ...]:
        seq = self.coll_seq
        self.coll_seq += 1
        self.tracer.settle(kind)
        out = self.dp.collective(kind, seq, a, b)
        self.tracer.begin(completion=True)  # the completion is the next step
        return out

    def _enter_dp(self, kind: str, fired: Fired) -> None:
        """Join DP collective ``kind`` with this rank's contribution and fire its completion (both spec's:
        :func:`~weightsync.spec.collectives.contribution`, :func:`~weightsync.spec.collectives.done_args`)."""
        v, s = self.machine.vars, self.sched
        mine = contribution(
            kind, s.pause_state, len(s.waiting), len(s.running), v.pending_pause, v.current_wave
        )
        a, b = (*mine, 0, 0)[:2]
        out = self._join(kind, a, b)
        self.fire(DONE_EVENT[kind], **dict(done_args(kind, outcome_args(kind, out), s.has_work())))

    def _enter_weight_broadcast(self, fired: Fired) -> None:
        self.dp.post("weight_broadcast")
        info = dict(self._current_kwargs()["update_info"])
        self._transfer_op(
            FAIL_PHASE["weight_broadcast"], lambda: self.worker.update_weights(info), "weight_broadcast"
        )
        self.dp.post("idle")
        self.fire(RankEvent.WEIGHT_BROADCAST_DONE)

    def _enter_transfer_init(self, fired: Fired) -> None:
        self.dp.post("transfer_init")
        info = dict(self._current_kwargs()["init_info"])
        self._transfer_op(
            FAIL_PHASE["transfer_init"],
            lambda: self.worker.init_weight_transfer_engine(info),
            "transfer_init",
        )
        self.dp.post("idle")
        self.fire(RankEvent.TRANSFER_INIT_DONE)

    def _start_weight_update(self, fired: Fired) -> None:
        self._transfer_op(FAIL_PHASE["start_weight_update"], self.worker.start_weight_update)

    def _finish_weight_update(self, fired: Fired) -> None:
        self._transfer_op(FAIL_PHASE["finish_weight_update"], self.worker.finish_weight_update)
        event, args = worker_outcome("finish_weight_update", self._current_kwargs())
        self.fire(event, **args)

    def _fail_round(self, fired: Fired) -> None:
        if not self._op_failed:  # no worker operation failed: the row itself (the monotonic guard) did
            self._round_error = LocalProtocolError(
                f"rank {self.rank}: weight_version {self._current_kwargs().get('weight_version')!r} is older "
                f"than the served {fired.before.weight_version!r} (monotonic guard, row "
                f"{fired.event.value}/{fired.transition.guard}: engines never go backwards); the rank is failed "
                "until a new round completes"
            )
        self.worker.fail_round()

    def _fail_init(self, fired: Fired) -> None:
        self.worker.fail_init()

    def _clear_cache(self, fired: Fired) -> None:
        if fired.after.clear_cache:
            self.sched.clear_cache()

    # ------------------------------------------------------------------ inputs
    CALL_EVENTS: ClassVar[dict[str, RankEvent]] = CALL_EVENT  # spec/controller.py

    def _set_trace(self, path: str | None) -> None:
        if self._trace_fd is not None:
            os.close(self._trace_fd)
            self._trace_fd = None
        if path:
            self._trace_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _reference_generate(
        self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[list[int], list[float]]:
        from weightsync.impl.engine.scheduler import reference_generate

        return reference_generate(self.model, list(prompt), max_new_tokens, temperature, seed)

    def _handle_call(self, call: UtilityCall) -> None:
        if call.method == "shutdown":
            self.shutdown = True
            self.q.out.put(UtilityReply(self.rank, call.call_id, None))
            return
        if call.method in self.queries:
            try:
                res = self.queries[call.method](**call.kwargs)
                self.q.out.put(UtilityReply(self.rank, call.call_id, res))
            except Exception as exc:
                self.q.out.put(
                    UtilityReply(
                        self.rank, call.call_id, None, f"{type(exc).__name__}: {exc}", type(exc).__name__
                    )
                )
            return
        event = self.CALL_EVENTS.get(call.method)
        if event is None:
            why = f"unknown utility method {call.method!r}"
            self.q.out.put(UtilityReply(self.rank, call.call_id, None, f"ValueError: {why}", "ValueError"))
            return
        if self.failure is not None:  # halted (spec/refusal.py HALTED): every protocol call is refused
            why = halted_text(self.rank, call.method, self.failure.error)
            self.q.out.put(
                UtilityReply(self.rank, call.call_id, None, f"PeerFailedError: {why}", "PeerFailedError")
            )
            return
        try:
            args = call_args(event, call.kwargs, len(self.sched.running), len(self.sched.waiting))
        except ValueError as exc:  # bad arguments: refused before the table sees the call
            self._reply_error(call, exc)
            return
        self._ctx_call = call
        self._pending_calls[call.call_id] = call
        if event in DEFERRED_REPLY:
            self._deferred[DEFERRED_REPLY[event]].append(call)
        if ILLEGAL_CALL is IllegalCallPolicy.NON_STICKY and self.machine.select(event, args) is None:
            # spec/refusal.py ILLEGAL_CALL: refused before the table fires; the rank is unchanged
            self._reply_error(call, LocalProtocolError(self.machine.explain_illegal(event, args)))
            self._ctx_call = None
            return
        try:
            self.fire(event, **args)
        except _RoundFailed:
            pass  # the table moved the rank to `failed` and replied the error (TRANSFER_FAILED's row)
        except Exception as exc:
            # An illegal call leaves the machine in its sticky error state; a failed effect (timeout,
            # mismatch, incomplete update) leaves the rank out of lockstep. Either way the rank stops
            # (weightsync: no further weights move) and every pending call gets the error.
            self._forget_deferred(call)
            self._pending_calls.pop(call.call_id, None)
            self.q.out.put(
                UtilityReply(
                    self.rank, call.call_id, None, f"{type(exc).__name__}: {exc}", type(exc).__name__
                )
            )
            self._fail(exc, call.method)
        finally:
            self._ctx_call = None

    def _handle(self, msg: Any) -> None:
        self._ctx_msg = msg
        try:
            if isinstance(msg, AddMsg):
                self.fire(RankEvent.ADD, wave=msg.wave)
            elif isinstance(msg, AbortMsg):
                self.fire(RankEvent.ABORT)
            elif isinstance(msg, StartDPWave):
                self.fire(RankEvent.START_DP_WAVE, wave=msg.wave, exclude=msg.exclude)
            elif isinstance(msg, UtilityCall):
                self._handle_call(msg)
            else:  # Shutdown
                self.shutdown = True
        finally:
            self._ctx_msg = None

    def poll(self) -> int:
        """Drain every input FIFO once, starting from a rotating socket; returns messages handled."""
        qs = [self.q.front_in, self.q.control_in, self.q.wave_in]
        n = 0
        k = self._poll_start
        self._poll_start = (k + 1) % len(qs)
        for i in range(len(qs)):
            q = qs[(k + i) % len(qs)]
            while True:
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    break
                n += 1
                if self.failure is None:
                    if not isinstance(msg, Shutdown):
                        self.tracer.begin(msg, _SOCKETS[(k + i) % len(qs)])
                    self._handle(msg)
                    self.tracer.settle()
                elif isinstance(msg, UtilityCall):
                    self._handle_call(msg)  # queries and shutdown still answered; protocol calls refused
                elif isinstance(msg, Shutdown):
                    self.shutdown = True
                if self.shutdown:
                    return n
        return n

    # ------------------------------------------------------------------ loop
    def may_step(self) -> bool:
        """Whether the loop may fire its next STEP now: always (``weightsync repro``'s engine,
        ``weightsync.repro.gated.GatedEngineCore``, holds acting steps at a gate)."""
        return True

    def run(self) -> None:
        """The busy loop; returns on shutdown."""
        while not self.shutdown:
            try:
                got = self.poll()
                if self.shutdown:
                    break
                if self.failure is not None:
                    time.sleep(self.cfg.idle_sleep_s)
                    continue
                if not self.may_step():
                    time.sleep(self.cfg.idle_sleep_s)
                    continue
                fired = self.fire(RankEvent.STEP, has_work=self.sched.has_work())
                self.tracer.settle()
                if not fired.transition.effects and not got:
                    time.sleep(self.cfg.idle_sleep_s)
            except Exception as exc:
                self._fail(exc, self.dp.current or "loop")
        self.dp.close()


__all__ = ["EngineCore"]
