"""CheckedEngine (acceptance 4) and recorded traces replayed against the tables (acceptance 3)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_util import Cluster, greedy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from weightsync.cli import main
from weightsync.impl.checked import CheckedEngine
from weightsync.impl.trace_replay import replay_trace
from weightsync.model.replay import TraceChecker
from weightsync.spec.errors import LocalProtocolError

pytestmark = pytest.mark.timeout(150)


class Spy:
    """Forwards engine-client calls, recording them; ``pause`` can be held back."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.release_pause = threading.Event()
        self.release_pause.set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in {"pause", "resume", "start_weight_update", "update_weights", "finish_weight_update"}:

            def wrapped(*a: Any, **k: Any) -> Any:
                self.calls.append(name)
                if name == "pause":
                    assert self.release_pause.wait(30)
                return attr(*a, **k)

            return wrapped
        return attr


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(dp_size=2, sync_interval=4)
    c.init_transfer()
    yield c
    c.close()


def test_checked_engine_rejects_illegal_calls_before_the_engine(cluster: Cluster) -> None:
    spy = Spy(cluster.client)
    eng = CheckedEngine(spy)
    # update_weights while running
    with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
        eng.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert spy.calls == []
    # resume while a pause is still in flight
    spy.release_pause.clear()
    th = threading.Thread(target=eng.pause, args=("keep",))
    th.start()
    deadline = time.monotonic() + 10
    while "pause" not in spy.calls and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(LocalProtocolError, match=r"resume is illegal .*in-flight call"):
        eng.resume()
    assert spy.calls == ["pause"]
    spy.release_pause.set()
    th.join(30)
    assert {s["state"] for s in cluster.client.get_state()} == {"verified"}
    # start twice
    eng.start_weight_update()
    with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state updating"):
        eng.start_weight_update()
    assert spy.calls == ["pause", "start_weight_update"]
    # resume while updating is illegal too; finish then resume is legal
    with pytest.raises(LocalProtocolError):
        eng.resume()
    from weightsync.impl.engine.weights import random_weights

    ws = random_weights(cluster.model, 5)
    assert cluster.trainer is not None
    cluster.trainer.client = eng  # a CheckedEngine is a VLLMWeightSyncClient: the trainer's calls are checked
    try:
        cluster.trainer.update(ws)
    finally:
        cluster.trainer.client = cluster.engine
    assert spy.calls == ["pause", "start_weight_update", "update_weights"]
    eng.finish_weight_update("checked-1")
    eng.resume()
    assert eng.violations == []
    assert cluster.client.get_weight_version() == "checked-1"
    assert {s["state"] for s in cluster.client.get_state()} == {"running"}


cycle = st.tuples(
    st.integers(0, 3),  # requests added before the pause
    st.sampled_from([0.0, 0.005, 0.02]),  # delay before the pause, seconds
    st.sampled_from(["abort", "keep"]),  # pause mode
    st.booleans(),  # clear_cache
    st.integers(0, 2),  # requests added while paused
)


@settings(
    max_examples=1,
    phases=[Phase.generate],
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cycles=st.lists(cycle, min_size=20, max_size=20))
def test_twenty_cycles_trace_replays_and_corruption_is_caught(
    cluster: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
    cycles: list[tuple[int, float, str, bool, int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from weightsync.impl.engine.weights import random_weights

    path = tmp_path_factory.mktemp("trace") / "cycles.jsonl"
    eng = CheckedEngine(cluster.client, trace_path=path)
    assert cluster.trainer is not None
    cluster.trainer.client = eng  # the trainer's update_weights goes through the checks
    streams = []
    try:
        for i, (n_before, delay, mode, clear, n_during) in enumerate(cycles):
            streams += [cluster.client.add_request([i % 50 + 1, 2], greedy(6)) for _ in range(n_before)]
            time.sleep(delay)
            eng.pause(mode, clear)
            streams += [cluster.client.add_request([3, i % 50 + 1], greedy(4)) for _ in range(n_during)]
            if i % 7 == 3:  # a relabel while paused: no transition, recorded and replayed
                eng.update_weight_version(f"relabel-{i}")
            eng.start_weight_update()
            cluster.trainer.update(random_weights(cluster.model, 100 + i))
            eng.finish_weight_update(f"step-{i}" if i % 2 else None)  # None: the version stays
            eng.resume()
    finally:
        cluster.trainer.client = cluster.engine
    for s in streams:
        s.wait(30)
        assert s.finish_reason in {"length", "abort"}
    cluster.client.trace_to(None)
    assert eng.violations == []
    res = replay_trace(path)
    assert res.ok, res.divergence.describe() if res.divergence else ""
    assert res.steps > 100 and res.collectives > 0 and res.relabels == 2 * 3  # 3 relabels x 2 ranks
    assert cluster.client.get_weight_version() == "step-19"  # vLLM's consensus: one str

    # corrupt one step: a rank 'finishes' an update it never started
    lines = path.read_text().splitlines()
    idx = next(i for i, ln in enumerate(lines) if '"event": "dp_step_done"' in ln and i > len(lines) // 2)
    rec = json.loads(lines[idx])
    rec["event"] = "finish_weight_update"
    lines[idx] = json.dumps(rec)
    bad = Path(str(path) + ".bad")
    bad.write_text("\n".join(lines) + "\n")
    res2 = replay_trace(bad)
    assert not res2.ok and res2.divergence is not None
    assert res2.divergence.line == idx + 1
    assert res2.divergence.event == "finish_weight_update"
    assert "illegal" in res2.divergence.reason
    assert "dp_step_done" in res2.divergence.legal

    # the model's composition check accepts the run: collective outcomes from the members' entry states
    checker = TraceChecker()
    res3 = replay_trace(path, checker)
    assert res3.ok, res3.divergence.describe() if res3.divergence else ""
    assert checker.outcomes_checked > 10 and checker.has_work_checked > 100 and not checker.notes

    # corrupt an outcome: one rank's DP sync result disagrees with what its members entered with
    lines = path.read_text().splitlines()
    idx = next(i for i, ln in enumerate(lines) if '"event": "dp_sync_done"' in ln and i > len(lines) // 2)
    rec = json.loads(lines[idx])
    rec["args"]["sum_pending_pause"] = int(rec["args"]["sum_pending_pause"]) + 1
    lines[idx] = json.dumps(rec)
    bad = Path(str(path) + ".outcome")
    bad.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    div = out["traces"][0]["divergence"]
    assert div["line"] == idx + 1 and div["rank"] == rec["rank"] and div["event"] == "dp_sync_done"
    assert "sum_pending_pause" in div["reason"] and "model" in div["reason"], div
    assert div["state"]["collective"] == "dp_sync" and div["legal"]
    assert main(["replay", str(path), "--json"]) == 0
    capsys.readouterr()


def test_update_weight_version_relabels_every_rank_in_any_state_and_replays(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM 0.32's ``update_weight_version`` (``v1/engine/core.py:1082``): a label set in any state, no table
    row. Every rank applies ``relabel_weight_version``, the shadows follow it, the trace records one
    ``relabel`` line per rank, ``weightsync replay`` applies it, and a corrupted relabel is caught."""
    from weightsync.impl.engine.client import WeightVersionMismatchError
    from weightsync.impl.engine.weights import random_weights

    path = tmp_path_factory.mktemp("relabel") / "relabel.jsonl"
    eng = CheckedEngine(cluster.client, trace_path=path)
    assert cluster.trainer is not None
    with pytest.raises(ValueError, match="must be a str"):
        eng.update_weight_version(7)  # type: ignore[arg-type]
    eng.update_weight_version("while-running")
    assert cluster.client.get_weight_versions() == ["while-running"] * 2
    assert {s["state"] for s in cluster.client.get_state()} == {"running"}  # no transition
    eng.pause("keep")
    eng.start_weight_update()
    eng.update_weight_version("while-updating")  # vLLM: any state, even mid-round
    cluster.trainer.client = eng
    try:
        cluster.trainer.update(random_weights(cluster.model, 7))
    finally:
        cluster.trainer.client = cluster.engine
    eng.finish_weight_update()  # no version: the relabelled one stays
    assert cluster.client.get_weight_version() == "while-updating"
    eng.resume()
    s = cluster.client.add_request([5, 6], greedy(3)).wait(30)
    assert s.versions == ["while-updating"] * 3  # outputs carry the label, as vLLM's
    # one rank relabelled alone: vLLM's consensus raises, naming each rank's version
    cluster.client.call_rank(1, "update_weight_version", new_version="odd-one").result(10)
    with pytest.raises(WeightVersionMismatchError, match=r"rank 0 'while-updating', rank 1 'odd-one'"):
        cluster.client.get_weight_version()
    eng.update_weight_version("agreed")
    cluster.client.trace_to(None)
    assert eng.violations == [] and cluster.client.get_weight_version() == "agreed"
    res = replay_trace(path, TraceChecker())
    assert res.ok, res.divergence.describe() if res.divergence else ""
    assert res.relabels == 7  # 3 through the checked engine x 2 ranks + rank 1 alone
    # a relabel record whose label the spec does not give diverges at its line
    lines = path.read_text().splitlines()
    idx = next(i for i, ln in enumerate(lines) if '"kind": "relabel"' in ln)
    rec = json.loads(lines[idx])
    rec["vars_after"]["weight_version"] = "forged"
    lines[idx] = json.dumps(rec)
    bad = Path(str(path) + ".bad")
    bad.write_text("\n".join(lines) + "\n")
    res2 = replay_trace(bad)
    assert not res2.ok and res2.divergence is not None and res2.divergence.line == idx + 1
    assert res2.divergence.event == "relabel" and "forged" in res2.divergence.reason
