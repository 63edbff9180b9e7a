"""The vLLM plugin without an engine: registration, the engine class contract, the import boundary, and
the trainer side streaming into an in-process weightsync receiver through vLLM's client protocol.

Real vLLM classes throughout (``vllm.distributed.weight_transfer``); no EngineCore is started here (see
``test_vllm_engine.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transfer_procs import free_port
from vllm_util import require_vllm

require_vllm()

from vllm.distributed.weight_transfer import (  # noqa: E402
    ModuleSource,
    ParamMeta,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine  # noqa: E402
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine  # noqa: E402
from weightsync.spec.errors import PeerFailedError  # noqa: E402
from weightsync.vllm import plugin  # noqa: E402
from weightsync.vllm.engine import (  # noqa: E402
    WeightsyncBroadcastEngine,
    WeightsyncInitInfo,
    WeightsyncIPCEngine,
    WeightsyncUpdateInfo,
)
from weightsync.vllm.trainer import (  # noqa: E402
    WeightsyncBroadcastTrainer,
    WeightsyncIPCTrainer,
    WeightsyncIPCTrainerInitInfo,
    WeightsyncTrainerInitInfo,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the plugin


def test_entry_point_names_register() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weightsync") == "weightsync.vllm.plugin:register"


def test_register_is_idempotent_and_registers_both_factories() -> None:
    plugin.register()
    plugin.register()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own loader, possibly again in this process
    engines = WeightTransferEngineFactory._registry
    trainers = WeightTransferTrainerFactory._registry
    assert engines["weightsync"]() is WeightsyncBroadcastEngine
    assert engines["weightsync_ipc"]() is WeightsyncIPCEngine
    assert trainers["weightsync"]() is WeightsyncBroadcastTrainer
    assert trainers["weightsync_ipc"]() is WeightsyncIPCTrainer
    for cls in (WeightsyncBroadcastEngine, WeightsyncIPCEngine):
        assert issubclass(cls, WeightTransferEngine)
    for tcls in (WeightsyncBroadcastTrainer, WeightsyncIPCTrainer):
        assert issubclass(tcls, TrainerWeightTransferEngine)
    # why the guard exists: vLLM's factory refuses a duplicate name
    with pytest.raises(ValueError, match="already registered"):
        WeightTransferEngineFactory.register_engine("weightsync", WeightsyncBroadcastEngine)


def test_a_foreign_backend_of_the_same_name_is_reported() -> None:
    saved = WeightTransferTrainerFactory._registry.pop("weightsync")
    try:
        WeightTransferTrainerFactory._registry["weightsync"] = lambda: WeightsyncIPCTrainer
        with pytest.raises(RuntimeError, match="already has a backend 'weightsync'"):
            plugin.register()
    finally:
        WeightTransferTrainerFactory._registry["weightsync"] = saved


# (which packages may import vllm: tests/test_layout.py::test_one_way_layering)


# ------------------------------------------------------------------------------------ engine contract


def _vllm_config(dp_index: int = 0) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=dp_index, world_size=1, rank=0),
        model_config=None,
    )


def test_engine_takes_vllms_constructor_and_works_on_cpu() -> None:
    model = torch.nn.Linear(2, 2)
    cfg = SimpleNamespace(backend="weightsync")
    eng = WeightTransferEngineFactory.create_engine(cfg, _vllm_config(dp_index=1), torch.device("cpu"), model)
    assert isinstance(eng, WeightsyncBroadcastEngine) and eng.model is model
    assert eng.parallel.transfer_rank(1, 3) == 2  # rank_offset + dp_index * tp*pp + rank
    with pytest.raises(RuntimeError, match="not initialised"):
        eng.update_weights({"names": [], "dtype_names": [], "shapes": []})
    # vLLM's base class synchronises with torch.accelerator, which a CPU-only torch refuses
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            torch.accelerator.synchronize()
    eng._synchronize()  # the override: nothing to do on CPU
    eng.shutdown()
    eng.shutdown()


def test_request_validation_raises_valueerror_naming_the_field() -> None:
    eng = WeightsyncBroadcastEngine(
        SimpleNamespace(), _vllm_config(), torch.device("cpu"), torch.nn.Linear(1, 1)
    )
    with pytest.raises(ValueError, match="nccl_unique_id_b64"):
        eng.parse_init_info({"nccl_unique_id_b64": "AAAA", "rank_offset": 1, "world_size": 2})
    with pytest.raises(ValueError, match="master_address and master_port"):
        eng.parse_init_info({"rank_offset": 1, "world_size": 2})
    with pytest.raises(ValueError, match="unknown field 'x'"):
        eng.parse_init_info(
            {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "x": 1}
        )
    bad = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "x": 1}
    with pytest.raises(
        ValueError, match=r"Invalid init_info.*unexpected keyword"
    ):  # vLLM's own cls(**d) path
        WeightTransferEngine.parse_init_info(eng, bad)
    with pytest.raises(ValueError, match="kernel format is available on weightsync's reference engine only"):
        WeightsyncInitInfo(
            master_address="h", master_port=1, rank_offset=1, world_size=2, is_checkpoint_format=False
        )
    with pytest.raises(ValueError, match=r"packed_buffer_size_bytes.*>= 1"):
        WeightsyncInitInfo(
            master_address="h", master_port=1, rank_offset=1, world_size=2, packed_buffer_size_bytes=0
        )
    with pytest.raises(ValueError, match="layout"):
        WeightsyncInitInfo(master_address="h", master_port=1, rank_offset=1, world_size=2, layout="tight")
    with pytest.raises(ValueError, match="length mismatch"):
        eng.parse_update_info({"names": ["a"], "dtype_names": [], "shapes": [[1]]})
    with pytest.raises(ValueError, match="not a known dtype"):
        eng.parse_update_info({"names": ["a"], "dtype_names": ["float"], "shapes": [[1]]})
    ok = eng.parse_update_info(
        {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]], "verify": True}
    )
    assert ok.metas()[0].nbytes == 12 and ok.verify is True


# ------------------------------------------------------------------- trainer streaming, in-process peer


class LoopbackClient:
    """vLLM's client protocol in front of one in-process weightsync receiver (transfer rank 1), which
    copies what it receives into ``got``. Records the calls in order."""

    def __init__(self, ipc: bool = False) -> None:
        self.ipc = ipc
        self.engine: Any = (
            IPCWeightTransferEngine(device="cpu", default_layout="aligned")
            if ipc
            else BroadcastWeightTransferEngine(default_layout="vllm")
        )
        self.got: dict[str, torch.Tensor] = {}
        self.calls: list[Any] = []
        self.info: WeightsyncInitInfo | None = None
        self.errors: list[BaseException] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", dict(init_info)))
        self.info = WeightsyncInitInfo(**init_info)
        self.engine.init_transfer_engine(dataclasses.replace(self.info, group_backend="gloo"))

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append(("update", len(update_info["names"])))
        assert self.info is not None
        info = WeightsyncUpdateInfo(**update_info)
        try:
            self.engine.receive_weights(info, lambda b: self.got.update({n: t.clone() for n, t in b}))
        except BaseException as exc:
            self.errors.append(exc)
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


class Tracked:
    """Fresh tensors made on demand, counting how many are alive at once (refcounting frees at once)."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel
        self.alive = 0
        self.peak = 0
        self.lock = threading.Lock()

    def _gone(self) -> None:
        with self.lock:
            self.alive -= 1

    def make(self, i: int) -> torch.Tensor:
        t = torch.full((self.numel,), float(i), dtype=torch.float32)
        with self.lock:
            self.alive += 1
            self.peak = max(self.peak, self.alive)
        weakref.finalize(t, self._gone)
        return t

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(self.n):
            yield f"w{i}", self.make(i)


class ShardGone(RuntimeError):
    pass


class TrackedSource(WeightSource):
    """A vLLM ``WeightSource`` whose iteration materialises each tensor on demand."""

    def __init__(self, tracked: Tracked, lie_at: int | None = None, raise_at: int | None = None) -> None:
        self.t = tracked
        self.lie_at = lie_at
        self.raise_at = raise_at

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(f"w{i}", torch.float32, (self.t.numel,)) for i in range(self.t.n)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.t.pairs():
            if self.raise_at is not None and name == f"w{self.raise_at}":
                raise ShardGone(f"checkpoint shard {self.raise_at} is gone")
            if self.lie_at is not None and name == f"w{self.lie_at}":
                t = t[:-1]
            yield name, t


def _trainer(client: LoopbackClient, **kw: Any) -> Any:
    info_cls = WeightsyncIPCTrainerInitInfo if client.ipc else WeightsyncTrainerInitInfo
    info = info_cls(
        master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0, timeout_s=20, **kw
    )
    tr = WeightTransferTrainerFactory.trainer_init(info, client=client, source=None)
    assert isinstance(tr, WeightsyncIPCTrainer if client.ipc else WeightsyncBroadcastTrainer)
    return tr


PEAKS: dict[str, int] = {}


@pytest.mark.parametrize("ipc", [False, True], ids=["broadcast", "ipc"])
@pytest.mark.parametrize("kind", ["weight_source", "iterator"])
def test_streaming_source_is_never_materialised(kind: str, ipc: bool) -> None:
    """40 tensors of 64 KiB from a generator, 256 KiB buffers: the trainer holds a bucket's worth of
    source tensors at a time, never the model (today's ``list(weights)`` held all 40)."""
    client = LoopbackClient(ipc)
    tr = _trainer(client, packed_buffer_size_bytes=256 << 10)
    tracked = Tracked(40, 16 << 10)
    src: Any = TrackedSource(tracked) if kind == "weight_source" else tracked.pairs()
    tr.send_weights(src, weight_version="v1")
    assert sorted(client.got) == sorted(f"w{i}" for i in range(40))
    assert all(bool((client.got[f"w{i}"] == i).all()) for i in range(40))
    PEAKS[f"{kind}/{'ipc' if ipc else 'broadcast'}"] = tracked.peak
    per_bucket = 5  # at most 5 x 64 KiB per bucket (exceed-then-flush; the aligned layout holds 4)
    assert tracked.peak <= per_bucket + 1, tracked.peak
    updates = [c for c in client.calls if isinstance(c, tuple) and c[0] == "update"]
    # a WeightSource declares everything in one update; a bare iterator goes chunk by chunk
    assert updates == ([("update", 40)] if kind == "weight_source" else [("update", 5)] * 8)
    assert client.calls[0][0] == "init" and client.calls[-1] == ("finish", "v1")
    init = client.calls[0][1]
    assert init["rank_offset"] == 1 and init["packed"] is True and "layout" not in init
    tr.shutdown()
    client.engine.shutdown()
    print(f"\npeak live source tensors ({kind}, {'ipc' if ipc else 'broadcast'}): {tracked.peak} of 40")


def test_a_source_that_disagrees_with_its_metadata_fails_both_sides() -> None:
    client = LoopbackClient()
    tr = _trainer(client, packed_buffer_size_bytes=256 << 10)
    with pytest.raises(ValueError, match="disagrees with its declared metadata at index 7"):
        tr.send_weights(TrackedSource(Tracked(12, 16 << 10), lie_at=7))
    deadline = time.monotonic() + 10
    while not client.errors and time.monotonic() < deadline:  # the receiver fails in the RPC's thread
        time.sleep(0.01)
    assert client.errors and isinstance(client.errors[0], PeerFailedError)
    assert "rank(s) 0 failed" in str(client.errors[0])
    assert "finish" not in [c[0] if isinstance(c, tuple) else c for c in client.calls]
    # every rank aborted that round together (trainer rule 6): the group is usable, the next round arrives
    assert tr.broken is None
    tr.send_weights(TrackedSource(Tracked(1, 4)), weight_version="after")
    assert client.calls[-1] == ("finish", "after") and bool((client.got["w0"] == 0).all())
    tr.shutdown()
    client.engine.shutdown()


@pytest.mark.parametrize("ipc", [False, True], ids=["broadcast", "ipc"])
def test_a_source_that_raises_mid_stream_fails_both_sides_at_once(ipc: bool) -> None:
    """main's rule for a raising trainer iterator, on wt-d's streamed round: the trainer re-raises the
    source's own exception and the receiver fails at once (not at its 20 s deadline) naming it."""
    client = LoopbackClient(ipc)
    tr = _trainer(client, packed_buffer_size_bytes=256 << 10)
    t0 = time.monotonic()
    with pytest.raises(ShardGone, match="checkpoint shard 7 is gone"):
        tr.send_weights(TrackedSource(Tracked(12, 16 << 10), raise_at=7))
    deadline = time.monotonic() + 10
    while not client.errors and time.monotonic() < deadline:  # the receiver fails in the RPC's thread
        time.sleep(0.01)
    assert time.monotonic() - t0 < 6
    assert client.errors and isinstance(client.errors[0], PeerFailedError)
    assert client.errors[0].ranks == (0,)
    assert (
        "rank 0: the trainer's weight iterator raised ShardGone: checkpoint shard 7 is gone after 7 tensor(s)"
        in str(client.errors[0])
    )
    if not ipc:  # at the bucket being pulled: tensors 5-9 (exceed-then-flush, 5 x 64 KiB per bucket)
        assert ", b1)" in str(client.errors[0]), str(client.errors[0])
    assert "finish" not in [c[0] if isinstance(c, tuple) else c for c in client.calls]
    tr.shutdown()
    client.engine.shutdown()


@pytest.mark.parametrize(
    ("num_buffers", "raise_at"), [(1, 7), (2, 7), (3, 7), (2, 0), (2, 10)], ids=lambda v: str(v)
)
def test_a_raising_source_aborts_at_its_bucket_and_leaves_no_collective_one_sided(
    num_buffers: int, raise_at: int
) -> None:
    """The broadcast transport's in-band abort (``broadcast`` rules 3 and 7): 12 tensors of 64 KiB in
    256 KiB buckets (tensors 0-4, 5-9, 10-11). The source raises in bucket ``raise_at // 5``; the worker
    fails there at once naming it, with every slot count (one slot: no bucket posted ahead; more: one).
    Had a header or payload been posted on one side only, the worker would wait out its 20 s deadline
    draining it, or the next round on the same group would read a stray header; instead that next round
    arrives bit-exact."""
    client = LoopbackClient()
    tr = _trainer(client, packed_buffer_size_bytes=256 << 10, packed_num_buffers=num_buffers)
    t0 = time.monotonic()
    with pytest.raises(ShardGone):
        tr.send_weights(TrackedSource(Tracked(12, 16 << 10), raise_at=raise_at))
    deadline = time.monotonic() + 10
    while not client.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() - t0 < 6
    assert client.errors and isinstance(client.errors[0], PeerFailedError)
    assert f", b{raise_at // 5})" in str(client.errors[0]), str(client.errors[0])
    assert tr.broken is None
    tr.send_weights(TrackedSource(Tracked(12, 16 << 10)), weight_version="after")
    assert client.calls[-1] == ("finish", "after")
    assert all(bool((client.got[f"w{i}"] == i).all()) for i in range(12))
    tr.shutdown()
    client.engine.shutdown()


def test_module_and_module_source_send_named_parameters() -> None:
    client = LoopbackClient()
    tr = _trainer(client, packed_buffer_size_bytes=1 << 10)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    tr.send_weights(model)
    tr.send_weights(ModuleSource(model), weight_version="two")
    want = dict(model.named_parameters())
    assert sorted(client.got) == sorted(want)
    assert all(torch.equal(client.got[n], p.detach()) for n, p in want.items())
    tr.shutdown()
    client.engine.shutdown()
