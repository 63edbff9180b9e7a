"""``python tests/netns_rogue.py URL MASTER_ADDRESS MASTER_PORT TIMEOUT_S``: a second trainer without the
deployment's secret, run in the legitimate trainer's network namespace by ``test_vllm_netns.py``. Test
helper only.

It does what any process that reaches the server's HTTP API can do (vLLM's ``/init_weight_transfer_engine``
is unauthenticated): host its own rendezvous (``allow_unauthenticated=True``, the explicit opt-out of the
policy) and call ``init_weight_transfer_engine`` through vLLM's ``HTTPVLLMWeightSyncClient``, so that the
engines join *its* group. It prints one JSON line: ``{"event": "rogue", "joined": bool, "type", "message"}``.
"""

from __future__ import annotations

import json
import os
import sys

from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

from weightsync.vllm.trainer import WeightsyncTrainerInitInfo


def main() -> None:
    url, master, port, timeout_s = sys.argv[1:5]
    assert not os.environ.get("WEIGHTSYNC_TOKEN_FILE") and not os.environ.get("WEIGHTSYNC_TOKEN")
    info = WeightsyncTrainerInitInfo(
        master_address=master,
        master_port=int(port),
        world_size=2,
        rank=0,
        timeout_s=float(timeout_s),
        allow_unauthenticated=True,
    )
    client = HTTPVLLMWeightSyncClient(url, timeout=60)
    try:
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=None)
    except Exception as exc:
        print(
            json.dumps({"event": "rogue", "joined": False, "type": type(exc).__name__, "message": str(exc)})
        )
    else:
        print(json.dumps({"event": "rogue", "joined": True, "type": None, "message": ""}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
