"""Failures as table rows, and a resume that is always safe, on real engine processes (2 DP ranks, gloo).

- A stray resume (no pause before it) with a request in flight, and a double resume with a request between
  the two, leave every rank running and the requests served (the table's RUNNING/RESUME row is a no-op).
- An illegal call on the raw engine client is refused with LocalProtocolError and the ranks keep serving.
- A weight-transfer round that fails at init, start, mid-update or finish leaves every rank in ``failed``:
  no request is served, resume is refused, the version does not move; a new round recovers it.
- The opt-in monotonic guard refuses an older ``weight_version`` and the engines never go backwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_util import Cluster, greedy
from faulty_worker import ENV

from weightsync.impl.engine.controller import update_round
from weightsync.impl.engine.scheduler import reference_generate
from weightsync.impl.engine.weights import random_weights, update_info_for
from weightsync.spec.errors import LocalProtocolError, WeightSyncError

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("faults")
    old = os.environ.get(ENV)
    os.environ[ENV] = str(d)  # inherited by the engine processes at spawn
    yield d
    if old is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = old


@pytest.fixture(scope="module")
def cluster(faults: Path) -> Iterator[Cluster]:
    c = Cluster(
        dp_size=2, sync_interval=4, timeout_s=TIMEOUT_S, transfer="faulty_worker:faulty_broadcast_worker"
    )
    c.init_transfer()
    yield c
    c.close()


def _states(c: Cluster) -> list[str]:
    return [s["state"] for s in c.client.get_state()]


def _serves(c: Cluster, tag: str) -> None:
    """A request on each rank is served to its full length, with the tokens of the trainer's weights."""
    for r in range(c.client.dp_size):
        s = c.client.add_request([3, 1 + r, 4], greedy(6), req_id=f"{tag}-{r}")
        assert s.wait(30).finish_reason == "length" and len(s.tokens) == 6


def _round(c: Cluster, seed: int, version: str, names: int | None = None) -> list[tuple[str, object]]:
    """start -> update (the trainer sends ``names`` weights, all by default) -> finish(version)."""
    ws = random_weights(c.model, seed)
    sent = ws if names is None else ws[:names]
    c.client.start_weight_update()
    c.send(sent)  # the trainer: update_weights through the client, concurrently with its broadcast
    c.client.finish_weight_update(version)
    return list(ws)


def test_stray_and_double_resume_with_requests_in_flight(cluster: Cluster) -> None:
    c = cluster
    c.client.resume()  # stray: no pause before it, engines idle
    assert _states(c) == ["running", "running"]
    # a resume racing a request: the request is in flight on rank 0 while the resume arrives
    s0 = c.client.add_request([1, 2, 3], greedy(40), req_id="stray-race", rank=0)
    c.client.resume()
    assert s0.wait(30).finish_reason == "length" and len(s0.tokens) == 40
    # a double resume with a request between the two (a retry after a pause/update/resume cycle)
    assert c.trainer is not None
    update_round(c.client, c.trainer, random_weights(c.model, 1))
    s1 = c.client.add_request([4, 5], greedy(30), req_id="double-between", rank=1)
    c.client.resume()
    assert s1.wait(30).finish_reason == "length" and len(s1.tokens) == 30
    assert _states(c) == ["running", "running"]
    _serves(c, "after-resumes")


def test_illegal_call_on_raw_engine_is_refused_and_ranks_keep_serving(cluster: Cluster) -> None:
    c = cluster
    with pytest.raises(LocalProtocolError, match=r"update_weights.*illegal in state running"):
        c.client.update_weights(update_info_for(random_weights(c.model, 2)))
    with pytest.raises(LocalProtocolError, match=r"finish_weight_update.*illegal in state running"):
        c.client.finish_weight_update()
    assert _states(c) == ["running", "running"]
    _serves(c, "after-illegal")


@pytest.mark.parametrize("phase", ["init", "start", "update", "finish"])
def test_failed_round_reaches_failed_and_a_new_round_recovers(
    cluster: Cluster, faults: Path, phase: str
) -> None:
    c = cluster
    before = c.client.get_weight_versions()
    c.client.pause("keep")
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError):
        if phase == "init":
            for r in range(2):
                (faults / f"init-{r}").touch()
            c.init_transfer()
        elif phase == "finish":  # real: the trainer sends all but the last weight (IncompleteUpdateError)
            _round(c, 10, "never", names=len(random_weights(c.model, 10)) - 1)
        else:
            for r in range(2):
                (faults / f"{phase}-{r}").touch()
            _round(c, 10, "never")
    assert time.monotonic() - t0 < 4 * TIMEOUT_S
    for f in faults.iterdir():
        f.unlink()
    assert _states(c) == ["failed", "failed"], phase
    assert c.client.get_weight_versions() == before  # a failed round never moves the version
    late = c.client.add_request([2, 7, 1], greedy(5), req_id=f"late-{phase}")
    with pytest.raises(LocalProtocolError, match="refused in state failed"):
        c.client.resume()
    time.sleep(0.3)
    assert late.tokens == []  # partial weights are never served
    # recovery without a restart: (init again after a failed init,) a new round, then resume
    if phase == "init":
        c.init_transfer()
    ws = _round(c, 11 + len(phase), f"recovered-{phase}")
    assert _states(c) == ["verified", "verified"]
    assert c.client.get_weight_version() == f"recovered-{phase}"  # vLLM's consensus
    assert c.client.get_weight_versions() == [f"recovered-{phase}"] * 2
    c.client.resume()
    assert late.wait(30).finish_reason == "length"
    c.model.load_weights(ws)
    want, _ = reference_generate(c.model, [2, 7, 1], 5)
    assert late.tokens == want


def test_monotonic_guard_refuses_an_older_version(cluster: Cluster) -> None:
    c = cluster
    c.client.pause("keep")
    _round(c, 20, "step-5")
    c.client.start_weight_update()
    c.send(random_weights(c.model, 21))
    with pytest.raises(ValueError, match="no trailing step number"):  # before anything is sent
        c.client.finish_weight_update("latest", monotonic=True)
    with pytest.raises(
        LocalProtocolError, match=r"weight_version 'step-3' is older than the served 'step-5'"
    ):
        c.client.finish_weight_update("step-3", monotonic=True)
    assert _states(c) == ["failed", "failed"]
    assert c.client.get_weight_versions() == ["step-5", "step-5"]  # never backwards
    _round(c, 22, "step-6")
    c.client.resume()
    assert c.client.get_weight_versions() == ["step-6", "step-6"]
    _serves(c, "after-monotonic")
