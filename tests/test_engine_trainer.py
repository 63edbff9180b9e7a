"""A reference-engine round driven by vLLM 0.32's trainer API (issue 9 item 3: one API, not two).

``BroadcastTrainerEngine.trainer_init(init_info, client=<the reference DPEngineClient>, source=<an nn.Module>)``
and ``send_weights(weight_version="step-1")`` move the weights into 2 DP engine processes; afterwards
``get_weight_version()`` (vLLM's consensus) is ``"step-1"`` and both ranks serve the trainer's weights bit
for bit. A bare iterator, streamed in chunks, goes through the controller's ``update_round`` with the same
trainer.
"""

from __future__ import annotations

import pytest
from engine_util import CFG, Cluster, greedy
from transfer_procs import free_port, module_of

from weightsync.impl.engine.controller import update_round
from weightsync.impl.engine.scheduler import reference_generate
from weightsync.impl.engine.weights import random_weights
from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.transfer.trainer import BroadcastTrainerEngine, TrainerInitInfo, WeightSyncClient
from weightsync.spec.errors import StaleWeightVersionError

pytestmark = pytest.mark.timeout(240)


def _served_by(c: Cluster, ws: list[tuple[str, object]], version: str, tag: str) -> None:
    local = CausalLM(CFG)
    local.load_weights(ws)  # type: ignore[arg-type]
    want, _ = reference_generate(local, [3, 1, 4], 6)
    for r in range(c.client.dp_size):
        s = c.client.add_request([3, 1, 4], greedy(6), req_id=f"{tag}-{r}", rank=r).wait(60)
        assert s.finish_reason == "length" and s.tokens == want, (r, s.tokens, want)
        assert s.versions == [version] * 6


def test_trainer_init_and_send_weights_drive_the_reference_engine() -> None:
    c = Cluster(dp_size=2, sync_interval=4, timeout_s=20.0)
    tr = None
    try:
        assert isinstance(c.client, WeightSyncClient)  # vLLM's VLLMWeightSyncClient shape
        assert c.client.get_weight_version() == "default"  # vLLM's initial version
        ws = random_weights(c.model, 3)
        info = TrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=1 + c.client.dp_size,
            rank=0,
            timeout_s=20.0,
            group_backend="gloo",
            packed_buffer_size_bytes=8192,
        )
        tr = BroadcastTrainerEngine.trainer_init(info, client=c.client, source=module_of(ws))  # type: ignore[arg-type]
        c.client.pause("keep")
        tr.send_weights(weight_version="step-1")
        c.client.resume()
        assert c.client.get_weight_version() == "step-1"
        assert c.client.get_weight_versions() == ["step-1", "step-1"]
        _served_by(c, ws, "step-1", "module")
        # a bare iterator: streamed in chunks of about the buffer size, one update_weights per chunk, in a
        # round the controller opens, times and closes
        ws2 = random_weights(c.model, 4)
        before = len(c.client.transitions)
        times = update_round(c.client, tr, iter(ws2), mode="abort", weight_version="step-2")
        chunks = sum(1 for t in c.client.transitions[before:] if t.event == "update_weights")
        assert chunks >= 2 * 2 and chunks % 2 == 0, chunks  # several chunks, on both ranks
        assert times.update_s > 0 and c.client.get_weight_version() == "step-2"
        _served_by(c, ws2, "step-2", "iterator")
        # finish without a version keeps it (vLLM: async_llm.py:1351-1355)
        c.client.pause("keep")
        tr.send_weights(dict(random_weights(c.model, 3)))
        c.client.resume()
        assert c.client.get_weight_version() == "step-2"
        _served_by(c, ws, "step-2", "state-dict")
        # issue 22: a replayed older round with monotonic=True is refused before start_weight_update; no
        # rank is failed, both keep serving ws under step-2, and the next correct round succeeds
        n = len(c.client.transitions)
        c.client.pause("keep")
        with pytest.raises(StaleWeightVersionError, match=r"'step-1'.*the engines' weight_version 'step-2'"):
            tr.send_weights(dict(ws2), weight_version="step-1", monotonic=True)
        c.client.resume()
        events = [(t.event, t.after["state"]) for t in c.client.transitions[n:]]
        assert not any(e in ("start_weight_update", "update_weights") for e, _ in events), events
        assert not any(s == "failed" for _, s in events), events
        assert c.client.get_weight_versions() == ["step-2", "step-2"]
        _served_by(c, ws, "step-2", "refused")
        c.client.pause("keep")
        tr.send_weights(dict(ws2), weight_version="step-3", monotonic=True, check_finite=True)
        c.client.resume()
        assert c.client.get_weight_version() == "step-3"
        _served_by(c, ws2, "step-3", "after-refusal")
    finally:
        if tr is not None:
            tr.shutdown()
        c.close()
