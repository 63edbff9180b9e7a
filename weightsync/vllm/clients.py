"""A vLLM ``VLLMWeightSyncClient`` for an in-process ``AsyncLLM`` (the trainer runs in another thread).

vLLM ships ``HTTPVLLMWeightSyncClient`` and ``RayVLLMWeightSyncClient`` (``distributed/weight_transfer/
clients.py``); an ``AsyncLLM`` in the same process needs its coroutines run on the loop that owns it,
from the trainer's thread. :class:`AsyncLLMWeightSyncClient` does that, with a deadline on every call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class AsyncLLMWeightSyncClient:
    """The four weight-sync calls of vLLM's client protocol on an ``AsyncLLM`` living on ``loop``.

    Args:
        llm: the ``vllm.v1.engine.async_llm.AsyncLLM``.
        loop: the event loop running it (the trainer calls from another thread).
        timeout_s: deadline of each call.
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 300.0) -> None:
        self.llm = llm
        self.loop = loop
        self.timeout_s = timeout_s
        self.calls: list[str] = []

    def _run(self, name: str, coro: Coroutine[Any, Any, T]) -> T:
        self.calls.append(name)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

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
