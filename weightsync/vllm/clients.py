"""A vLLM ``VLLMWeightSyncClient`` for an in-process ``AsyncLLM`` (the trainer runs in another thread).

vLLM ships ``HTTPVLLMWeightSyncClient`` and ``RayVLLMWeightSyncClient`` (``distributed/weight_transfer/
clients.py``); an ``AsyncLLM`` in the same process needs its coroutines run on the loop that owns it,
from the trainer's thread. :class:`AsyncLLMWeightSyncClient` does that, with a deadline on every call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from weightsync.spec.errors import TransferTimeoutError

T = TypeVar("T")


class AsyncLLMWeightSyncClient:
    """The four weight-sync calls of vLLM's client protocol on an ``AsyncLLM`` living on ``loop``.

    Args:
        llm: the ``vllm.v1.engine.async_llm.AsyncLLM``.
        loop: the event loop running it (the trainer calls from another thread).
        timeout_s: deadline of each call, seconds.
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 300.0) -> None:
        self.llm = llm
        self.loop = loop
        self.timeout_s = timeout_s
        #: the engine's DP size (the ranks a timed-out call names)
        self.dp_size = int(llm.vllm_config.parallel_config.data_parallel_size)
        self.calls: list[str] = []

    def _run(self, name: str, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's loop and wait at most ``timeout_s`` for it.

        Raises:
            TransferTimeoutError: ``name`` did not return within ``timeout_s``, naming the call (its phase)
                and every DP engine (the coroutine does not say which one is late); the coroutine is
                cancelled, so the engine's call does not go on after the trainer gave up.
        """
        self.calls.append(name)
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeoutError(
                name,
                range(self.dp_size),
                self.timeout_s,
                f"AsyncLLM.{name} did not return; the call was cancelled",
            ) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(
            "init_weight_transfer_engine",
            self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)),
        )

    def start_weight_update(self) -> None:
        self._run("start_weight_update", self.llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(
            "update_weights", self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run("finish_weight_update", self.llm.finish_weight_update(weight_version=weight_version))

    def get_weight_version(self) -> str:
        """vLLM's served weight version (``AsyncLLM.get_weight_version``, ``v1/engine/async_llm.py:1361-1363``):
        what the trainer's ``send_weights(monotonic=True)`` compares with before a round."""
        return str(self._run("get_weight_version", self.llm.get_weight_version()))


__all__ = ["AsyncLLMWeightSyncClient"]
