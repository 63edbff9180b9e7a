"""The vLLM general plugin: registers weightsync's backends in vLLM's weight-transfer factories.

vLLM runs every function of the entry-point group ``vllm.general_plugins`` in the front-end, in every
EngineCore and in every worker before the model loads (``vllm/plugins/__init__.py:load_general_plugins``;
the DP coordinator loads none), and possibly several times per process, so :func:`register` is
idempotent: vLLM's factories raise ``ValueError`` on a duplicate name
(``vllm/distributed/weight_transfer/factory.py:63``), so a name already registered is checked to be ours
and left alone. Registration is by module path (vLLM imports the backend class lazily, on first use).

It also supplies, on vLLM 0.32.x only, the two collectives the CPU communicator lacks (MoE with data
parallelism > 1 needs them: :mod:`weightsync.vllm.cpu_collectives`), since the plugin runs in every worker.

On vLLM 0.32.x it installs weightsync's patch series by default (:mod:`weightsync.vllm_tools.fix`: the
methods ``weightsync/patches/vllm-0.32/000*.patch`` change in ``DPEngineCoreProc``, ``ParallelConfig`` and
the worker, for the one source tree the series was made against; ``WEIGHTSYNC_VLLM_FIX=none`` runs vLLM as
shipped). Then an opt-in
hook acts only when its environment variable is set (the engine processes inherit the driver's
environment): the protocol-event probe (:mod:`weightsync.vllm_tools.probe`,
``WEIGHTSYNC_VLLM_EVENTS=<dir>``), which wraps whichever methods are installed, patched or not.
"""

from __future__ import annotations

import importlib
from typing import Any

#: backend -> (engine module, engine class, trainer module, trainer class)
_BACKENDS: dict[str, tuple[str, str, str, str]] = {
    "weightsync": (
        "weightsync.vllm.engine",
        "WeightsyncBroadcastEngine",
        "weightsync.vllm.trainer",
        "WeightsyncBroadcastTrainer",
    ),
    "weightsync_ipc": (
        "weightsync.vllm.engine",
        "WeightsyncIPCEngine",
        "weightsync.vllm.trainer",
        "WeightsyncIPCTrainer",
    ),
}


def _register_one(factory: Any, name: str, module: str, cls_name: str) -> None:
    registry: dict[str, Any] = getattr(factory, "_registry", {})
    if name in registry:
        existing = registry[name]()
        if existing is not getattr(importlib.import_module(module), cls_name):
            raise RuntimeError(
                f"vLLM's {factory.__name__} already has a backend {name!r} ({existing.__module__}."
                f"{existing.__qualname__}), not weightsync's {module}.{cls_name}"
            )
        return
    try:
        factory.register_engine(name, module, cls_name)
    except ValueError:  # registered concurrently between the check and here: fine, it is a duplicate
        if name not in getattr(factory, "_registry", {name: None}):
            raise


def register() -> None:
    """Register ``weightsync`` and ``weightsync_ipc`` in ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory``, and install the CPU communicator's missing collectives where this
    vLLM lacks them (:func:`weightsync.vllm.cpu_collectives.install`); calling it again is a no-op.

    Raises:
        RuntimeError: another package already registered one of these names with its own class; or
            the fix is chosen (the default on vLLM 0.32.x) and cannot be installed, e.g. the installed
            ``core.py`` is not the patch's source (:func:`weightsync.vllm_tools.fix.install_from_env`).
        ValueError: ``WEIGHTSYNC_VLLM_FIX`` or ``WEIGHTSYNC_VLLM_HOLD`` has a value the hooks do not know.
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from weightsync.vllm import cpu_collectives
    from weightsync.vllm_tools import fix, probe

    for name, (emod, ecls, tmod, tcls) in _BACKENDS.items():
        _register_one(WeightTransferEngineFactory, name, emod, ecls)
        _register_one(WeightTransferTrainerFactory, name, tmod, tcls)
    cpu_collectives.install()
    fix.install_from_env()
    probe.install()


__all__ = ["register"]
