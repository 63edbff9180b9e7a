"""Request shapes round trip between vLLM 0.32's own producers and weightsync's backends (issue 9 item 3).

- What vLLM's own NCCL trainer sends (captured from ``NCCLTrainerWeightTransferEngine.trainer_init`` and
  ``send_weights`` with a recording client; only its NCCL endpoint and broadcast are stubbed), what its
  HTTP client posts (``HTTPVLLMWeightSyncClient``, ``requests.post`` recorded) and what the API router /
  ``AsyncLLM`` hand the workers (``WeightTransferInitRequest`` / ``WeightTransferUpdateRequest``, and the
  worker's per-rank pick from a list payload, ``Worker.update_weights``) parse unchanged in weightsync's
  vLLM backends and in its reference engine (the worker's parsers, ``WeightTransferWorker``, and the same
  per-rank pick, ``ParallelInfo.local_update_info``): one request shape.
- What weightsync's trainers send (the reference's and the plugin's: one trainer, two subclasses) and what
  the reference engine's helpers produce parse in vLLM's own dataclasses (``NCCLWeightTransferInitInfo``,
  ``NCCLWeightTransferUpdateInfo``) when weightsync's optional fields are at their defaults; with them set,
  vLLM rejects the dict (they are weightsync's, and optional).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_util import require_vllm

require_vllm()

from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer import nccl_engine as vnccl  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    VLLMWeightSyncClient,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from weightsync.impl.engine.weights import update_info_for  # noqa: E402
from weightsync.impl.transfer.base import InitInfo, ParallelInfo, UpdateInfo  # noqa: E402
from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine  # noqa: E402
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine  # noqa: E402
from weightsync.impl.transfer.trainer import IPCTrainerInitInfo, TrainerInitInfo  # noqa: E402
from weightsync.vllm.engine import WeightsyncBroadcastEngine, WeightsyncIPCEngine  # noqa: E402
from weightsync.vllm.trainer import (  # noqa: E402
    WeightsyncIPCTrainerInitInfo,
    WeightsyncTrainerInitInfo,
    update_info_of,
)

pytestmark = pytest.mark.vllm


class Recorder:
    """vLLM's client protocol, recording every call and its (JSON round-tripped) payload."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", json.loads(json.dumps(init_info))))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", json.loads(json.dumps(update_info))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def _engines() -> list[Any]:
    """Every parser of weightsync's: the vLLM backends' and the reference engine's transports'."""
    vcfg = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    vllm_backends = [
        cls(SimpleNamespace(), vcfg, torch.device("cpu"), torch.nn.Linear(1, 1))
        for cls in (WeightsyncBroadcastEngine, WeightsyncIPCEngine)
    ]
    return [*vllm_backends, BroadcastWeightTransferEngine(), IPCWeightTransferEngine(device="cpu")]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)


def vllm_trainer_payloads(monkeypatch: pytest.MonkeyPatch, **init_kw: Any) -> list[tuple[str, Any]]:
    """Run vLLM's own NCCL trainer with its NCCL endpoint and broadcast stubbed out."""
    monkeypatch.setattr(vnccl, "open_trainer_endpoint", lambda info: SimpleNamespace(destroy=lambda: None))
    monkeypatch.setattr(vnccl.NCCLTrainerWeightTransferEngine, "_broadcast", lambda self, source, meta: None)
    rec = Recorder()
    info = vnccl.NCCLTrainerInitInfo(
        master_address="10.0.0.7", master_port=29555, world_size=3, rank=0, **init_kw
    )
    tr = WeightTransferTrainerFactory.trainer_init(info, client=rec, source=ModuleSource(_model()))
    tr.send_weights()
    return rec.calls


@pytest.mark.parametrize(
    "init_kw", [{}, {"packed": False}, {"packed_buffer_size_bytes": 4096, "packed_num_buffers": 3}]
)
def test_vllms_nccl_trainer_payloads_parse_in_weightsync(
    monkeypatch: pytest.MonkeyPatch, init_kw: dict[str, Any]
) -> None:
    calls = vllm_trainer_payloads(monkeypatch, **init_kw)
    assert [c for c, _ in calls] == ["init", "start", "update", "finish"]
    init, update = calls[0][1], calls[2][1]
    assert set(init) == {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }
    assert set(update) == {"names", "dtype_names", "shapes"}
    assert calls[3][1] is None  # vLLM's trainer finishes without a version
    for eng in _engines():
        parsed = eng.parse_init_info(init)
        assert (parsed.master_address, parsed.master_port, parsed.rank_offset, parsed.world_size) == (
            "10.0.0.7",
            29555,
            1,
            3,
        )
        assert (parsed.packed, parsed.packed_buffer_size_bytes, parsed.packed_num_buffers) == (
            init["packed"],
            init["packed_buffer_size_bytes"],
            init["packed_num_buffers"],
        )
        u = eng.parse_update_info(update)
        assert isinstance(parsed, InitInfo) and isinstance(u, UpdateInfo)  # one definition, both stacks
        assert list(u.names) == [n for n, _ in _model().named_parameters()]
        assert set(u.dtype_names) == {"bfloat16"} and u.shapes[0] == [3, 4]
        assert u.to_dict() == update and parsed.to_dict() == init  # and back, unchanged


def test_http_client_and_router_requests_parse_in_weightsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HTTPVLLMWeightSyncClient`` posts JSON bodies; the router (``entrypoints/rl/online/api_router.py``)
    wraps them in vLLM's request classes; the workers receive ``request.init_info`` / ``update_info``."""
    import requests

    posted: list[tuple[str, Any]] = []

    def post(url: str, json: Any = None, timeout: float = 0) -> Any:
        posted.append((url.rsplit("/", 1)[1], json))
        return SimpleNamespace(raise_for_status=lambda: None)

    monkeypatch.setattr(requests, "post", post)
    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:1/")
    init = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=29600, world_size=3, rank=0
    ).worker_payload()
    client.init_weight_transfer_engine(init)
    client.start_weight_update()
    per_rank = [
        {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]},
        {"names": ["b"], "dtype_names": ["float16"], "shapes": [[1, 2]]},
    ]
    client.update_weights(per_rank)
    client.update_weights(per_rank[0])
    client.finish_weight_update("step-3")
    assert [p for p, _ in posted] == [
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "update_weights",
        "finish_weight_update",
    ]
    assert posted[-1][1] == {"weight_version": "step-3"}
    init_req = WeightTransferInitRequest(**posted[0][1])
    list_req = WeightTransferUpdateRequest(**posted[2][1])
    dict_req = WeightTransferUpdateRequest(**posted[3][1])
    for eng in _engines():
        assert eng.parse_init_info(init_req.init_info).world_size == 3
        assert eng.parse_update_info(dict_req.update_info).names == ["a"]

    # a list payload is indexed by global worker rank by vLLM's worker before the engine sees it
    # (v1/worker/gpu_worker.py:1570-1578): dp_index * (TP*PP) + rank
    seen: list[Any] = []
    for dp_index in (0, 1):
        fake = SimpleNamespace(
            _check_weight_transfer_engine=lambda: None,
            weight_transfer_engine=SimpleNamespace(
                update_weights=seen.append, reset_weight_update_target=lambda: None
            ),
            _weight_update_active=True,
            vllm_config=SimpleNamespace(
                parallel_config=SimpleNamespace(data_parallel_index=dp_index, world_size=1)
            ),
            rank=0,
        )
        Worker.update_weights(fake, list_req.update_info)  # type: ignore[arg-type]
    assert [d["names"] for d in seen] == [["a"], ["b"]]
    for eng in _engines():
        assert eng.parse_update_info(seen[1]).metas()[0].nbytes == 4
    # the reference engine's worker picks the same entry (dp_index * TP*PP + rank), from the same list
    mine = [ParallelInfo(dp_index=d).local_update_info(list_req.update_info) for d in (0, 1)]
    assert mine == seen
    with pytest.raises(ValueError, match="list of 2 per-worker entries but this worker's index is 2"):
        ParallelInfo(dp_index=2).local_update_info(list_req.update_info)


def test_weightsyncs_payloads_parse_in_vllms_dataclasses() -> None:
    for info_cls in (
        WeightsyncTrainerInitInfo,
        WeightsyncIPCTrainerInitInfo,
        TrainerInitInfo,
        IPCTrainerInitInfo,
    ):
        payload = info_cls(
            master_address="127.0.0.1", master_port=29601, world_size=2, rank=0
        ).worker_payload()
        vinfo = NCCLWeightTransferInitInfo(**json.loads(json.dumps(payload)))
        assert (vinfo.rank_offset, vinfo.packed, vinfo.packed_buffer_size_bytes) == (1, True, 1 << 30)
    # the reference engine's own init dicts with packing, as its tests and demo build them
    ref_init = InitInfo(
        master_address="h", master_port=3, rank_offset=1, world_size=3, packed=True, packed_num_buffers=3
    ).to_dict()
    assert NCCLWeightTransferInitInfo(**ref_init).packed_num_buffers == 3
    model = _model()
    update = json.loads(
        json.dumps(update_info_of([(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]))
    )
    vupdate = vnccl.NCCLWeightTransferUpdateInfo(**update)
    assert vupdate.names == [n for n, _ in model.named_parameters()] and vupdate.dtype_names[0] == "bfloat16"
    # the reference engine's update dicts: vLLM's three fields, nothing else
    ref_update = update_info_for(list(model.named_parameters()))
    assert ref_update == update
    assert (
        vnccl.NCCLWeightTransferUpdateInfo(**UpdateInfo.parse(ref_update).to_dict()).shapes
        == update["shapes"]
    )
    # a vLLM NCCL trainer config converts by changing the class
    vt = vnccl.NCCLTrainerInitInfo(
        master_address="h", master_port=2, world_size=4, rank=0, packed_num_buffers=3
    )
    mine = WeightsyncTrainerInitInfo(**dataclasses.asdict(vt))
    assert mine.backend == "weightsync" and mine.packed_num_buffers == 3 and mine.rank == 0
    ref = TrainerInitInfo(**dataclasses.asdict(vt))  # and so does the reference engine's trainer's
    assert ref.worker_payload() == mine.worker_payload()


def test_weightsyncs_optional_fields_are_its_own() -> None:
    payload = WeightsyncTrainerInitInfo(
        master_address="h", master_port=1, world_size=2, rank=0, timeout_s=30, verify=True, layout="aligned"
    ).worker_payload()
    assert {"timeout_s", "verify", "layout"} <= set(payload)
    with pytest.raises(TypeError):
        NCCLWeightTransferInitInfo(**payload)
    for eng in _engines():
        parsed = eng.parse_init_info(payload)
        assert parsed.wire(eng.default_layout).layout == "aligned" and parsed.verify
        assert (
            eng.parse_update_info(
                {"names": ["x"], "dtype_names": ["int8"], "shapes": [[1]], "verify": False}
            ).verify
            is False
        )


def test_kernel_format_is_an_init_option_of_the_reference_engine_only() -> None:
    """vLLM 0.32's ``start_weight_update()`` takes no argument: the format is ``init_info``'s
    ``is_checkpoint_format`` (vLLM's term, ``model_loader/reload/inplace.py``), sent only when False. The
    reference engine's parsers take it; the vLLM backends refuse it naming the rule; vLLM's own class
    rejects the unknown field."""
    payload = TrainerInitInfo(
        master_address="h", master_port=1, world_size=2, rank=0, is_checkpoint_format=False
    ).worker_payload()
    assert payload["is_checkpoint_format"] is False
    with pytest.raises(TypeError):
        NCCLWeightTransferInitInfo(**payload)
    vllm_backends, reference = _engines()[:2], _engines()[2:]
    for eng in reference:
        assert eng.parse_init_info(payload).is_checkpoint_format is False
    for eng in vllm_backends:
        with pytest.raises(ValueError, match="is_checkpoint_format'\\]=False"):
            eng.parse_init_info(payload)


def test_the_reference_engine_client_and_checked_engine_are_vllm_clients() -> None:
    """vLLM's ``VLLMWeightSyncClient`` protocol (``distributed/weight_transfer/base.py:505-533``): the same
    trainer class drives vLLM and weightsync's reference engine."""
    from weightsync.impl.checked import CheckedEngine
    from weightsync.impl.engine.client import DPEngineClient

    assert isinstance(DPEngineClient.__new__(DPEngineClient), VLLMWeightSyncClient)
    assert isinstance(CheckedEngine.__new__(CheckedEngine), VLLMWeightSyncClient)
