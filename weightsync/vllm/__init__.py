"""weightsync inside the real vLLM (0.32): what vLLM loads. With :mod:`weightsync.vllm_tools`
(our tools around a running vLLM) and :mod:`weightsync.repro.vllm` (the race on a running vLLM), the only
packages that import ``vllm``.

- :mod:`weightsync.vllm.plugin`: the vLLM general plugin (entry point group ``vllm.general_plugins``, name
  ``weightsync``). Its ``register()`` registers weightsync's transports in vLLM's
  ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory`` as backends ``weightsync`` (packed
  broadcast: gloo for CPU tensors, NCCL for CUDA) and ``weightsync_ipc`` (shared memory on CPU, CUDA IPC
  on GPU). Select one with ``weight_transfer_config={"backend": "weightsync"}`` on ``AsyncLLM`` / ``LLM``
  or ``--weight-transfer-config '{"backend": "weightsync"}'`` on ``vllm serve``.
- :mod:`weightsync.vllm.engine`: the engine-worker backends (subclasses of vLLM's ``WeightTransferEngine``)
  and their request dataclasses, which accept vLLM's own request dicts.
- :mod:`weightsync.vllm.trainer`: the trainer side (subclasses of vLLM's ``TrainerWeightTransferEngine``).
- :mod:`weightsync.vllm.reload`: completeness and recovery around vLLM's layerwise reload, and the fused-MoE
  experts restored after it (vLLM 0.32 on CPU leaves them in checkpoint layout).
- :mod:`weightsync.vllm.cpu_collectives`: ``all_gatherv`` / ``reduce_scatterv`` for vLLM 0.32's CPU
  communicator (MoE with data parallelism > 1), installed by the plugin.
- :mod:`weightsync.vllm.clients`: a ``VLLMWeightSyncClient`` for an in-process ``AsyncLLM``.

Importing this package itself imports nothing of vLLM; its modules do.
"""

from __future__ import annotations

#: The backend names this plugin registers.
BACKENDS = ("weightsync", "weightsync_ipc")

__all__ = ["BACKENDS"]
