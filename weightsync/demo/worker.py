"""The demo's engine-side adapter: the engines' weight-transfer worker, with the probe and kill hooks.

The engine exposes no probe query, so the engines' transfer worker is :func:`demo_broadcast_worker` /
:func:`demo_ipc_worker` (named in ``EngineConfig.transfer``), a :class:`DemoWorker` around the real
:class:`~weightsync.impl.transfer.worker.WeightTransferWorker`. After each ``finish_weight_update`` it writes
the engine's probe logits to a file the trainer compares with its own; its ``init_info`` may carry the
demo-only keys ``demo_probe_dir`` and ``demo_kill`` (added by the client adapter,
:class:`weightsync.demo.guard.ClientGuard`, to the trainer's ``init_info``), stripped before the real worker
sees it.
"""

from __future__ import annotations

import os
import pathlib
import signal
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.transfer.base import ParallelInfo
from weightsync.impl.transfer.worker import WeightTransferWorker

__all__ = ["DemoWorker", "demo_broadcast_worker", "demo_ipc_worker"]


class _KillSwitchModel:
    """A model proxy whose ``load_weights`` SIGKILLs this process after the first loaded bucket when armed.

    Only the test-only kill hook uses it; otherwise every call goes straight to the model.
    """

    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self.armed = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self._model.load_weights(weights)
        if self.armed:  # mid-update: one bucket loaded, the rest still on the wire
            os.kill(os.getpid(), signal.SIGKILL)
        return loaded

    def checkpoint_weight_names(self) -> set[str]:
        return self._model.checkpoint_weight_names()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self._model.named_parameters()

    def process_weights_after_loading(self) -> None:
        self._model.process_weights_after_loading()

    def __getattr__(self, name: str) -> Any:  # checkpoint_weight_dtypes and anything else
        return getattr(self._model, name)


class DemoWorker:
    """The engines' weight-transfer worker in the demo: the real worker plus the probe and kill hooks.

    Args:
        model: the engine's reference LM.
        dp_index: the engine's DP index.
        backend: ``"nccl"`` (broadcast over gloo on CPU) or ``"ipc"`` (CPU shared memory).

    ``init_info`` may carry ``demo_probe_dir`` (after every finished round the engine writes its probe logits
    to ``<dir>/rank<dp_index>-round<k>.safetensors``, ``k`` = completed rounds) and ``demo_kill``
    (``{"rank": r, "round": k}``: rank ``r`` kills itself with SIGKILL after loading the first bucket of round
    ``k``). Both are removed before the real worker parses ``init_info``.
    """

    def __init__(self, model: CausalLM, dp_index: int, backend: str) -> None:
        self.model = model
        self.dp_index = dp_index
        self._proxy = _KillSwitchModel(model)
        kwargs: dict[str, Any] = {"device": "cpu"} if backend == "ipc" else {}
        self.inner = WeightTransferWorker(
            self._proxy, backend, ParallelInfo(dp_index=dp_index), name=f"engine {dp_index} worker", **kwargs
        )
        self.probe_dir: str | None = None
        self.kill: dict[str, int] | None = None
        self.rounds_started = 0

    @property
    def weight_version(self) -> int:
        """Completed rounds."""
        return self.inner.weight_version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Strip the demo keys, then join the transfer group (see the real worker for errors)."""
        info = dict(init_info)
        probe = info.pop("demo_probe_dir", None)
        kill = info.pop("demo_kill", None)
        self.inner.init_weight_transfer_engine(info)
        self.probe_dir = str(probe) if probe else None
        self.kill = {"rank": int(kill["rank"]), "round": int(kill["round"])} if kill else None

    def start_weight_update(self) -> None:
        """Open a round (the real worker's ``start_weight_update``)."""
        self.inner.start_weight_update()
        self.rounds_started += 1

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive the round's weights (arming the kill switch when this is the chosen rank and round)."""
        k = self.kill
        self._proxy.armed = k is not None and k["rank"] == self.dp_index and k["round"] == self.rounds_started
        self.inner.update_weights(update_info)

    def fail_round(self) -> None:
        """The round failed (the engine's table moved the rank to ``failed``): the real worker abandons it."""
        self.inner.fail_round()

    def fail_init(self) -> None:
        """The init failed: the real worker must be initialised again."""
        self.inner.fail_init()

    def finish_weight_update(self) -> None:
        """Close the round, then write this engine's probe logits (when ``demo_probe_dir`` was given)."""
        self.inner.finish_weight_update()
        if self.probe_dir is None:
            return
        from weightsync.demo.trainer import probe_prompt_tokens

        with torch.no_grad():
            logits = [t.detach().cpu() for t in self.model.probe_logits(probe_prompt_tokens())]
        path = (
            pathlib.Path(self.probe_dir) / f"rank{self.dp_index}-round{self.inner.weight_version}.safetensors"
        )
        tmp = path.with_suffix(".tmp")
        # safetensors, not torch.save: nothing the package reads back is unpickled
        save_file({str(i): t.contiguous() for i, t in enumerate(logits)}, str(tmp))
        os.replace(tmp, path)


def demo_broadcast_worker(model: CausalLM, dp_index: int) -> DemoWorker:
    """Engine transfer factory (``EngineConfig.transfer="weightsync.demo.worker:demo_broadcast_worker"``)."""
    return DemoWorker(model, dp_index, "nccl")


def demo_ipc_worker(model: CausalLM, dp_index: int) -> DemoWorker:
    """Engine transfer factory for the IPC transport (CPU shared memory)."""
    return DemoWorker(model, dp_index, "ipc")
