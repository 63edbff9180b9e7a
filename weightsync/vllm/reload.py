"""Completeness and recovery around vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``).

vLLM's checkpoint-format engines (the built-in ``nccl`` one: ``nccl_engine.py:159-173``) run
``initialize_layerwise_reload(model)`` at ``start_weight_update`` and ``finalize_layerwise_reload(model,
model_config)`` at ``finish_weight_update``. In between, every layer is on the meta device; its loaders
buffer the incoming tensors (``layerwise.py:185``, keeping references to them) and the layer is
materialised, loaded and processed once its element count is complete (``layerwise.py:217``).

Two gaps, which weightsync closes:

1. **Silent partial updates.** ``finalize_layerwise_processing`` (``layerwise.py:255-275``) puts the *old*
   kernel tensors back for a layer that received nothing ("Failed to load weights", a log line), and runs
   a layer that received only part of its weights on freshly materialised, uninitialised memory. So a
   round missing a tensor silently serves a mix of old weights and garbage. :func:`incomplete_parameters`
   names what is missing before finalising, and the engine raises ``IncompleteUpdateError`` instead.
2. **A failed round leaves the model on the meta device.** After an error inside ``update_weights`` the
   worker marks the round inactive (``v1/worker/gpu_worker.py:1583``), but the layers stay on meta with
   their buffered tensors, and the next ``initialize_layerwise_reload`` skips them (``layerwise.py:105``),
   replaying the stale buffers. :func:`abandon_layerwise_reload` puts every pending layer's kernel tensors
   back (their last complete values) and clears its state.
"""

from __future__ import annotations

from typing import Any

import torch


def _info(layer: torch.nn.Module) -> Any:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return LAYERWISE_INFO.get(layer)


def incomplete_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters of layers still waiting for weights in the current layerwise reload.

    A layer counts when vLLM's reload still holds it (``info.can_load()``: not yet processed) and it has
    parameters (``_parameters``, except the never-loaded ``SKIP_LOAD_TENSORS``) whose loadable elements
    were not all received; buffers never count (rotary caches are not in checkpoints). Each entry is the
    parameter's qualified name, with ``(partial: loaded/total elements)`` when some of it arrived.
    """
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    missing: list[str] = []
    for qual, layer in model.named_modules():
        info = _info(layer)
        if info is None or not info.can_load():
            continue
        params = {n: p for n, p in layer._parameters.items() if p is not None and n not in SKIP_LOAD_TENSORS}
        want = sum(int(get_tensor_load_numel(p)) for p in params.values())
        got = int(info.load_numel)
        if want == 0 or got >= want:
            continue
        touched = {name for name, _ in info.loaded_weights}
        prefix = f"{qual}." if qual else ""
        for n in params:
            if n not in touched:
                missing.append(f"{prefix}{n}")
            else:
                missing.append(f"{prefix}{n} (partial: {got}/{want} elements of the layer)")
    return missing


def abandon_layerwise_reload(model: torch.nn.Module) -> int:
    """Undo an unfinished layerwise reload: every layer still pending gets its kernel tensors back (the
    values of the last completed round) and its reload state is cleared. Returns the number of layers
    restored. Uses ``layerwise._place_kernel_tensors`` (vLLM 0.32, ``layerwise.py:436``)."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

    restored = 0
    for layer in model.modules():
        info = _info(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored


def reload_pending(model: torch.nn.Module) -> bool:
    """Whether some layer of ``model`` is inside an unfinished layerwise reload."""
    return any((i := _info(layer)) is not None and i.can_load() for layer in model.modules())


__all__ = ["abandon_layerwise_reload", "incomplete_parameters", "reload_pending"]
