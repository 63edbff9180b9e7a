"""The two collectives vLLM 0.32's CPU communicator lacks, supplied over its gloo device group.

A MoE model with data parallelism > 1 runs its experts through the naive all-to-all manager
(``distributed/device_communicators/all2all.py:118, 148, 172, 204``: ``all_gatherv`` to dispatch,
``reduce_scatterv`` to combine). ``CpuCommunicator`` (``device_communicators/cpu_communicator.py``)
inherits both from ``DeviceCommunicatorBase``, where they raise ``NotImplementedError``
(``base_device_communicator.py:290-296, 331-334``), so on CPU the first MoE forward of a DP > 1 engine
fails. :func:`install` gives ``CpuCommunicator`` both, with the semantics of the CUDA and XPU ones
(``cuda_communicator.py:533-660, 884-948``; ``xpu_communicator.py:101-205``):

- ``all_gatherv(input_, dim=0, sizes=None)``: ``input_`` (a tensor or a list of tensors, each of
  ``sizes[rank]`` along ``dim``; ``sizes=None``: equal on every rank) gathered from every rank and
  concatenated along ``dim`` in rank order. Over gloo: pad to the largest size, one
  ``all_gather_into_tensor`` per tensor, drop the padding.
- ``reduce_scatterv(input_, dim=-1, sizes=None)``: the element-wise sum over ranks of ``input_``
  (``sum(sizes)`` along ``dim``), of which this rank keeps its ``sizes[rank]`` slice. gloo has no
  reduce-scatter: one ``all_reduce`` of a copy, then the slice (the caller's tensor is not modified).

``install`` is version-gated and idempotent: it changes nothing unless vLLM is a 0.32.x release
(:data:`VERSIONS`, read from that source) and the class still has the base's raising method; a method a
later vLLM provides is never replaced. vLLM runs general plugins in every worker before the model loads
(``plugins/__init__.py``), so the plugin's ``register`` calls it there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: vLLM releases whose CPU communicator lacks the two collectives (read from 0.32.0's source).
VERSIONS = ("0.32.",)
#: set on ``CpuCommunicator`` once :func:`install` added the methods
MARKER = "_weightsync_cpu_collectives"


def _sizes(comm: Any, local: int, sizes: list[int] | None) -> list[int]:
    world = int(comm.world_size)
    if sizes is None:
        return [local] * world
    if len(sizes) != world:
        raise ValueError(f"sizes has {len(sizes)} entries for a group of {world} ranks")
    return [int(s) for s in sizes]


def _gather_one(comm: Any, tensor: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
    d = dim + tensor.dim() if dim < 0 else dim
    world, rank = int(comm.world_size), int(comm.rank_in_group)
    x = tensor.movedim(d, 0)
    sz = _sizes(comm, int(x.shape[0]), sizes)
    if x.shape[0] != sz[rank]:
        raise ValueError(
            f"all_gatherv: rank {rank} holds {x.shape[0]} rows along dim {d}, sizes say {sz[rank]}"
        )
    biggest = max(sz)
    if biggest == 0:  # every rank empty (all ranks see the same sizes): nothing to exchange
        return x.new_empty((0, *x.shape[1:])).movedim(0, d).contiguous()
    padded = x.new_zeros((biggest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((world * biggest, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=comm.device_group)
    parts = [out[r * biggest : r * biggest + sz[r]] for r in range(world)]
    return torch.cat(parts, dim=0).movedim(0, d).contiguous()


def all_gatherv(
    self: Any,
    input_: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    sizes: list[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Variable-size all-gather over ``self.device_group`` (the module docstring's semantics)."""
    if isinstance(input_, torch.Tensor):
        return _gather_one(self, input_, dim, sizes)
    return [_gather_one(self, t, dim, sizes) for t in input_]


def reduce_scatterv(
    self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """Variable-size reduce-scatter (sum) over ``self.device_group`` (the module docstring's semantics)."""
    world, rank = int(self.world_size), int(self.rank_in_group)
    d = dim + input_.dim() if dim < 0 else dim
    x = input_.movedim(d, 0)
    if sizes is None:
        if x.shape[0] % world:
            raise ValueError(
                f"reduce_scatterv: {x.shape[0]} rows along dim {d} do not split over {world} ranks"
            )
        sz = [x.shape[0] // world] * world
    else:
        sz = _sizes(self, 0, sizes)
        if sum(sz) != x.shape[0]:
            raise ValueError(f"reduce_scatterv: {x.shape[0]} rows along dim {d}, sizes sum to {sum(sz)}")
    total = x.contiguous().clone()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sz[:rank])
    return total[start : start + sz[rank]].movedim(0, d).contiguous()


def needed() -> bool:
    """Whether this vLLM is a release of :data:`VERSIONS` whose ``CpuCommunicator`` still has the base
    class's raising ``all_gatherv`` or ``reduce_scatterv``."""
    import vllm

    if not str(getattr(vllm, "__version__", "")).startswith(VERSIONS):
        return False
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    return any(
        getattr(CpuCommunicator, name) is getattr(DeviceCommunicatorBase, name)
        for name in ("all_gatherv", "reduce_scatterv")
    )


def install() -> bool:
    """Give ``CpuCommunicator`` the missing collectives where :func:`needed`; idempotent. Returns
    whether they are weightsync's after the call."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(CpuCommunicator, MARKER, False):
        return True
    if not needed():
        return False
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    for name, fn in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if getattr(CpuCommunicator, name) is getattr(DeviceCommunicatorBase, name):  # absent: supply it
            setattr(CpuCommunicator, name, fn)
    setattr(CpuCommunicator, MARKER, True)
    return True


__all__ = ["MARKER", "VERSIONS", "all_gatherv", "install", "needed", "reduce_scatterv"]
