"""vLLM 0.32's trainer API over weightsync's transports, engine-agnostic (no vLLM import): ``trainer_init(
init_info, *, client, source)`` + ``send_weights(weight_version=...)`` (:mod:`weightsync.impl.transfer.trainer`).

The client here is a real one over a reference weight-transfer worker in this process (a thread per call,
as an engine's RPC would run): every call of the trainer reaches the worker. Covered: the handshake's
``init_info`` (vLLM's fields with packing, extras only when set), one round per ``send_weights`` with the
version, sources (a declared source, an ``nn.Module``, a state dict, a bare iterator in chunks), streaming
without materialising the source (peak live tensors bounded by a bucket), bad input before any call,
kernel format as an init option, and which failed rounds leave the endpoint usable (rule 6).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transfer_procs import DictModel, bytes_equal, free_port, make_tensors, model_spec, module_of

from weightsync.impl.transfer.base import InitInfo, ParallelInfo
from weightsync.impl.transfer.trainer import (
    BroadcastTrainerEngine,
    IPCTrainerEngine,
    IPCTrainerInitInfo,
    ParamMeta,
    TrainerInitInfo,
    WeightSyncClient,
)
from weightsync.impl.transfer.worker import WeightTransferWorker
from weightsync.spec.errors import StaleWeightVersionError, TransferTimeoutError

pytestmark = pytest.mark.timeout(120)


class WorkerClient:
    """vLLM's ``VLLMWeightSyncClient`` over one reference worker (transfer rank 1) in this process.

    Attributes:
        calls: ``(call, payload)`` in order; version: the last ``finish_weight_update`` version.
        hold_updates: ``update_weights`` sleeps this long before receiving (a stalled engine).
    """

    def __init__(self, model: Any, backend: str = "nccl") -> None:
        kw: dict[str, Any] = {"device": "cpu"} if backend == "ipc" else {}
        self.worker = WeightTransferWorker(model, backend, ParallelInfo(), **kw)
        self.calls: list[tuple[str, Any]] = []
        self.version = "default"
        self.hold_updates = 0.0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", dict(init_info)))
        self.worker.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.calls.append(("update", update_info))
        time.sleep(self.hold_updates)
        try:
            self.worker.update_weights(update_info)
        except BaseException:
            self.worker.fail_round()  # what an engine does with a failed round
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))
        self.worker.finish_weight_update()
        if weight_version is not None:
            self.version = weight_version

    def updates(self) -> list[int]:
        return [len(p["names"]) for c, p in self.calls if c == "update"]


def _trainer(client: WorkerClient, backend: str = "nccl", **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "world_size": 2,
        "rank": 0,
        "timeout_s": 10.0,
        **kw,
    }
    if backend == "ipc":
        return IPCTrainerEngine.trainer_init(IPCTrainerInitInfo(device="cpu", **fields), client=client)
    return BroadcastTrainerEngine.trainer_init(TrainerInitInfo(group_backend="gloo", **fields), client=client)


class Tracked:
    """``n`` fresh float32 tensors of ``numel`` elements made on demand, counting how many are alive at once."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel
        self.alive = self.peak = self.made = 0
        self.lock = threading.Lock()

    def _gone(self) -> None:
        with self.lock:
            self.alive -= 1

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(self.n):
            t = torch.full((self.numel,), float(i), dtype=torch.float32)
            with self.lock:
                self.alive += 1
                self.made += 1
                self.peak = max(self.peak, self.alive)
            weakref.finalize(t, self._gone)
            yield f"w{i}", t
            del t


class TrackedSource:
    """A ``WeightSource``-shaped source (``metadata()`` + a fresh iteration per round), duck-typed."""

    def __init__(self, tracked: Tracked) -> None:
        self.t = tracked

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(f"w{i}", torch.float32, (self.t.numel,)) for i in range(self.t.n)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.t.pairs()


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("kind", ["declared", "iterator"])
def test_a_streaming_source_is_never_materialised(kind: str, backend: str) -> None:
    """40 tensors of 64 KiB, 256 KiB buffers: the trainer holds at most a bucket's (declared source) or a
    chunk's (bare iterator) worth of source tensors at a time, never the model; every tensor arrives."""
    tracked = Tracked(40, 16 << 10)
    model = DictModel({f"w{i}": (torch.float32, (16 << 10,)) for i in range(40)})
    client = WorkerClient(model, backend)
    tr = _trainer(client, backend, packed_buffer_size_bytes=256 << 10)
    assert isinstance(client, WeightSyncClient)
    src: Any = TrackedSource(tracked) if kind == "declared" else tracked.pairs()
    tr.send_weights(src, weight_version="v1")
    assert tracked.made == 40 and client.version == "v1"
    got = model.weights()
    assert all(bool((got[f"w{i}"] == i).all()) for i in range(40))
    # a bucket holds at most 4 x 64 KiB (aligned, never over the buffer); a chunk closes after the tensor
    # that exceeds 256 KiB (5 tensors); the one being packed or on the wire is alive too
    assert tracked.peak <= 6, tracked.peak
    assert client.updates() == ([40] if kind == "declared" else [5] * 8)
    init = client.calls[0][1]
    assert init["packed"] is True and init["packed_buffer_size_bytes"] == 256 << 10 and "layout" not in init
    tr.shutdown()
    client.worker.shutdown()


def test_module_state_dict_and_kernel_format_sources() -> None:
    """An ``nn.Module`` (its ``named_parameters``), a state dict (its items) and the kernel format as an
    ``init_info`` option (``is_checkpoint_format=False``: parameter names copied by exact name)."""
    pairs = make_tensors(2)
    model = DictModel(model_spec())
    client = WorkerClient(model)
    tr = _trainer(client, packed_buffer_size_bytes=4096)
    tr.send_weights(module_of(pairs), weight_version="module")
    assert all(bytes_equal(model.weights()[n], t.contiguous()) for n, t in pairs)
    tr.send_weights(dict(make_tensors(3)), weight_version="state-dict")
    assert all(bytes_equal(model.weights()[n], t.contiguous()) for n, t in make_tensors(3))
    assert [c for c, _ in client.calls].count("finish") == 2 and client.version == "state-dict"
    tr.shutdown()
    client.worker.shutdown()

    model = DictModel(model_spec())
    client = WorkerClient(model)
    tr = _trainer(client, is_checkpoint_format=False)
    assert client.calls[0][1]["is_checkpoint_format"] is False  # sent: it is not the default
    kernel = [(n, torch.full_like(p, 3.0)) for n, p in model.named_parameters()]
    tr.send_weights(kernel, weight_version="kernel")
    assert client.worker.machine.vars.weight_version == 1  # the worker's round counter
    assert all(bool((p == 3).all()) for _, p in model.named_parameters())
    tr.shutdown()
    client.worker.shutdown()


def test_bad_input_raises_before_any_call() -> None:
    with pytest.raises(ValueError, match=r"packed_num_buffers'\]=0 must be >= 1"):
        TrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0, packed_num_buffers=0)
    with pytest.raises(ValueError, match=r"rank'\]=-1 must be >= 0"):
        TrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=-1)
    with pytest.raises(ValueError, match="needs a IPCTrainerInitInfo, got TrainerInitInfo"):
        IPCTrainerEngine.trainer_init(
            TrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0), client=None
        )
    model = DictModel(model_spec())
    client = WorkerClient(model)
    tr = _trainer(client)
    n = len(client.calls)
    with pytest.raises(ValueError, match=r"weight_version must be a str or None .*got int 3"):
        tr.send_weights(make_tensors(0), weight_version=3)
    with pytest.raises(ValueError, match="no source"):
        tr.send_weights()
    with pytest.raises(ValueError, match=r"the source must be a WeightSource .* got int"):
        tr.send_weights(7)
    assert len(client.calls) == n  # nothing reached the engines
    items: list[Any] = make_tensors(0)
    items[1] = ("model.x", 5)
    with pytest.raises(ValueError, match=r"weight 1 is not a \(non-empty str name, torch.Tensor\) pair"):
        tr.send_weights(items)
    assert [c for c, _ in client.calls[n:]] == ["start"]  # no update_weights announced the bad chunk
    assert tr.broken is None
    client.worker.fail_round()
    tr.send_weights(make_tensors(0), weight_version="ok")  # the group is fine
    assert client.version == "ok"
    tr.shutdown()
    client.worker.shutdown()


def test_a_timed_out_round_breaks_the_endpoint_and_an_aborted_one_does_not() -> None:
    """Trainer rule 6: every rank aborting together (here the engine's veto of a wrong dtype) leaves the
    group usable; a data plane that timed out (the engine never came) leaves it unusable."""
    model = DictModel(model_spec())
    client = WorkerClient(model)
    tr = _trainer(client, timeout_s=2.0)
    bad = [(n, t.to(torch.float64) if t.dtype == torch.float32 else t) for n, t in make_tensors(0)]
    with pytest.raises(Exception, match="rejected the update before any payload moved"):
        tr.send_weights(bad)
    assert tr.broken is None
    tr.send_weights(make_tensors(1), weight_version="after-veto")
    assert client.version == "after-veto"
    client.hold_updates = 6.0  # the engine takes longer than the 2 s deadline to join the round
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        tr.send_weights(make_tensors(2))
    assert time.monotonic() - t0 < 12 and tr.broken is not None
    with pytest.raises(RuntimeError, match="unusable after a failed round"):
        tr.send_weights(make_tensors(2))
    tr.shutdown()
    client.worker.shutdown()


def test_worker_payload_is_vllms_shape() -> None:
    info = TrainerInitInfo(master_address="h", master_port=2, world_size=3, rank=0)
    assert info.worker_payload() == {
        "master_address": "h",
        "master_port": 2,
        "rank_offset": 1,
        "world_size": 3,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 30,
        "packed_num_buffers": 2,
    }
    extra = TrainerInitInfo(master_address="h", master_port=2, world_size=3, rank=1, timeout_s=5, verify=True)
    assert not extra.is_sender
    assert InitInfo.parse(extra.worker_payload()) == extra.worker_init_info()
    assert {"timeout_s": 5, "verify": True}.items() <= extra.worker_payload().items()


class VersionedClient(WorkerClient):
    """A client that also reports the engines' served version (vLLM's ``AsyncLLM.get_weight_version``)."""

    def get_weight_version(self) -> str:
        self.calls.append(("get_weight_version", None))
        return self.version


def test_monotonic_refuses_an_older_version_before_start_and_check_finite_reaches_the_worker() -> None:
    """Issue 22 item 2 on the trainer side: ``send_weights(..., monotonic=True)`` compares with the engines'
    version and with the last one this trainer set, and refuses an older one before ``start_weight_update``:
    nothing reaches the worker, its weights, round and version stay. ``check_finite=True`` from
    ``send_weights`` reaches the worker, which refuses a NaN before loading it."""
    model = DictModel(model_spec())
    client = VersionedClient(model)
    tr = _trainer(client)
    tr.send_weights(make_tensors(3), weight_version="step-3", monotonic=True)
    kept = {n: t.clone() for n, t in model.weights().items()}
    rounds = client.worker.machine.vars.weight_version
    n = len(client.calls)
    with pytest.raises(StaleWeightVersionError, match=r"'step-1'.*the engines' weight_version 'step-3'"):
        tr.send_weights(make_tensors(1), weight_version="step-1", monotonic=True)
    client.version = "step-0"  # the engines relabelled: the trainer's own record still refuses the replay
    with pytest.raises(StaleWeightVersionError, match=r"last weight_version this trainer set 'step-3'"):
        tr.send_weights(make_tensors(1), weight_version="step-1", monotonic=True)
    with pytest.raises(ValueError, match="needs a weight_version"):
        tr.send_weights(make_tensors(1), monotonic=True)
    with pytest.raises(ValueError, match="no trailing step number"):
        tr.send_weights(make_tensors(1), weight_version="latest", monotonic=True)
    assert {c for c, _ in client.calls[n:]} == {"get_weight_version"}  # no start, no update, no finish
    assert client.worker.machine.vars.weight_version == rounds and tr.broken is None
    assert all(bytes_equal(model.weights()[k], v) for k, v in kept.items())
    tr.send_weights(make_tensors(4), weight_version="step-4", monotonic=True)  # the next correct round
    assert client.version == "step-4"
    assert all(bytes_equal(model.weights()[k], t.contiguous()) for k, t in make_tensors(4))
    bad = [(k, t.clone().fill_(float("nan")) if t.dtype.is_floating_point else t) for k, t in make_tensors(5)]
    m = len(client.calls)
    with pytest.raises(Exception, match="check_finite=True"):
        tr.send_weights(bad, weight_version="step-5", check_finite=True)
    sent = [p for c, p in client.calls[m:] if c == "update"]
    assert sent and all(p["check_finite"] is True for p in sent)
    assert client.version == "step-4"
    assert all(bytes_equal(model.weights()[k], t.contiguous()) for k, t in make_tensors(4))
    tr.shutdown()
    client.worker.shutdown()


def test_check_finite_from_the_init_info() -> None:
    """``TrainerInitInfo(check_finite=True)`` makes it every round's default (trainer side only: the workers'
    init info does not carry it); a non-bool is refused at construction."""
    with pytest.raises(ValueError, match="check_finite"):
        TrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0, check_finite=1)  # type: ignore[arg-type]
    model = DictModel(model_spec())
    client = WorkerClient(model)
    tr = _trainer(client, check_finite=True)
    assert "check_finite" not in client.calls[0][1]
    bad = [(k, t.clone().fill_(float("inf")) if t.dtype.is_floating_point else t) for k, t in make_tensors(1)]
    with pytest.raises(Exception, match="check_finite=True"):
        tr.send_weights(bad, weight_version="step-1")
    assert client.version == "default"
    assert all(p["check_finite"] is True for c, p in client.calls if c == "update")
    tr.shutdown()
    client.worker.shutdown()


class _NeverJoins:
    """A client whose engines accept ``init_weight_transfer_engine`` and never reach the rendezvous (a MoE DP
    rank stepping its wave, tests/test_vllm_moe_dp.py)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass


def test_a_rendezvous_timeout_names_the_missing_rank_and_the_likely_cause() -> None:
    from weightsync.impl.transfer.trainer_calls import RENDEZVOUS_HINT, hint_rendezvous

    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError) as err:
        _trainer(_NeverJoins(), timeout_s=1.5)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 10
    assert err.value.phase == "rendezvous" and err.value.missing_ranks == (1,), err.value
    assert err.value.__notes__ == [RENDEZVOUS_HINT]

    def other() -> None:
        raise TransferTimeoutError("update_weights", [1], 1.0)

    with pytest.raises(TransferTimeoutError) as err2:
        hint_rendezvous(other)()
    assert not getattr(err2.value, "__notes__", None)  # only the rendezvous gets the hint


class RefusesFirstInit(WorkerClient):
    """A client whose engines refuse the first ``init_weight_transfer_engine`` before any worker joins (as
    patch 0008's gate does while the engines serve: a RuntimeError naming the wave), then take the next."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.refusals = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if self.refusals == 0:
            self.refusals += 1
            raise RuntimeError("init_weight_transfer_engine called while the engines serve (wave 3)")
        super().init_weight_transfer_engine(init_info)


def test_a_refused_init_releases_the_port_for_a_retry_on_it() -> None:
    """The controller's recovery from a refused init (pause, then init while paused: ``spec/controller.py``)
    retries with the same ``init_info``: the trainer abandons the rendezvous the refusal left waiting, so the
    store it hosted and its ``master_port`` are free at once (the retry failed with PortInUseError until the
    rendezvous deadline before), and the retried init and a round go through."""
    pairs = make_tensors(4)
    model = DictModel(model_spec())
    client = RefusesFirstInit(model)
    info = TrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        rank=0,
        timeout_s=30.0,
        group_backend="gloo",
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="wave 3"):
        BroadcastTrainerEngine.trainer_init(info, client=client)
    refused_s = time.monotonic() - t0
    assert refused_s < 10.0, refused_s  # the 5 s grace for the rendezvous's own error, not its 30 s deadline
    tr = BroadcastTrainerEngine.trainer_init(info, client=client)  # the same master_port, at once
    try:
        tr.send_weights(dict(pairs), weight_version="after-retry")
        assert all(bytes_equal(model.weights()[n], t.contiguous()) for n, t in pairs)
        assert client.version == "after-retry" and client.refusals == 1
    finally:
        tr.shutdown()
        client.worker.shutdown()
