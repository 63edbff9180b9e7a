"""``AsyncLLMWeightSyncClient``'s deadline, without vLLM: a call that does not return within ``timeout_s``
raises a TransferTimeoutError naming the call and the DP engines, and the coroutine is cancelled on the
engine's loop, so the engine does not go on with a call the trainer gave up."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from weightsync.spec.errors import TransferTimeoutError
from weightsync.vllm.clients import AsyncLLMWeightSyncClient

pytestmark = pytest.mark.timeout(60)


class _StuckLLM:
    """An ``AsyncLLM`` stand-in whose ``start_weight_update`` never returns (a peer that never joins)."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2))
        self.cancelled = threading.Event()

    async def start_weight_update(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def get_weight_version(self) -> Any:
        return "7"


def test_a_call_past_its_deadline_names_the_call_and_the_engines_and_is_cancelled() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        llm = _StuckLLM()
        client = AsyncLLMWeightSyncClient(llm, loop, timeout_s=0.3)
        assert client.get_weight_version() == "7"
        with pytest.raises(TransferTimeoutError) as info:
            client.start_weight_update()
        err = info.value
        assert err.phase == "start_weight_update" and err.missing_ranks == (0, 1)
        assert "AsyncLLM.start_weight_update did not return" in str(err)
        assert llm.cancelled.wait(5.0), "the timed-out coroutine still runs on the engine's loop"
        assert client.calls == ["get_weight_version", "start_weight_update"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
