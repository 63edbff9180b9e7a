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
from weightsync.impl.checked import CheckedEngine, replay_trace
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
    from weightsync.impl.engine.weights import random_weights, update_info_for

    ws = random_weights(cluster.model, 5)
    assert cluster.trainer is not None
    t = threading.Thread(target=cluster.send, args=(ws,))
    t.start()
    eng.update_weights(update_info_for(ws))
    t.join(30)
    eng.finish_weight_update()
    eng.resume()
    assert eng.violations == []
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
    path = tmp_path_factory.mktemp("trace") / "cycles.jsonl"
    eng = CheckedEngine(cluster.client, trace_path=path)
    c = Cluster.__new__(Cluster)
    c.__dict__.update(cluster.__dict__)
    c.engine = eng
    streams = []
    for i, (n_before, delay, mode, clear, n_during) in enumerate(cycles):
        streams += [cluster.client.add_request([i % 50 + 1, 2], greedy(6)) for _ in range(n_before)]
        time.sleep(delay)
        eng.pause(mode, clear)
        streams += [cluster.client.add_request([3, i % 50 + 1], greedy(4)) for _ in range(n_during)]
        eng.start_weight_update()
        from weightsync.impl.engine.weights import random_weights, update_info_for

        ws = random_weights(cluster.model, 100 + i)
        assert cluster.trainer is not None
        t = threading.Thread(target=cluster.send, args=(ws,))
        t.start()
        eng.update_weights(update_info_for(ws))
        t.join(30)
        eng.finish_weight_update()
        eng.resume()
    for s in streams:
        s.wait(30)
        assert s.finish_reason in {"length", "abort"}
    cluster.client.trace_to(None)
    assert eng.violations == []
    res = replay_trace(path)
    assert res.ok, res.divergence.describe() if res.divergence else ""
    assert res.steps > 100 and res.collectives > 0
    versions = cluster.client.get_weight_version()
    assert len(set(versions)) == 1

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
