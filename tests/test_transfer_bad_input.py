"""Bad inputs to the transfer transports that used to hang or fail late (issue "Bad inputs that still hurt").

- Ranks disagreeing on ``world_size`` at init: every rank raises WireMismatchError naming each rank's value,
  within seconds (before: a group of the wrong size formed "fine", or a raw gloo error after 30 s).
- A trainer whose weight iterator raises: every engine raises PeerFailedError naming the trainer's exception
  at once (before: it waited out the deadline, 300 s by default); the trainer re-raises its own exception;
  the next round works.
- The same for a streaming trainer (``send_stream``: metadata declared up front, tensors pulled bucket by
  bucket, never gathered) whose stream raises mid-round: every rank aborts at the bucket being pulled, the
  engines naming the trainer's exception, the trainer re-raising it; the next round works.
- A non-pair item on the trainer is vetoed, so the engines fail at once too (a bad packing argument cannot
  reach a round any more: vLLM 0.32 fixes packing in ``init_info``, validated when it is built).
- Timeout errors say how the deadline was sized; without ``timeout_s`` a round's deadline is sized to its bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transfer_procs import (
    DictModel,
    bytes_equal,
    err,
    free_port,
    init_info,
    make_tensors,
    model_spec,
    ok,
    run_roles,
    update_info_for,
)

from weightsync.impl.transfer.base import InitInfo, ParallelInfo
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.ipc import IPCTrainer
from weightsync.impl.transfer.worker import WeightTransferWorker

pytestmark = pytest.mark.timeout(120)

#: the trainer's transport endpoint of each backend (the data plane of ``send_weights``)
TRAINERS: dict[str, type[BroadcastTrainer] | type[IPCTrainer]] = {"nccl": BroadcastTrainer, "ipc": IPCTrainer}
PACKED = {"packed": True, "packed_buffer_size_bytes": 4096, "packed_num_buffers": 2}


# ---------------------------------------------------------------------------------------------- roles


def trainer_init_ws(backend: str, port: int, world: int, timeout_s: float) -> str:
    tr = TRAINERS[backend](init_info(port, world, timeout_s))
    tr.close()
    return "joined"


def engine_init_ws(backend: str, port: int, world: int, dp_index: int, timeout_s: float) -> str:
    w = WeightTransferWorker(DictModel(model_spec()), backend, ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, timeout_s))
    w.shutdown()
    return "joined"


class ShardGone(RuntimeError):
    pass


def _failing(pairs: list[tuple[str, torch.Tensor]], after: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, p in enumerate(pairs):
        if i == after:
            raise ShardGone(f"checkpoint shard {i} is gone")
        yield p


def trainer_iterator_raises(backend: str, port: int, world: int, timeout_s: float) -> dict[str, Any]:
    tr = TRAINERS[backend](init_info(port, world, timeout_s, **PACKED))
    try:
        pairs = make_tensors(0)
        t0 = time.monotonic()
        try:
            tr.send(_failing(pairs, 2))
        except ShardGone as exc:  # the iterator's own exception, re-raised as is
            first = {"type": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0}
        else:
            raise AssertionError("send swallowed the iterator's exception")
        tr.send(iter(make_tensors(1)))
        return first
    finally:
        tr.close()


def engine_sees_trainer_failure(
    backend: str, port: int, world: int, dp_index: int, timeout_s: float
) -> dict[str, Any]:
    from weightsync.spec.errors import PeerFailedError

    model = DictModel(model_spec())
    w = WeightTransferWorker(model, backend, ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, timeout_s, **PACKED))
    before = model.weights()
    w.start_weight_update()
    t0 = time.monotonic()
    try:
        w.update_weights(update_info_for(make_tensors(0)))
    except PeerFailedError as exc:
        out: dict[str, Any] = {"msg": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - t0}
    else:
        raise AssertionError("update_weights succeeded although the trainer's iterator raised")
    out["unchanged"] = all(bytes_equal(before[n], t) for n, t in model.weights().items())
    # the round is still open; the next update (a good iterator) completes it
    w.update_weights(update_info_for(make_tensors(1)))
    w.finish_weight_update()
    out["weights"] = model.weights()
    out["version"] = w.weight_version
    w.shutdown()
    return out


def trainer_stream_raises(
    backend: str, port: int, world: int, timeout_s: float, after: int
) -> dict[str, Any]:
    info = InitInfo.parse(init_info(port, world, timeout_s, **PACKED))
    tr: BroadcastTrainer | IPCTrainer = BroadcastTrainer(info) if backend == "nccl" else IPCTrainer(info)
    try:
        pairs = make_tensors(0)
        declared = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
        t0 = time.monotonic()
        try:
            tr.send_stream(declared, _failing(pairs, after))
        except ShardGone as exc:  # the stream's own exception, re-raised as is
            first = {"type": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0}
        else:
            raise AssertionError("send_stream swallowed the stream's exception")
        good = make_tensors(1)
        tr.send_stream([(n, t.dtype, tuple(t.shape)) for n, t in good], iter(good))
        return first
    finally:
        tr.close()


def engine_sees_stream_failure(
    backend: str, port: int, world: int, dp_index: int, timeout_s: float
) -> dict[str, Any]:
    """As :func:`engine_sees_trainer_failure`, but the failed round may have loaded some buckets, so the
    worker abandons it (``fail_round``, as the engine core does) and the good stream comes in a new round."""
    from weightsync.spec.errors import PeerFailedError

    model = DictModel(model_spec())
    w = WeightTransferWorker(model, backend, ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, timeout_s, **PACKED))
    before = model.weights()
    w.start_weight_update()
    t0 = time.monotonic()
    try:
        w.update_weights(update_info_for(make_tensors(0)))
    except PeerFailedError as exc:
        out: dict[str, Any] = {"msg": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - t0}
    else:
        raise AssertionError("update_weights succeeded although the trainer's stream raised")
    out["unchanged"] = all(bytes_equal(before[n], t) for n, t in model.weights().items())
    w.fail_round()
    w.start_weight_update()
    w.update_weights(update_info_for(make_tensors(1)))
    w.finish_weight_update()
    out["weights"] = model.weights()
    out["version"] = w.weight_version
    w.shutdown()
    return out


def trainer_bad_items(port: int, world: int, items: list[Any]) -> None:
    tr = BroadcastTrainer(init_info(port, world, 20.0, **PACKED))
    try:
        tr.send(iter(items))
    finally:
        tr.close()


def engine_update_once(port: int, world: int, dp_index: int, info: dict[str, Any]) -> None:
    w = WeightTransferWorker(DictModel(model_spec()), "nccl", ParallelInfo(dp_index=dp_index))
    w.init_weight_transfer_engine(init_info(port, world, 20.0, **PACKED))
    w.start_weight_update()
    w.update_weights(info)


def trainer_send_times_out(port: int, world: int, info: dict[str, Any], floor_s: float | None) -> None:
    from weightsync.impl.transfer import request_info

    if floor_s is not None:  # a short floor so the sized default is reached quickly in a test
        request_info.DEFAULT_ROUND_FLOOR_S = floor_s
    tr = BroadcastTrainer(info)
    try:
        tr.send(iter(make_tensors(0)))
    finally:
        tr.close()


def engine_joins_then_idles(port: int, world: int, info: dict[str, Any], idle_s: float) -> str:
    w = WeightTransferWorker(DictModel(model_spec()), "nccl", ParallelInfo(dp_index=0))
    w.init_weight_transfer_engine(info)
    time.sleep(idle_s)
    return "idle"


# ---------------------------------------------------------------------------------------------- tests


def _ws_message(sizes: list[int]) -> str:
    shown = ", ".join(f"rank {r}{' (trainer)' if r == 0 else ''} says {w}" for r, w in enumerate(sizes))
    return (
        f"init_weight_transfer_engine: the ranks disagree on world_size: {shown}; every rank (the trainer "
        "and each engine worker) must pass the same world_size, 1 + the number of engine workers; "
        "no group was formed"
    )


@pytest.mark.parametrize(
    ("backend", "sizes"),
    [
        ("nccl", [3, 2, 3]),  # the trainer says 3, an engine says 2
        ("nccl", [2, 3, 3]),  # the reverse: the trainer says 2, the engines 3
        ("nccl", [3, 2]),  # one engine: it would have joined "fine" (all_joined at 2), gloo then hangs
        ("nccl", [2, 3]),
        ("ipc", [3, 2, 3]),
    ],
)
def test_world_size_disagreement_raises_on_every_rank_within_seconds(backend: str, sizes: list[int]) -> None:
    port, timeout = free_port(), 20.0
    roles: list[Any] = [(trainer_init_ws, (backend, port, sizes[0], timeout))]
    roles += [(engine_init_ws, (backend, port, w, i, timeout)) for i, w in enumerate(sizes[1:])]
    t0 = time.monotonic()
    res = run_roles(roles, deadline_s=timeout + 10)
    elapsed = time.monotonic() - t0
    for r in res:
        msg, _ = err(r, "WireMismatchError")
        assert msg == _ws_message(sizes)
    assert elapsed < timeout / 2, f"took {elapsed:.1f} s of a {timeout} s timeout"


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_trainer_iterator_raising_fails_every_engine_at_once(backend: str) -> None:
    port, world, timeout = free_port(), 3, 30.0
    t0 = time.monotonic()
    res = run_roles(
        [
            (trainer_iterator_raises, (backend, port, world, timeout)),
            (engine_sees_trainer_failure, (backend, port, world, 0, timeout)),
            (engine_sees_trainer_failure, (backend, port, world, 1, timeout)),
        ],
        deadline_s=timeout + 20,
    )
    assert time.monotonic() - t0 < timeout
    trainer = ok(res[0])
    assert trainer["type"] == "ShardGone" and trainer["msg"] == "checkpoint shard 2 is gone"
    assert trainer["elapsed"] < 6
    for e in (ok(r) for r in res[1:]):
        assert e["msg"] == (
            "update_weights/wire_agreement (round 1): rank(s) 0 failed: rank 0: the trainer's weight iterator "
            "raised ShardGone: checkpoint shard 2 is gone after 2 tensor(s); no payload was sent and every "
            "rank aborts this update"
        )
        assert e["ranks"] == (0,)
        assert e["elapsed"] < 3, f"engine waited {e['elapsed']:.1f} s of a {timeout} s timeout"
        assert e["unchanged"]
        # the following round with a good iterator arrived bit-exact
        assert e["version"] == 1
        for name, sent in make_tensors(1):
            assert bytes_equal(e["weights"][name], sent.contiguous()), name


@pytest.mark.parametrize("after", [0, 2], ids=["first-bucket", "second-bucket"])
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_trainer_stream_raising_fails_every_engine_at_once(backend: str, after: int) -> None:
    """A streamed round (wt-d's ``TensorFeed``) under main's rule: a raising trainer iterator aborts every
    rank at once naming its exception. With B=4096 the embedding (8 KiB) is bucket 0 alone, so ``after=2``
    fails while bucket 1 is being pulled, after bucket 0 was loaded."""
    port, world, timeout = free_port(), 3, 30.0
    t0 = time.monotonic()
    res = run_roles(
        [
            (trainer_stream_raises, (backend, port, world, timeout, after)),
            (engine_sees_stream_failure, (backend, port, world, 0, timeout)),
            (engine_sees_stream_failure, (backend, port, world, 1, timeout)),
        ],
        deadline_s=timeout + 20,
    )
    assert time.monotonic() - t0 < timeout
    trainer = ok(res[0])
    assert trainer["type"] == "ShardGone" and trainer["msg"] == f"checkpoint shard {after} is gone"
    assert trainer["elapsed"] < 6
    where = (
        f"update_weights/bucket (round 1, b{0 if after == 0 else 1})"
        if backend == "nccl"
        else "update_weights/ipc_ack (round 1)"
    )
    for e in (ok(r) for r in res[1:]):
        assert e["msg"] == (
            f"{where}: rank(s) 0 failed: rank 0: the trainer's weight iterator raised ShardGone: checkpoint "
            f"shard {after} is gone after {after} tensor(s); every rank aborts this update"
        )
        assert e["ranks"] == (0,)
        assert e["elapsed"] < 3, f"engine waited {e['elapsed']:.1f} s of a {timeout} s timeout"
        if after == 0:
            assert e["unchanged"]
        # the following streamed round arrived bit-exact
        assert e["version"] == 1
        for name, sent in make_tensors(1):
            assert bytes_equal(e["weights"][name], sent.contiguous()), name


def test_trainer_side_bad_item_is_vetoed_so_engines_fail_at_once() -> None:
    port, world = free_port(), 3
    items: list[Any] = make_tensors(0)
    items[-1] = ("model.norm.weight", 5)
    trainer_msg = (
        "send_weights: weight 7 is not a (non-empty str name, torch.Tensor) pair: got tuple of str, int"
    )
    info = update_info_for(make_tensors(0))
    t0 = time.monotonic()
    res = run_roles(
        [
            (trainer_bad_items, (port, world, items)),
            (engine_update_once, (port, world, 0, info)),
            (engine_update_once, (port, world, 1, info)),
        ]
    )
    assert time.monotonic() - t0 < 15
    msg, _ = err(res[0], "ValueError")
    assert msg == trainer_msg
    for r in res[1:]:
        msg, _ = err(r, "WireMismatchError")
        detail = trainer_msg.removeprefix("send_weights: ")
        assert msg == (
            "update_weights/wire_agreement (round 1): rank(s) 0 rejected the update before any payload "
            f"moved: rank 0: {detail}"
        )


def test_round_deadline_is_sized_to_the_work() -> None:
    base = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    auto = InitInfo.parse(base)
    assert auto.timeout_s is None and auto.rendezvous_timeout_s == 300.0
    assert auto.rendezvous_timeout_basis == "timeout 300 s: the default, init_info has no timeout_s"
    assert auto.round_deadline(12_000_000) == (
        60.24,
        "timeout 60.2 s sized to the round: 60 s floor + 12000000 bytes at a conservative 50 MB/s "
        "(init_info has no timeout_s; set it to fix every deadline)",
    )
    assert auto.round_deadline(16 << 30)[0] == pytest.approx(60 + (16 << 30) / 50e6)
    assert auto.round_deadline(None)[0] == 60.0
    fixed = InitInfo.parse({**base, "timeout_s": 7.5})
    assert fixed.round_deadline(16 << 30) == (7.5, "timeout 7.5 s: init_info['timeout_s']")
    assert fixed.rendezvous_timeout_s == 7.5


@pytest.mark.parametrize(
    ("timeout_s", "floor_s", "basis"),
    [
        (2.0, None, "timeout 2 s: init_info['timeout_s']"),
        (None, 2.0, "sized to the round: 2 s floor + "),
    ],
    ids=["given", "sized"],
)
def test_timeout_error_says_how_the_deadline_was_sized(
    timeout_s: float | None, floor_s: float | None, basis: str
) -> None:
    """The engine joins but never calls update_weights: the trainer's wire agreement times out naming it."""
    port, world = free_port(), 2
    info = init_info(port, world, 20.0)
    if timeout_s is None:
        del info["timeout_s"]
    else:
        info["timeout_s"] = timeout_s
    t0 = time.monotonic()
    res = run_roles(
        [
            (trainer_send_times_out, (port, world, info, floor_s)),
            (engine_joins_then_idles, (port, world, info, 4.0)),
        ],
        deadline_s=40,
    )
    assert time.monotonic() - t0 < 30
    msg, attrs = err(res[0], "TransferTimeoutError")
    assert attrs["phase"] == "update_weights/wire_agreement" and attrs["missing_ranks"] == (1,)
    assert 1.5 < attrs["seconds"] < 5
    assert basis in msg, msg
    assert ok(res[1]) == "idle"
