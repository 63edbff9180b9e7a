"""Completeness and recovery around vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``).

vLLM's checkpoint-format engines (the built-in ``nccl`` one: ``nccl_engine.py:159-173``) run
``initialize_layerwise_reload(model)`` at ``start_weight_update`` and ``finalize_layerwise_reload(model,
model_config)`` at ``finish_weight_update``. In between, every layer is on the meta device; its loaders
buffer the incoming tensors (``layerwise.py:185``, keeping references to them) and the layer is
materialised, loaded and processed once its element count is complete (``layerwise.py:217``).

Gaps, which weightsync closes:

1. **Silent partial updates.** ``finalize_layerwise_processing`` (``layerwise.py:255-275``) puts the *old*
   kernel tensors back for a layer that received nothing ("Failed to load weights", a log line), and runs
   a layer that received only part of its weights on freshly materialised, uninitialised memory. So a
   round missing a tensor silently serves a mix of old weights and garbage. :func:`incomplete_parameters`
   names what is missing before finalising, and the engine raises ``IncompleteUpdateError`` instead.
2. **Copies only where a buffer is reused.** A transport hands ``load_weights`` views of its receive
   buffers and reuses them for later buckets; the reload keeps the views of layers not yet complete.
   :func:`own_retained` copies exactly those, after each ``load_weights`` call.
3. **A failed round leaves the model on the meta device.** After an error inside ``update_weights`` the
   worker marks the round inactive (``v1/worker/gpu_worker.py:1583``), but the layers stay on meta with
   their buffered tensors, and the next ``initialize_layerwise_reload`` skips them (``layerwise.py:105``),
   replaying the stale buffers. :func:`abandon_layerwise_reload` puts every pending layer's kernel tensors
   back (their last complete values) and clears its state.
4. **Fused-MoE experts left in checkpoint layout (vLLM 0.32).** On a reload,
   ``UnquantizedFusedMoEMethod._setup_kernel`` sees ``moe_kernel`` already built (``is_weight_update``,
   ``model_executor/layers/fused_moe/unquantized_fused_moe_method.py:187``) and skips
   ``self.moe_kernel.fused_experts.process_weights_after_loading(layer)`` (``:191-203``), where the CPU
   experts prepack ``w13_weight`` / ``w2_weight`` into their grouped-GEMM layout
   (``fused_moe/experts/cpu_moe.py:208-217``, ``cpu_prepack_moe_weight``: same shape, other layout). The
   layer's kernel tensors then receive the checkpoint layout (``layerwise.py:425``) and every MoE forward
   after any update, even of identical weights, computes with scrambled experts (greedy tokens and
   prompt logprobs change; ``tests/test_vllm_moe.py`` measures it through vLLM's own
   ``reload_weights``). :func:`reprocess_fused_moe` re-runs that skipped step after
   ``finalize_layerwise_reload``, in place (the tensors keep their storage, as vLLM's reload does for CUDA
   graphs). :func:`moe_reload_fix_applies` says where it is needed: vLLM 0.32.x on CPU.
"""

from __future__ import annotations

from typing import Any

import torch


def _info(layer: torch.nn.Module) -> Any:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return LAYERWISE_INFO.get(layer)


def _loadable_numel(layer: torch.nn.Module, name: str, p: torch.Tensor, numel: Any) -> int:
    """Elements of parameter ``name`` of ``layer`` that a checkpoint can fill: vLLM's
    ``get_tensor_load_numel`` (padding its weight creator declares), and for a vocabulary-parallel
    embedding or LM head the real rows only: vLLM pads the vocabulary to a multiple of 64
    (``vocab_parallel_embedding.py:95`` ``pad_vocab_size``) without declaring it, and its reload processes
    such a layer at the end (``reload/layerwise.py:268-274``, "did not load all elements")."""
    si = getattr(layer, "shard_indices", None)
    if si is not None and name == "weight" and p.dim() == 2:
        return (int(si.num_org_elements) + int(si.num_added_elements)) * int(p.shape[1])
    return int(numel(p))


def incomplete_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters of layers still waiting for weights in the current layerwise reload.

    A layer counts when vLLM's reload still holds it (``info.can_load()``: not yet processed) and it has
    parameters (``_parameters``, except the never-loaded ``SKIP_LOAD_TENSORS``) whose loadable elements
    (:func:`_loadable_numel`: a padded vocabulary's padding rows excluded) were not all received; buffers never count (rotary caches are not in checkpoints). Each entry is the
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
        want = sum(_loadable_numel(layer, n, p, get_tensor_load_numel) for n, p in params.items())
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


def own_retained(model: torch.nn.Module, batch: list[tuple[str, torch.Tensor]]) -> int:
    """Copy out of ``batch``'s memory every tensor the open layerwise reload still holds from it, so the
    caller may reuse that memory for the next bucket. Returns the number of tensors copied.

    vLLM's reload buffers each loader call of a layer not yet complete: ``info.loaded_weights`` keeps the
    call's bound arguments, the incoming tensor among them, until the layer's last weight arrives and
    ``_layerwise_process`` replays them (vLLM 0.32 ``reload/layerwise.py:185``, ``:217``, ``:366-369``).
    A tensor there that shares storage with a tensor of ``batch`` (the view itself, or a slice a loader
    took of it) is replaced by a copy, in place in the bound arguments; everything a completed layer
    consumed is not copied at all. With the model's weights in layer order only a layer straddling two
    buckets is copied (typically a few tensors per bucket instead of all of them).
    """
    ptrs = {t.untyped_storage().data_ptr() for _, t in batch if t.device.type != "meta"}
    if not ptrs:
        return 0
    copied = 0
    for layer in model.modules():
        info = _info(layer)
        if info is None or not info.can_load() or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            args = bound.arguments
            for name, value in list(args.items()):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in ptrs:
                    args[name] = value.clone()
                    copied += 1
    return copied


def reload_pending(model: torch.nn.Module) -> bool:
    """Whether some layer of ``model`` is inside an unfinished layerwise reload."""
    return any((i := _info(layer)) is not None and i.can_load() for layer in model.modules())


#: vLLM releases whose ``_setup_kernel`` skips the experts' processing on a weight update (fix 3).
MOE_RELOAD_BUG_VERSIONS = ("0.32.",)


def fused_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` run by vLLM's unquantized fused-MoE method with its kernel built (so a
    reload takes the ``is_weight_update`` branch of ``_setup_kernel``)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return [
        layer
        for layer in model.modules()
        if isinstance(m := getattr(layer, "quant_method", None), UnquantizedFusedMoEMethod)
        and getattr(m, "moe_kernel", None) is not None
    ]


def moe_reload_fix_applies(device: torch.device, requested: bool | None = None) -> bool:
    """Whether :func:`reprocess_fused_moe` runs after a reload: ``requested`` when it is a bool (the
    ``moe_reload_fix`` init option), else (auto) on a CPU device under a vLLM of
    :data:`MOE_RELOAD_BUG_VERSIONS` (read from its source; on other devices and versions the skipped
    step is left to vLLM)."""
    if requested is not None:
        return requested
    import vllm

    version = str(getattr(vllm, "__version__", ""))
    return device.type == "cpu" and version.startswith(MOE_RELOAD_BUG_VERSIONS)


def moe_layers_reprocessable(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Of ``layers``, those whose weights the open reload will process (call before
    ``finalize_layerwise_reload``): a layer still pending with nothing loaded gets its old kernel
    tensors back (``layerwise.py:256-267``), already in kernel layout, and must not be processed again."""
    out = []
    for layer in layers:
        info = _info(layer)
        if info is not None and info.can_load() and int(info.load_numel) <= 0:
            continue
        out.append(layer)
    return out


@torch.no_grad()
def reprocess_fused_moe(layers: list[torch.nn.Module]) -> int:
    """Re-run the fused-MoE experts' ``process_weights_after_loading`` that vLLM 0.32 skips on a weight
    update (fix 3) on each of ``layers`` (just reloaded, so in checkpoint layout), keeping every
    parameter's storage: a replaced parameter of the same shape, dtype and device is copied back into
    the old one. Returns the number of layers processed."""
    for layer in layers:
        method: Any = layer.quant_method
        before = dict(layer._parameters)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        for name, new in list(layer._parameters.items()):
            old = before.get(name)
            if old is None or new is None or new is old:
                continue
            if old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
                old.data.copy_(new.data)
                layer._parameters[name] = old
    return len(layers)


__all__ = [
    "MOE_RELOAD_BUG_VERSIONS",
    "abandon_layerwise_reload",
    "fused_moe_layers",
    "incomplete_parameters",
    "moe_layers_reprocessable",
    "moe_reload_fix_applies",
    "own_retained",
    "reload_pending",
    "reprocess_fused_moe",
]
