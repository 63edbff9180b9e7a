"""weightsync's trainer side for vLLM 0.32: subclasses of vLLM's ``TrainerWeightTransferEngine``.

``WeightsyncBroadcastTrainer`` (backend ``weightsync``) and ``WeightsyncIPCTrainer`` (``weightsync_ipc``)
are built by ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` from a
:class:`WeightsyncTrainerInitInfo` / :class:`WeightsyncIPCTrainerInitInfo` (whose class attribute
``backend`` selects them) and driven by ``send_weights()``, exactly like vLLM's own NCCL trainer
(``distributed/weight_transfer/nccl_engine.py:236-461``). They are weightsync's engine-agnostic trainers
(:mod:`weightsync.impl.transfer.trainer`: the handshake, one round per ``send_weights``, sources streamed
and never materialised, multi-rank trainers; its rules 1-5), which drive weightsync's reference engine
too; here they are also vLLM's classes, take vLLM's ``ModuleSource`` for an ``nn.Module`` and send the
workers :class:`~weightsync.vllm.engine.WeightsyncInitInfo`'s fields. Backend ``weightsync`` packs in vLLM's
layout by default (``layout="vllm"``), ``weightsync_ipc`` in weightsync's (``"aligned"``). Importing this
module registers the plugin's backends in this process (the trainer process loads no vLLM plugins by
itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from weightsync.impl.transfer.trainer import (
    BroadcastTrainerEngine,
    IPCTrainerEngine,
    IPCTrainerInitInfo,
    concurrently,
    update_info_of,
)
from weightsync.impl.transfer.trainer import TrainerInitInfo as _TrainerInitInfo
from weightsync.vllm.engine import MoeReloadOption, WeightsyncInitInfo


@dataclass(kw_only=True)
class WeightsyncTrainerInitInfo(_TrainerInitInfo, MoeReloadOption, TrainerInitInfo):
    """Trainer-side init info of backend ``weightsync``: weightsync's
    :class:`~weightsync.impl.transfer.trainer.TrainerInitInfo` (vLLM's ``NCCLTrainerInitInfo`` fields plus
    weightsync's optional ones) and ``moe_reload_fix``, as a vLLM ``TrainerInitInfo`` (keyword-only
    ``rank``, 0 sends).

    Raises:
        ValueError: a field the workers would reject.
    """

    backend: ClassVar[str] = "weightsync"
    worker_info_cls: ClassVar[type[Any]] = WeightsyncInitInfo


@dataclass(kw_only=True)
class WeightsyncIPCTrainerInitInfo(IPCTrainerInitInfo, WeightsyncTrainerInitInfo):
    """Trainer-side init info of backend ``weightsync_ipc`` (``device``: where the shared buffers live)."""

    backend: ClassVar[str] = "weightsync_ipc"


class WeightsyncBroadcastTrainer(BroadcastTrainerEngine, TrainerWeightTransferEngine):
    """Trainer side of backend ``weightsync`` (packed broadcast, rank 0 hosts the TCPStore)."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncTrainerInitInfo
    default_layout: ClassVar[str] = "vllm"
    module_source: ClassVar[Any] = ModuleSource


class WeightsyncIPCTrainer(IPCTrainerEngine, TrainerWeightTransferEngine):
    """Trainer side of backend ``weightsync_ipc`` (the producer owns the shared buffers)."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncIPCTrainerInitInfo
    default_layout: ClassVar[str] = "aligned"
    module_source: ClassVar[Any] = ModuleSource


def _register() -> None:
    from weightsync.vllm.plugin import register

    register()


_register()

__all__ = [
    "WeightsyncBroadcastTrainer",
    "WeightsyncIPCTrainer",
    "WeightsyncIPCTrainerInitInfo",
    "WeightsyncTrainerInitInfo",
    "concurrently",
    "update_info_of",
]
