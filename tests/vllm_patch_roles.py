"""Roles for ``tests/test_vllm_patch.py``: vLLM 0.32's own ``DPEngineCoreProc`` methods (as installed, or
with weightsync's patch series ``weightsync/patches/vllm-0.32/`` grafted as the plugin does) run on a real
gloo DP group of 2 processes. The engine object is vLLM's class without its ``__init__`` (no model, no
ZMQ): the attributes its pause/resume code reads are set by hand, the scheduler is a stand-in with the
three members that code touches (``pause_state``, ``set_pause_state``, ``has_unfinished_requests``).
"""

from __future__ import annotations

import os
import queue
from datetime import timedelta
from types import ModuleType
from typing import Any


def load_core(which: str) -> ModuleType:
    """The installed ``vllm.v1.engine.core``: as vLLM ships it (``which="shipped"``), or with weightsync's patch
    series grafted onto its classes as the plugin does (``"patched"``: :func:`weightsync.vllm_tools.fix.install`,
    which applies the patches with ``patch(1)`` to copies of the installed files)."""
    for k, v in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_TARGET_DEVICE": "cpu",
    }.items():
        os.environ.setdefault(k, v)
    import vllm.v1.engine.core as core

    from weightsync.vllm_tools import fix

    assert which in ("shipped", "patched"), which
    if which == "patched":
        fix.install()
    else:
        assert not fix._installed, "this process runs the patched classes"
    return core


class Scheduler:
    """The members of vLLM's scheduler that ``DPEngineCoreProc``'s pause/resume code touches."""

    def __init__(self, pause_state: Any, unfinished: bool) -> None:
        self.pause_state = pause_state
        self.unfinished = unfinished

    def set_pause_state(self, state: Any) -> None:
        self.pause_state = state

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


class Executor:
    """``model_executor.collective_rpc`` that records the worker calls (or raises for ``fail``)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[str] = []
        self.fail = fail

    def collective_rpc(
        self, method: str, timeout: Any = None, args: Any = (), kwargs: Any = None
    ) -> list[None]:
        self.calls.append(method)
        if method == self.fail:
            raise RuntimeError(f"worker {method} failed")
        return [None]


def make_engine(core: ModuleType, dp_group: Any, rank: int, **fields: Any) -> Any:
    """vLLM's ``DPEngineCoreProc`` without ``__init__``: the fields of its pause/resume code set here."""
    from vllm.v1.core.sched.interface import PauseState

    eng = object.__new__(core.DPEngineCoreProc)
    paused = fields.pop("paused", False)
    eng.__dict__.update(
        dp_group=dp_group,
        dp_rank=rank,
        engine_index=rank,
        has_coordinator=True,
        output_queue=queue.Queue(),
        pending_pause=False,
        ignore_start_dp_wave=paused,
        engines_running=False,
        current_wave=0,
        step_counter=0,
        dp_sync_interval=16,
        weight_update_state="idle",
        model_executor=Executor(fields.pop("fail", "")),
        scheduler=Scheduler(
            PauseState.PAUSED_ALL if paused else PauseState.UNPAUSED, fields.pop("unfinished", False)
        ),
    )
    eng.__dict__.update(fields)
    return eng


def _group(rank: int, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def stray_resume_role(rank: int, port: int, which: str) -> dict[str, Any]:
    """The stray-resume scenario of the model (``weightsync check --variant vllm-0.32 --stray-resume``):
    rank 0 serves a request (engines_running), rank 1 has not yet received the wave's START_DP_WAVE. A
    resume no pause preceded reaches both; then rank 1 receives START_DP_WAVE and both take their next DP
    step (vLLM's ``sync_dp_state`` all-reduce, ``core.py:2416``). Returns what each rank did."""
    import torch.distributed as dist
    from vllm.config import ParallelConfig
    from vllm.v1.engine import EngineCoreRequestType

    core = load_core(which)
    group = _group(rank, port, 6.0)
    eng = make_engine(core, group, rank, engines_running=rank == 0, unfinished=rank == 0)
    out: dict[str, Any] = {"rank": rank}
    try:
        eng.resume_scheduler()
        out["resume"] = "returned"
        if rank == 1:
            eng._handle_client_request(EngineCoreRequestType.START_DP_WAVE, (0, -1))
        out["engines_running"] = eng.engines_running
        out["step"] = ParallelConfig.sync_dp_state(group, rank == 0, False)
    except Exception as exc:  # a gloo timeout or mismatch: the deadlock, caught
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        dist.destroy_process_group()
    return out


def epoch_resume_role(rank: int, port: int, which: str, wave: int) -> dict[str, Any]:
    """Both ranks paused (pause consensus reached) at different waves, no request left: the resume
    barrier. Returns each rank's wave, step counter and what it told the coordinator."""
    import torch.distributed as dist

    core = load_core(which)
    group = _group(rank, port, 6.0)
    eng = make_engine(core, group, rank, paused=True, current_wave=wave, step_counter=5)
    try:
        eng.resume_scheduler()
    finally:
        dist.destroy_process_group()
    told = []
    while not eng.output_queue.empty():
        _, outputs = eng.output_queue.get_nowait()
        told.append({"wave_complete": outputs.wave_complete, "start_wave": outputs.start_wave})
    return {
        "rank": rank,
        "current_wave": eng.current_wave,
        "step_counter": eng.step_counter,
        "engines_running": eng.engines_running,
        "told_coordinator": told,
    }
