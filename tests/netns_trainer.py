"""``python tests/netns_trainer.py URL MODEL_DIR WORK_DIR MASTER_ADDRESS MASTER_PORT TIMEOUT_S``: the trainer
of ``test_vllm_netns.py``, run inside its own network namespace (``ip netns exec``). Test helper only.

It reads the deployment's secret from its own environment (``WEIGHTSYNC_TOKEN_FILE``), as the server does.
It talks to the ``vllm serve`` at ``URL`` only through vLLM's public trainer API
(``WeightTransferTrainerFactory.trainer_init`` with weightsync's init info, ``HTTPVLLMWeightSyncClient``)
and the server's HTTP routes, and hosts the weight-transfer rendezvous at ``MASTER_ADDRESS:MASTER_PORT``.
It reports one JSON object a line on stdout:

1. ``{"event": "round", ...}``: the weights of ``WORK_DIR/new1.pt`` sent as round ``step-1`` (bracketed
   by ``/pause?mode=keep`` and ``/resume``): the round's seconds, the server's weight version, its greedy
   tokens and prompt logprobs of every probe before and after; the sent weights are saved to
   ``WORK_DIR/sent1.pt``. Then it waits for a line on stdin (the test lets a second trainer, without the
   deployment's secret, try to take the engines over in between).
2. ``{"event": "mid-round", ...}``: the second round (``new2.pt``, ``step-2``) is inside ``update_weights``
   with half of its tensors pulled; the source then waits for a line on stdin (the test cuts the link and
   then writes it) and goes on.
3. ``{"event": "error", ...}`` (what ``send_weights`` raised, when, and the ``monotonic()`` time the line
   arrived) or ``{"event": "no-error"}``; then it exits at once (``os._exit``: the update's HTTP request
   is still blocked on the cut link, and the interpreter would wait for its thread).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import LlamaForCausalLM
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm_served import BUFFER, PROBES
from vllm_server import ServerAPI

from weightsync.vllm.trainer import WeightsyncTrainerInitInfo


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


class PausingSource(ModuleSource):
    """vLLM's ``ModuleSource`` that calls ``pause()`` once, before yielding tensor ``at``."""

    def __init__(self, module: torch.nn.Module, at: int, pause: Callable[[], None]) -> None:
        super().__init__(module)
        self.at = at
        self.pause = pause

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().__iter__()):
            if i == self.at:
                self.pause()
            yield item


def probes(api: ServerAPI) -> dict[str, Any]:
    return {
        "greedy": [api.greedy(p) for p in PROBES],
        "prompt_logprobs": [api.prompt_logprobs(p) for p in PROBES],
    }


def main() -> None:
    url, model_dir, work, master, port, timeout_s = sys.argv[1:7]
    out = pathlib.Path(work)
    api = ServerAPI(url, model_dir)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = WeightsyncTrainerInitInfo(
        master_address=master,
        master_port=int(port),
        world_size=2,
        rank=0,
        packed_buffer_size_bytes=BUFFER,
        timeout_s=float(timeout_s),
    )
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    before = probes(api)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(hf))

    hf.load_state_dict(torch.load(out / "new1.pt"))
    t0 = time.monotonic()
    api.post("/pause", params={"mode": "keep"})
    trainer.send_weights(weight_version="step-1")
    api.post("/resume")
    round_s = time.monotonic() - t0
    torch.save({n: p.detach().clone() for n, p in hf.named_parameters()}, out / "sent1.pt")
    emit(event="round", round_s=round_s, version=api.weight_info(), before=before, after=probes(api))
    sys.stdin.readline()

    hf.load_state_dict(torch.load(out / "new2.pt"))
    n = len(list(hf.named_parameters()))
    resumed: list[float] = []

    def pause() -> None:
        emit(event="mid-round", pulled=n // 2, of=n)
        sys.stdin.readline()
        resumed.append(time.monotonic())

    api.post("/pause", params={"mode": "keep"})
    try:
        trainer.send_weights(PausingSource(hf, n // 2, pause), weight_version="step-2")
    except Exception as exc:
        emit(
            event="error",
            type=type(exc).__name__,
            message=str(exc),
            missing_ranks=list(getattr(exc, "missing_ranks", [])),
            phase=getattr(exc, "phase", None),
            resumed_at=resumed[0] if resumed else None,
            raised_at=time.monotonic(),
        )
    else:
        emit(event="no-error")
    os._exit(0)


if __name__ == "__main__":
    main()
