"""Roles for ``transfer_procs.run_roles``: weightsync's CPU ``all_gatherv`` / ``reduce_scatterv``
(``weightsync.vllm.cpu_collectives``) on a real 2-process gloo group, against what each rank computes
alone from every rank's (seeded) inputs. Imports no vLLM (the functions take any object with
``world_size``, ``rank_in_group`` and ``device_group``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

SIZES = [3, 1]


def inputs(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors: ``SIZES[rank]`` rows of hidden states (float32), top-k ids (int32) and a
    column-split tensor (rows along dim 1), plus a full-size tensor to reduce-scatter."""
    g = torch.Generator().manual_seed(100 + rank)
    n = SIZES[rank]
    return {
        "hidden": torch.randn(n, 5, generator=g),
        "ids": torch.randint(0, 4, (n, 2), generator=g, dtype=torch.int32),
        "cols": torch.randn(2, n, generator=g),
        "combine": torch.randn(sum(SIZES), 5, generator=g),
        "even": torch.randn(4, 3, generator=g),
    }


def expected(rank: int) -> dict[str, torch.Tensor]:
    every = [inputs(r) for r in range(len(SIZES))]
    start = sum(SIZES[:rank])
    total = sum(x["combine"] for x in every)
    even = sum(x["even"] for x in every)
    assert isinstance(total, torch.Tensor) and isinstance(even, torch.Tensor)
    return {
        "hidden": torch.cat([x["hidden"] for x in every]),
        "ids": torch.cat([x["ids"] for x in every]),
        "cols": torch.cat([x["cols"] for x in every], dim=1),
        "combine": total[start : start + SIZES[rank]],
        "even": even[2 * rank : 2 * rank + 2],
        "empty": torch.empty(0, 5),
    }


def collectives_role(rank: int, port: int) -> dict[str, Any]:
    """Run both collectives on rank ``rank`` of a 2-process gloo group; return what they gave, and the
    input of ``reduce_scatterv`` afterwards (it must be unchanged)."""
    from weightsync.vllm.cpu_collectives import all_gatherv, reduce_scatterv

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm = SimpleNamespace(world_size=2, rank_in_group=rank, device_group=dist.group.WORLD)
        x = inputs(rank)
        before = x["combine"].clone()
        hidden, ids = all_gatherv(comm, [x["hidden"], x["ids"]], dim=0, sizes=SIZES)
        cols = all_gatherv(comm, x["cols"], dim=1, sizes=SIZES)
        combine = reduce_scatterv(comm, x["combine"], dim=0, sizes=SIZES)
        even = reduce_scatterv(comm, x["even"], dim=0)
        empty = all_gatherv(comm, torch.empty(0, 5), dim=0, sizes=[0, 0])
        return {
            "got": {
                "hidden": hidden,
                "ids": ids,
                "cols": cols,
                "combine": combine,
                "even": even,
                "empty": empty,
            },
            "want": expected(rank),
            "input_unchanged": bool(torch.equal(before, x["combine"])),
        }
    finally:
        dist.destroy_process_group()
