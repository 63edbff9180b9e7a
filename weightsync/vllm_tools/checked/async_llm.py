"""The checked adapter over an in-process ``AsyncLLM`` (:func:`weightsync.vllm_tools.checked.checked_async_llm`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from weightsync.spec.states import RankEvent
from weightsync.vllm_tools.checked.adapter import CALL_OF_EVENT, DEFAULT_TIMEOUT_S, VLLMAdapter

T = TypeVar("T")


class AsyncLLMAdapter(VLLMAdapter):
    """:class:`VLLMAdapter` over an in-process ``vllm.v1.engine.async_llm.AsyncLLM`` that runs on ``loop``
    (another thread; the calls here block until vLLM's coroutine finished, at most the timeout).

    Calls (``v1/engine/async_llm.py``): ``pause_generation(mode=, clear_cache=)``, ``resume_generation()``,
    ``is_paused()``, ``init_weight_transfer_engine(WeightTransferInitRequest)``, ``start_weight_update()``,
    ``update_weights(WeightTransferUpdateRequest)``, ``finish_weight_update(weight_version=)``,
    ``get_weight_version()``. Unfinished counts: the output processor's (one engine) or the DP client's
    ``reqs_in_flight`` per engine identity (several), read on the loop in the same task as the pause.

    The engines are one DP world (:func:`~weightsync.spec.rank.rank_machines`) when the model is MoE
    (``model_config.is_moe``), else each engine is a world of its own; ``kw`` may say otherwise
    (``lockstep``).

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
        # a dense model's DP engines are independent, a MoE model's step in lockstep (v1/engine/core.py:1473-1482)
        kw.setdefault("lockstep", bool(llm.vllm_config.model_config.is_moe))
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

        # vLLM 0.32's arguments of each weight call (``v1/engine/async_llm.py:1315-1355``); the method is the
        # spec's call name of the event
        vllm_args: dict[RankEvent, Callable[[], tuple[Any, ...]]] = {
            RankEvent.INIT_TRANSFER: lambda: (WeightTransferInitRequest(init_info=payload),),
            RankEvent.START_UPDATE: lambda: (),
            RankEvent.UPDATE_WEIGHTS: lambda: (WeightTransferUpdateRequest(update_info=payload),),
            RankEvent.FINISH_UPDATE: lambda: (payload,),
        }
        self._run(getattr(self.llm, CALL_OF_EVENT[event])(*vllm_args[event]()), timeout)


__all__ = ["AsyncLLMAdapter"]
