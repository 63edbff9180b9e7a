"""A weight-transfer worker factory for the engine tests that injects one failure into a real worker.

``EngineConfig(transfer="faulty_worker:faulty_broadcast_worker")`` gives each engine the real broadcast
worker (:func:`weightsync.impl.transfer.worker.broadcast_worker`). A file ``<dir>/<call>-<rank>`` in the
directory named by the environment variable ``WEIGHTSYNC_TEST_FAULTS`` makes the next ``<call>`` on engine
``<rank>`` raise ``RuntimeError("injected failure in <call>")``; the file is removed, so the fault fires
once. ``update_weights`` raises *after* the real receive (the weights are then partial from the table's
point of view); the other calls raise before the real call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from weightsync.impl.transfer.worker import broadcast_worker

ENV = "WEIGHTSYNC_TEST_FAULTS"


class FaultyWorker:
    """Delegates to a real worker; raises once per armed ``<call>-<rank>`` file."""

    def __init__(self, inner: Any, rank: int) -> None:
        self.inner = inner
        self.rank = rank

    def _armed(self, call: str) -> bool:
        d = os.environ.get(ENV)
        if not d:
            return False
        f = Path(d) / f"{call}-{self.rank}"
        if f.exists():
            f.unlink()
            return True
        return False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if self._armed("init"):
            raise RuntimeError("injected failure in init")
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        if self._armed("start"):
            raise RuntimeError("injected failure in start")
        self.inner.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.inner.update_weights(update_info)
        if self._armed("update"):
            raise RuntimeError("injected failure in update")

    def finish_weight_update(self) -> None:
        if self._armed("finish"):
            raise RuntimeError("injected failure in finish")
        self.inner.finish_weight_update()

    def fail_round(self) -> None:
        self.inner.fail_round()

    def fail_init(self) -> None:
        self.inner.fail_init()


def faulty_broadcast_worker(model: Any, dp_index: int) -> FaultyWorker:
    """Factory for ``EngineConfig.transfer`` (see the module docstring)."""
    return FaultyWorker(broadcast_worker(model, dp_index), dp_index)
