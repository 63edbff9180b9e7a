"""An observer inside each vLLM 0.32 DP engine process: records the protocol events the engine saw, and
holds its coordinator input (START_DP_WAVE) until the driver releases it.

Installed by the plugin (:func:`weightsync.vllm.plugin.register`, which vLLM runs inside
``EngineCore.__init__``, ``v1/engine/core.py:129``) only when :data:`ENV_EVENTS` is set, and only on vLLM
0.32.x. It wraps methods of vLLM's own ``DPEngineCoreProc`` (class attributes, looked up per call), so the
engine runs vLLM's code; each wrapper calls the original and then writes one JSON line to
``$WEIGHTSYNC_VLLM_EVENTS/engine-<dp_rank>.jsonl`` (flushed per line, so a log survives a hang and the
engine's death). Every record has ``t`` (``time.monotonic()`` seconds, one clock for every process of the
host), ``rank`` (``dp_rank``), ``ev``, the event's own fields, and ``vllm``: the engine's variables right
after the event, read from vLLM (``engines_running``, ``current_wave``, ``step_counter``, ``pending_pause``,
``ignore_start_dp_wave``, ``pause_state`` as the :class:`~weightsync.spec.states.PauseState` value, and the
scheduler's ``waiting`` / ``running`` counts, ``scheduler.get_request_counts()``).

=================  ==========================================================================================
``ev``             where it is recorded (vLLM 0.32)
=================  ==========================================================================================
``ADD``            ``_handle_client_request(ADD)`` returned (``core.py:1680-1684``; DP: ``:2234-2248``):
                   ``req``, ``wave`` (the request's stamped wave)
``ABORT``          ``_handle_client_request(ABORT)`` returned: ``reqs``
``START_DP_WAVE``  ``DPEngineCoreProc._handle_client_request`` returned (``:2281-2298``): ``wave``,
                   ``exclude``; or ``held`` (not handed to vLLM yet, see below)
``pause``          ``pause_scheduler`` returned (``:2061-2103``): ``mode``, ``clear_cache``, ``running`` (the
                   scheduler's running count before the call), ``done`` (it completed synchronously)
``pause_done``     the pause's idle callback ran (``_finish_pause``): phase 2's consensus was reached
``resume``         ``resume_scheduler`` entered (``:2250-2273``), before its barrier
``resume_done``    ``resume_scheduler`` returned: ``barrier`` (it entered the MAX all-reduce: vLLM's
                   ``EngineCore.resume_scheduler`` ran, ``:2262``), ``has_unfinished`` (the barrier's input:
                   ``has_unfinished_requests()`` once unpaused), ``error``
``step``           a forward is about to run: ``execute_dummy_batch`` (``has_work`` false) or the executor's
                   ``execute_model`` with a non-empty batch (``has_work`` true), ``sync``: whether this step ends with the DP sync
                   all-reduce (vLLM's ``step_counter + 1 == 1`` or ``% dp_sync_interval == 0``,
                   ``:2410-2414``), ``dp_sync_interval``
``step_done``      ``_has_global_unfinished_reqs`` returned (``:2408-2427``), recorded at the top of the next
                   loop iteration so that ``vllm`` includes the wave change (``:2366-2386``): ``synced``,
                   ``has_unfinished`` (the rank's input), ``pending_pause`` (its input), ``result``
``step_error``     the forward or the sync raised (a collective's timeout): ``error``
``wave_complete``  rank 0 put ``EngineCoreOutputs(wave_complete=w)`` for the coordinator (``:2377-2383``)
``start_wave``     rank 0 put the mirror ``EngineCoreOutputs(start_wave=w)`` (``:2394-2406``) or a stale
                   request's (``:2240-2248``)
``rpc``            ``collective_rpc(method)`` returned or raised (weight-transfer calls): ``method``,
                   ``error``
``released``       a held message was handed to vLLM (``weightsync_release``)
=================  ==========================================================================================

Holding: with :data:`ENV_HOLD` = ``START_DP_WAVE`` every START_DP_WAVE a rank receives is kept in the
probe (recorded ``held``) instead of reaching vLLM's handler; the utility call ``weightsync_release`` (sent
by the driver to that engine: ``AsyncMPClient._call_utility_async(..., engine=...)``) hands the oldest one
to vLLM's handler on the busy-loop thread, where vLLM would have handled it; ``weightsync_release_all``
releases every held message and stops holding on that engine. This is how a schedule makes a
rank take a START_DP_WAVE after its resume (vLLM 0.32 ``EngineCoreProc.process_input_sockets``, ``v1/engine/core.py:1831-1931``).

Gating a step: with :data:`ENV_ADD_WAITS` set (seconds), an engine that handled an ADD waits on its
busy-loop thread until its input queue holds the next message (or the time is up) before it may step, so
``_process_input_queue`` hands that message to vLLM too before the next step (``v1/engine/core.py:1597-1601``).
This is how a schedule makes a rank take an ADD and the pause after it with no step between.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

#: directory for the per-engine event logs; unset: the probe is not installed
ENV_EVENTS = "WEIGHTSYNC_VLLM_EVENTS"
#: comma-separated request types the engines hold until released (only ``START_DP_WAVE``)
ENV_HOLD = "WEIGHTSYNC_VLLM_HOLD"
#: seconds an engine that handled an ADD waits for its next input message before it may step (unset: no
#: wait); a schedule whose rank takes the ADD and its next message with no step between sets it
ENV_ADD_WAITS = "WEIGHTSYNC_VLLM_ADD_WAITS_S"
HOLDABLE = frozenset({"START_DP_WAVE"})

_installed = False


def _pause_value(engine: Any) -> int:
    return int(engine.scheduler.pause_state)


def snapshot(engine: Any) -> dict[str, Any]:
    """The engine's DP variables and scheduler counts, read from vLLM (see the module docstring)."""
    running, waiting = engine.scheduler.get_request_counts()
    return {
        "engines_running": bool(engine.engines_running),
        "current_wave": int(engine.current_wave),
        "step_counter": int(engine.step_counter),
        "pending_pause": bool(engine.pending_pause),
        "ignore_start_dp_wave": bool(engine.ignore_start_dp_wave),
        "pause_state": _pause_value(engine),
        "waiting": int(waiting),
        "running": int(running),
    }


class _Log:
    """One engine's JSONL event log (line-buffered, appended from the busy-loop and output threads)."""

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"engine-{rank}.jsonl"
        self._f = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self.rank = rank

    def write(self, engine: Any, ev: str, **fields: Any) -> None:
        rec = {"t": time.monotonic(), "rank": self.rank, "ev": ev, **fields, "vllm": snapshot(engine)}
        with self._lock:
            self._f.write(json.dumps(rec, default=str) + "\n")


def _log(engine: Any) -> _Log:
    log: _Log | None = engine.__dict__.get("_weightsync_log")
    if log is None:
        log = _Log(os.environ[ENV_EVENTS], int(engine.dp_rank))
        engine.__dict__["_weightsync_log"] = log
        engine.__dict__["_weightsync_held"] = deque()
        engine.__dict__["_weightsync_pending_done"] = None
        _hook_instance(engine, log)
    return log


def _hook_instance(engine: Any, log: _Log) -> None:
    """Per-engine hooks: the executor's forward, and rank 0's outputs to the coordinator."""
    executor = engine.model_executor
    execute_model = executor.execute_model

    def traced_execute_model(*args: Any, **kwargs: Any) -> Any:
        # vLLM calls execute_model with an empty batch too (finished requests not yet returned): that is no
        # step of the DP loop, which then runs a dummy batch (EngineCore.step's model_executed flag,
        # core.py:687: total_num_scheduled_tokens > 0)
        scheduled = getattr(
            args[0] if args else kwargs.get("scheduler_output"), "total_num_scheduled_tokens", 1
        )
        if scheduled > 0:
            _record_step(engine, log, has_work=True)
        try:
            return execute_model(*args, **kwargs)
        except Exception as exc:
            log.write(engine, "step_error", error=f"{type(exc).__name__}: {exc}")
            raise

    executor.execute_model = traced_execute_model
    queue = engine.output_queue
    put_nowait = queue.put_nowait

    def traced_put_nowait(item: Any) -> None:
        put_nowait(item)
        outputs: Any = item[1] if isinstance(item, tuple) and len(item) == 2 else None
        if getattr(outputs, "wave_complete", None) is not None:
            log.write(engine, "wave_complete", wave=int(outputs.wave_complete))
        elif getattr(outputs, "start_wave", None) is not None:
            log.write(engine, "start_wave", wave=int(outputs.start_wave))

    queue.put_nowait = traced_put_nowait


def _syncs_next(engine: Any) -> bool:
    """Whether the step about to run ends with the DP sync all-reduce (``core.py:2410-2414``)."""
    nxt = int(engine.step_counter) + 1
    return nxt == 1 or nxt % int(engine.dp_sync_interval) == 0


def _record_step(engine: Any, log: _Log, has_work: bool) -> None:
    _flush_done(engine, log)
    log.write(
        engine,
        "step",
        has_work=has_work,
        sync=_syncs_next(engine),
        dp_sync_interval=int(engine.dp_sync_interval),
    )


def _flush_done(engine: Any, log: _Log) -> None:
    pending = engine.__dict__.get("_weightsync_pending_done")
    if pending is not None:
        engine.__dict__["_weightsync_pending_done"] = None
        log.write(engine, "step_done", **pending)


def install() -> bool:
    """Wrap ``DPEngineCoreProc``'s protocol methods (see the module docstring) when :data:`ENV_EVENTS` is
    set and vLLM is 0.32.x; idempotent. Returns whether the probe is installed.

    Raises:
        ValueError: :data:`ENV_HOLD` names a request type the probe cannot hold, or :data:`ENV_ADD_WAITS`
            is not a number.
    """
    global _installed
    if _installed:
        return True
    if not os.environ.get(ENV_EVENTS):
        return False
    import vllm

    if not str(vllm.__version__).startswith("0.32."):
        return False
    hold = {h.strip() for h in os.environ.get(ENV_HOLD, "").split(",") if h.strip()}
    raw = os.environ.get(ENV_ADD_WAITS, "").strip()
    try:
        add_waits_s = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{ENV_ADD_WAITS}={raw!r}: seconds, a number") from None
    if hold - HOLDABLE:
        raise ValueError(f"{ENV_HOLD}={sorted(hold)}: only {sorted(HOLDABLE)} can be held")
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCore

    cls: Any = DPEngineCoreProc
    base: Any = EngineCore
    orig = {
        name: cls.__dict__.get(name) or getattr(cls, name)
        for name in (
            "_handle_client_request",
            "pause_scheduler",
            "resume_scheduler",
            "_has_global_unfinished_reqs",
            "execute_dummy_batch",
            "collective_rpc",
            "_process_input_queue",
            "_finish_pause",
        )
    }
    base_resume = base.resume_scheduler

    def _handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        log = _log(self)
        if request_type == EngineCoreRequestType.START_DP_WAVE:
            wave, exclude = int(request[0]), request[1]
            if "START_DP_WAVE" in hold and not self.__dict__.get("_weightsync_hold_off"):
                self._weightsync_held.append((request_type, request))
                log.write(self, "START_DP_WAVE", wave=wave, exclude=exclude, held=True)
                return
            orig["_handle_client_request"](self, request_type, request)
            log.write(self, "START_DP_WAVE", wave=wave, exclude=exclude, held=False)
            return
        orig["_handle_client_request"](self, request_type, request)
        if request_type == EngineCoreRequestType.ADD:
            req, wave = request
            log.write(self, "ADD", req=str(req.request_id), wave=int(wave))
            if add_waits_s > 0:  # the busy loop steps only once the next message is in (or on timeout)
                deadline = time.monotonic() + add_waits_s
                while self.input_queue.empty() and time.monotonic() < deadline:
                    time.sleep(0.001)
        elif request_type == EngineCoreRequestType.ABORT:
            log.write(self, "ABORT", reqs=[str(r) for r in request])

    def weightsync_release(self: Any) -> str:
        """Hand the oldest held message to vLLM's handler (a utility call of the driver)."""
        log = _log(self)
        if not self._weightsync_held:
            raise RuntimeError(f"engine {self.dp_rank}: no held message to release")
        request_type, request = self._weightsync_held.popleft()
        log.write(self, "released", kind="START_DP_WAVE", wave=int(request[0]))
        orig["_handle_client_request"](self, request_type, request)
        log.write(self, "START_DP_WAVE", wave=int(request[0]), exclude=request[1], held=False)
        return f"START_DP_WAVE(wave={int(request[0])})"

    def weightsync_release_all(self: Any) -> int:
        """Stop holding on this engine and hand every held message to vLLM, oldest first (a utility call of
        the driver); returns how many were held."""
        _log(self)
        self.__dict__["_weightsync_hold_off"] = True
        n = 0
        while self._weightsync_held:
            weightsync_release(self)
            n += 1
        return n

    def weightsync_held(self: Any) -> int:
        """How many messages the probe holds for this engine (a utility call of the driver)."""
        _log(self)
        return len(self._weightsync_held)

    def pause_scheduler(self: Any, mode: str = "abort", clear_cache: bool = True) -> Any:
        log = _log(self)
        running, waiting = (int(n) for n in self.scheduler.get_request_counts())
        out = orig["pause_scheduler"](self, mode, clear_cache)
        log.write(
            self,
            "pause",
            mode=str(mode),
            clear_cache=bool(clear_cache),
            running=running,
            waiting=waiting,
            done=out is None,
        )
        return out

    def _finish_pause(self: Any, clear_cache: bool) -> Any:
        out = orig["_finish_pause"](self, clear_cache)
        _log(self).write(self, "pause_done")
        return out

    def resume_scheduler(self: Any) -> Any:
        log = _log(self)
        self.__dict__["_weightsync_barrier"] = False
        log.write(self, "resume")
        try:
            out = orig["resume_scheduler"](self)
        except Exception as exc:
            log.write(
                self, "resume_done", barrier=self._weightsync_barrier, error=f"{type(exc).__name__}: {exc}"
            )
            raise
        log.write(
            self,
            "resume_done",
            barrier=self._weightsync_barrier,
            has_unfinished=self.__dict__.get("_weightsync_barrier_input"),
            error="",
        )
        return out

    def base_resume_scheduler(self: Any) -> Any:
        self.__dict__["_weightsync_barrier"] = True  # the barrier follows (core.py:2262-2270)
        out = base_resume(self)
        # the barrier's input, read as vLLM reads it: after the scheduler is unpaused (under PAUSED_ALL
        # get_num_unfinished_requests() is 0, v1/core/sched/scheduler.py:2803-2811)
        self.__dict__["_weightsync_barrier_input"] = bool(self.scheduler.has_unfinished_requests())
        return out

    def _has_global_unfinished_reqs(self: Any, local_unfinished: bool) -> bool:
        log = _log(self)
        synced = _syncs_next(self)
        pending = bool(self.pending_pause)
        try:
            result = orig["_has_global_unfinished_reqs"](self, local_unfinished)
        except Exception as exc:
            log.write(self, "step_error", error=f"{type(exc).__name__}: {exc}")
            raise
        self.__dict__["_weightsync_pending_done"] = {
            "synced": synced,
            "has_unfinished": bool(local_unfinished),
            "pending_pause": pending,
            "result": bool(result),
        }
        return bool(result)

    def execute_dummy_batch(self: Any) -> Any:
        log = _log(self)
        _record_step(self, log, has_work=False)
        try:
            return orig["execute_dummy_batch"](self)
        except Exception as exc:
            log.write(self, "step_error", error=f"{type(exc).__name__}: {exc}")
            raise

    def collective_rpc(
        self: Any, method: Any, timeout: Any = None, args: Any = (), kwargs: Any = None
    ) -> Any:
        log = _log(self)
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        try:
            out = orig["collective_rpc"](self, method, timeout, args, kwargs)
        except Exception as exc:
            log.write(self, "rpc", method=name, error=f"{type(exc).__name__}: {exc}")
            raise
        log.write(self, "rpc", method=name, error="")
        return out

    def _process_input_queue(self: Any) -> Any:
        _flush_done(self, _log(self))
        return orig["_process_input_queue"](self)

    for fn in (
        _handle_client_request,
        pause_scheduler,
        _finish_pause,
        resume_scheduler,
        _has_global_unfinished_reqs,
        execute_dummy_batch,
        collective_rpc,
        _process_input_queue,
        weightsync_release,
        weightsync_release_all,
        weightsync_held,
    ):
        setattr(cls, fn.__name__, fn)
    # EngineCore.resume_scheduler is reached from DPEngineCoreProc.resume_scheduler by super(): wrap it on
    # DPEngineCoreProc's base so that only the DP engine's barrier path sets the flag.
    base.resume_scheduler = base_resume_scheduler
    _installed = True
    return True


def read_events(directory: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The per-engine event logs under ``directory``, by DP rank, in each engine's order.

    Raises:
        ValueError: a line is not JSON (a log cut short by the engine's death keeps every complete line).
    """
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob("engine-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        recs: list[dict[str, Any]] = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(path.read_text(encoding="utf-8").splitlines()):
                    break  # the last line, cut by the process's death
                raise ValueError(f"{path}:{i}: not JSON: {exc}") from exc
        out[rank] = recs
    return out


__all__ = ["ENV_ADD_WAITS", "ENV_EVENTS", "ENV_HOLD", "HOLDABLE", "install", "read_events", "snapshot"]
