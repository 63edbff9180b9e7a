"""One way to start a real vLLM 0.32 ``AsyncLLM`` for weightsync's commands (demo, record, repro, bench), and
to connect weightsync's trainer to it through vLLM's public API.

- :class:`LoopThread`: an asyncio event loop on its own daemon thread; the ``AsyncLLM`` is created and
  driven on it while the caller (the controller, the trainer) stays synchronous.
- :func:`start_async_llm`: ``AsyncLLM.from_engine_args`` with the settings these commands share on CPU:
  eager mode, float32, a 128-token context (``max_model_len``), stats off, the ``weightsync`` weight-transfer backend
  (``weight_transfer_config={"backend": "weightsync"}``), ``data_parallel_size``.
- :func:`shutdown_async_llm`: vLLM's shutdown without its shutdown tracebacks.
- :func:`connect_trainer`: ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``
  (vLLM's ``distributed/weight_transfer/factory.py``) with :class:`~weightsync.vllm.trainer.WeightsyncTrainerInitInfo`
  on 127.0.0.1 and a free port; ``world_size`` is the trainer plus one worker per DP engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds an engine start may take (MoE DP=2 on 2 busy cores: about 60 s)
START_TIMEOUT_S = 600.0


class LoopThread:
    """An asyncio event loop running on a daemon thread named ``name``.

    Attributes:
        loop: the event loop (hand it to vLLM-side clients that need it).
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it (``timeout`` seconds).

        Raises:
            TimeoutError: it did not finish in time (it keeps running on the loop).
            Exception: whatever ``coro`` raised.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its result is the returned future's."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop and join its thread (10 s at most)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def start_async_llm(
    loop: LoopThread,
    model_dir: str | Path,
    *,
    dp: int,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    **engine_args: Any,
) -> tuple[Any, float]:
    """Start ``AsyncLLM`` on ``loop`` for the local checkpoint ``model_dir`` with ``dp`` DP engines (see the
    module docstring; ``engine_args`` are further ``AsyncEngineArgs`` fields, e.g. timeouts or a seed).
    Returns the engine and its start time in seconds.

    Raises:
        ValueError: ``dp`` < 1 or ``max_num_seqs`` < 1.
        TimeoutError: the engines did not come up within :data:`START_TIMEOUT_S`.
    """
    if dp < 1 or max_num_seqs < 1:
        raise ValueError(f"dp and max_num_seqs must be >= 1, got {dp}, {max_num_seqs}")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model_dir),
        enforce_eager=True,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        disable_log_stats=True,
        weight_transfer_config={"backend": "weightsync"},
        data_parallel_size=dp,
        **engine_args,
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(args)

    t0 = time.monotonic()
    llm = loop.run(start(), START_TIMEOUT_S)
    return llm, time.monotonic() - t0


async def _stop_output_handler(llm: Any) -> None:
    handler = getattr(llm, "output_handler", None)
    if handler is None or handler.done():
        return
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handler


def shutdown_async_llm(llm: Any, lt: LoopThread, timeout_s: float = 30.0) -> None:
    """Shut ``llm`` (an ``AsyncLLM`` driven on ``lt``) down without vLLM's shutdown tracebacks.

    vLLM 0.32's ``AsyncLLM.shutdown`` (``v1/engine/async_llm.py:296-308``) stops the engine cores first and
    cancels its output handler last, so the handler, still awaiting ``get_output_async``, meets the dead
    engines and logs ``EngineDeadError`` with a traceback (``async_llm.py:905-907``) after a run that
    succeeded. Here the handler is cancelled first, on its own loop, then vLLM's shutdown runs; afterwards
    the instance's ``shutdown`` is a no-op, so ``AsyncLLM.__del__`` (``async_llm.py:293-294``) does not run
    it again at interpreter exit, when module globals are gone (``TypeError: 'NoneType' object is not
    callable``, printed as an ignored exception). A handler that does not stop within ``timeout_s``
    seconds is left to vLLM's own cancel.
    """
    with contextlib.suppress(TimeoutError, RuntimeError):  # the loop may be closed already
        lt.run(_stop_output_handler(llm), timeout_s)
    llm.shutdown()
    llm.shutdown = lambda *args, **kwargs: None  # see above: vLLM's __del__ at interpreter exit


def connect_trainer(llm: Any, source: Any, *, client: Any, **info_fields: Any) -> Any:
    """weightsync's broadcast trainer for ``llm`` through vLLM's factory, with ``client`` (a
    ``VLLMWeightSyncClient``: :class:`~weightsync.vllm.clients.AsyncLLMWeightSyncClient`, or a checked
    one) and ``source`` (an ``nn.Module`` wrapped in vLLM's ``ModuleSource``); ``info_fields`` are
    :class:`~weightsync.vllm.trainer.WeightsyncTrainerInitInfo` fields (buffer sizes, ``timeout_s``...).

    Raises:
        ValueError: a field the workers would reject (from the init info).
    """
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.impl.engine.client import free_port
    from weightsync.vllm.trainer import WeightsyncTrainerInitInfo

    dp = int(llm.vllm_config.parallel_config.data_parallel_size)
    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=1 + dp, rank=0, **info_fields
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(source))


__all__ = ["START_TIMEOUT_S", "LoopThread", "connect_trainer", "shutdown_async_llm", "start_async_llm"]
