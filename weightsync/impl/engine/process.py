"""The process entry point of one engine rank: build the configured engine core (``EngineConfig.core``, default
:class:`~weightsync.impl.engine.core.EngineCore`), report it ready (or its startup failure), run its loop."""

from __future__ import annotations

import importlib
import os
import traceback

from weightsync.impl.engine.config import EngineConfig, EngineQueues
from weightsync.impl.engine.core import EngineCore
from weightsync.impl.engine.messages import (
    EngineFailure,
    UtilityReply,
)


def run_engine(cfg: EngineConfig, rank: int, queues: EngineQueues) -> None:
    """Process entry point of one engine rank (``torch.multiprocessing`` spawn target)."""
    try:
        cls = EngineCore
        if cfg.core:
            mod, _, name = cfg.core.partition(":")
            cls = getattr(importlib.import_module(mod), name)
        core = cls(cfg, rank, queues)
    except Exception as exc:
        queues.out.put(
            EngineFailure(
                rank,
                "startup",
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                type(exc).__name__,
                "",
                -1,
                (),
                {},
                "running",
            )
        )
        return
    queues.out.put(UtilityReply(rank, -1, {"ready": True, "pid": os.getpid()}))
    core.run()


__all__ = ["run_engine"]
