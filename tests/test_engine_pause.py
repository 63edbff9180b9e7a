"""Multi-process pause-mode tests (issue 4, acceptance 1): 2 DP ranks (and one test with 3) over gloo."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from engine_util import Cluster, greedy, wait_tokens

from weightsync.impl.engine.client import RequestStream

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(dp_size=2, sync_interval=4, step_sleep_s=0.003)
    c.init_transfer()
    yield c
    c.close()


def _inflight(c: Cluster, n: int, max_new: int, tag: str) -> list[RequestStream]:
    streams = [
        c.client.add_request([1 + i, 2, 3 + i], greedy(max_new), req_id=f"{tag}-{i}") for i in range(n)
    ]
    wait_tokens(streams, 2)
    return streams


def test_abort_returns_partial_outputs_marked_aborted(cluster: Cluster) -> None:
    streams = _inflight(cluster, 4, 400, "abort")
    cluster.client.pause("abort")
    for s in streams:
        assert s.done.is_set(), "abort: pause returned before the request ended"
        assert s.finish_reason == "abort"
        assert 1 <= len(s.tokens) < 400
        assert len(s.logprobs) == len(s.tokens)
    # a request submitted while paused waits in the queue, then is served after resume
    late = cluster.client.add_request([5, 6], greedy(5), req_id="abort-late")
    time.sleep(0.2)
    assert late.tokens == []
    cluster.client.resume()
    late.wait(30)
    assert late.finish_reason == "length" and len(late.tokens) == 5
    assert {s["state"] for s in cluster.client.get_state()} == {"running"}


def _wait_round(c: Cluster, n: int, max_new: int, tag: str) -> None:
    streams = _inflight(c, n, max_new, tag)
    c.client.pause("wait", timeout=30)
    for s in streams:
        assert s.done.is_set(), "wait: pause returned while a running request was unfinished"
        assert s.finish_reason == "length" and len(s.tokens) == max_new
    late = c.client.add_request([7, 8], greedy(4), req_id=f"{tag}-late")
    time.sleep(0.2)
    assert late.tokens == []
    c.client.resume()
    assert late.wait(30).finish_reason == "length" and len(late.tokens) == 4


# The requests drain before the wave's first DP sync (K=64 steps, 20-token requests); the case where the
# consensus sync still sees running requests is test_wait_draining_across_a_sync_verifies (row
# 'sync_paused_and_idle': stop at the first later sync with no unfinished work).
def test_wait_drains_running_requests_before_pause_returns() -> None:
    c = Cluster(dp_size=2, sync_interval=64, step_sleep_s=0.003)
    try:
        _wait_round(c, 4, 20, "wait")
    finally:
        c.close()


@pytest.mark.slow
def test_wait_draining_across_a_sync_verifies() -> None:
    c = Cluster(dp_size=2, sync_interval=2, step_sleep_s=0.003, timeout_s=10)
    try:
        streams = _inflight(c, 2, 60, "wait-x")
        c.client.pause("wait", timeout=15)
        assert all(s.finish_reason == "length" for s in streams)
    finally:
        c.close()


def _keep_round(c: Cluster, seed: int, clear_cache: bool, n: int, tag: str) -> None:
    max_new = 120
    streams = _inflight(c, n, max_new, tag)
    c.client.pause("keep", clear_cache=clear_cache)
    before = {s.req_id: len(s.tokens) for s in streams}
    assert all(not s.done.is_set() for s in streams), "keep: a request finished during pause"
    late = c.client.add_request([9, 10], greedy(3), req_id=f"{tag}-late")
    old = c.client.get_weight_version()
    c.client.start_weight_update()
    from weightsync.impl.engine.weights import random_weights

    c.send(random_weights(c.model, seed))  # the trainer: update_weights || its broadcast
    version = f"{tag}-{seed}"
    c.client.finish_weight_update(version)
    frozen = {s.req_id: len(s.tokens) for s in streams}
    assert frozen == before, "keep: tokens were produced while paused"
    assert late.tokens == []
    assert c.client.get_weight_versions() == [version] * c.client.dp_size
    c.client.resume()
    for s in streams:
        s.wait(60)
        k = before[s.req_id]
        assert s.finish_reason == "length"
        assert len(s.tokens) == max_new, "keep: a token was lost or duplicated"
        assert len(s.logprobs) == max_new
        assert all(v == old for v in s.versions[:k])
        assert all(v == version for v in s.versions[k:])
        if clear_cache:
            # post-resume tokens equal a fresh run of the new weights from the same prefix
            ref, ref_lp = c.client.reference_generate(s.rank, list(s.prompt) + s.tokens[:k], max_new - k)
            assert s.tokens[k:] == ref
            assert s.logprobs[k:] == pytest.approx(ref_lp, abs=1e-4)
    assert late.wait(30).finish_reason == "length"


def test_keep_clear_cache_recomputes_kv_with_new_weights(cluster: Cluster) -> None:
    _keep_round(cluster, seed=11, clear_cache=True, n=4, tag="keepc")


def test_keep_without_clear_cache_keeps_all_tokens(cluster: Cluster) -> None:
    _keep_round(cluster, seed=12, clear_cache=False, n=3, tag="keepn")


@pytest.mark.slow
@pytest.mark.ci  # three engines through every mode: run once in CI (make test-slow-ci)
def test_three_ranks_all_modes() -> None:
    c = Cluster(dp_size=3, sync_interval=64, step_sleep_s=0.003)
    try:
        c.init_transfer()
        streams = _inflight(c, 3, 400, "three-abort")
        c.client.pause("abort")
        assert all(s.finish_reason == "abort" for s in streams)
        c.client.resume()
        _wait_round(c, 3, 20, "three-wait")
        _keep_round(c, seed=21, clear_cache=True, n=3, tag="three-keep")
        assert c.client.get_weight_version() == "three-keep-21"
    finally:
        c.close()


def test_a_pause_while_paused_is_taken_in_its_mode_and_every_call_returns(cluster: Cluster) -> None:
    """two-phase-epoch's rows for a pause at a rank whose pause is in flight (``spec/rank_tables.py``
    ``_repeated_pause_rows``; issue 19, found by ``check --mode any --repeat-pause``): a wait pause with
    requests running and a keep pause sent while it drains both return, whichever row the keep takes (the
    mode again before the consensus, a join after it, a no-op once verified); a third pause (abort) on the
    verified ranks returns at once and aborts nothing; after the resume every request finishes."""
    c = cluster.client
    streams = _inflight(cluster, 2, 150, "repeat")
    first = [c.call_rank(r, "pause", mode="wait", clear_cache=True) for r in range(c.dp_size)]
    second = [c.call_rank(r, "pause", mode="keep", clear_cache=True) for r in range(c.dp_size)]
    c.gather("pause", first, 60.0)
    c.gather("pause", second, 60.0)
    assert {s["state"] for s in c.get_state()} == {"verified"}
    c.pause("abort", timeout=10.0)
    assert {s["state"] for s in c.get_state()} == {"verified"}
    assert not any(s.finish_reason == "abort" for s in streams)
    c.resume()
    for s in streams:
        assert s.wait(60).finish_reason == "length" and len(s.tokens) == 150
    assert {s["state"] for s in c.get_state()} == {"running"}
