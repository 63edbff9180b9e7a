"""Malformed requests on a 2-rank DP cluster (issue "Bad inputs that still hurt", part 1).

A bad request gets its own error: the front-end rejects it with a ValueError before anything is sent; one
that bypasses the front-end reaches an engine, whose scheduler ends it with ``finish_reason="error"``
instead of raising in the busy loop. Either way both ranks keep serving and a weight round still works.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_util import CFG, Cluster, greedy

from weightsync.impl.engine.client import DPEngineClient, RequestStream
from weightsync.impl.engine.messages import Request
from weightsync.impl.models.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

V = CFG.vocab_size  # 64
P = CFG.max_position_embeddings  # 512


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(dp_size=2, sync_interval=4, timeout_s=10.0)
    c.init_transfer()
    yield c
    c.close()


def _unchecked(**changes: object) -> SamplingParams:
    """SamplingParams with fields set past its own ``__post_init__`` checks (a foreign or corrupted client)."""
    p = greedy(4)
    for k, v in changes.items():
        object.__setattr__(p, k, v)
    return p


def _bypass(client: DPEngineClient, req: Request, rank: int) -> RequestStream:
    """Send ADD straight to ``rank``, skipping ``add_request``'s validation (as a foreign front-end would)."""
    stream = RequestStream(req.req_id, rank, tuple(req.prompt))
    with client._lock:
        client.streams[req.req_id] = stream
        client._submit(rank, req)  # the front-end table: ADD stamped with the believed wave
    return stream


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1, 2, 3, 9999], None, f"prompt token id 9999 at position 3 is outside the vocabulary [0, {V})"),
        ([-1, 2], None, f"prompt token id -1 at position 0 is outside the vocabulary [0, {V})"),
        ([1, V], None, f"prompt token id {V} at position 1 is outside the vocabulary [0, {V})"),
        (
            [],
            None,
            "prompt must be non-empty (got 0 token ids); every request needs at least one prompt token",
        ),
        ([1, 2.5], None, "prompt token id 2.5 at position 1 is not an int token id (got float)"),
        ([1, True], None, "prompt token id True at position 1 is not an int token id"),
        ([1], _unchecked(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
        ([1], _unchecked(max_new_tokens=-3), "max_new_tokens must be an int >= 1, got -3"),
        ([1], _unchecked(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (
            [1],
            _unchecked(stop_token_ids=(3, 700)),
            f"stop token id 700 at position 1 is outside the vocabulary [0, {V})",
        ),
        (
            [1] * (P - 2),
            greedy(4),
            f"prompt of {P - 2} tokens with max_new_tokens 4 needs {P + 1} positions, more than the model's "
            f"max_position_embeddings {P} (rule: len(prompt) + max_new_tokens - 1 <= max_position_embeddings)",
        ),
    ],
    ids=[
        "oov",
        "negative",
        "vocab-size",
        "empty",
        "float",
        "bool",
        "max-new-0",
        "max-new-neg",
        "nan-temp",
        "stop-oov",
        "too-long",
    ],
)
def test_front_end_rejects_before_sending(
    cluster: Cluster, prompt: list[object], params: SamplingParams | None, message: str
) -> None:
    c = cluster.client
    before = dict(c.streams)
    with pytest.raises(ValueError) as ei:
        c.add_request(prompt, params, req_id="bad")  # type: ignore[arg-type]
    assert str(ei.value) == f"add_request: {message}"
    assert c.streams == before  # nothing registered, nothing sent
    # the same request bypassing the front-end: the engine ends it with its own error, nothing else
    rank = len(message) % 2
    req = Request(f"bypass-{len(before)}", tuple(prompt), params or greedy(4))  # type: ignore[arg-type]
    s = _bypass(c, req, rank).wait(15)
    assert s.finish_reason == "error" and s.tokens == []
    assert s.error == f"ValueError: {message} (rejected by engine rank {rank})"
    assert not c.failures


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("dp_size", 0, "an int of at least 1"),
        ("dp_size", True, "an int of at least 1"),
        ("sync_interval", 0, "an int of at least 1"),
        ("max_batch", -1, "an int of at least 1"),
        ("threads", 1.5, "an int of at least 1"),
        ("collective_timeout_s", 0.0, "finite number of seconds above 0"),
        ("collective_timeout_s", float("nan"), "finite number of seconds above 0"),
        ("idle_sleep_s", -0.1, "finite number of seconds at least 0"),
        ("step_sleep_s", float("inf"), "finite number of seconds at least 0"),
        ("dp_port", 70000, "0 \\(pick a free port\\) or 1..65535"),
    ],
)
def test_engine_config_refuses_a_bad_number_before_any_process_starts(
    field: str, value: object, rule: str
) -> None:
    """``EngineConfig`` checks its numbers at construction: ``dp_size=0`` would otherwise start a cluster of
    no engine without an error, and ``sync_interval=0`` fail inside the spawned engines as a startup
    failure."""
    from weightsync.impl.engine.config import EngineConfig

    with pytest.raises(ValueError, match=rf"^EngineConfig\.{field}={value!r}: must be .*{rule}"):
        EngineConfig(model=CFG, **{field: value})  # type: ignore[arg-type]


def test_sampling_params_reject_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^max_new_tokens must be >= 1, got 0$"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1.0$"):
        SamplingParams(temperature=-1.0)


def test_front_end_rejects_bad_rank_params_and_duplicate_ids(cluster: Cluster) -> None:
    c = cluster.client
    with pytest.raises(ValueError, match=r"^add_request: rank 2 outside \[0, 2\)$"):
        c.add_request([1], greedy(2), rank=2)
    with pytest.raises(ValueError, match=r"^add_request: params must be a SamplingParams, got dict$"):
        c.add_request([1], {"max_new_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^add_request: prompt must be a sequence of int token ids, got str$"
    ):
        c.add_request("hello")  # type: ignore[arg-type]
    first = c.add_request([1, 2], greedy(300), req_id="dup", rank=0)
    with pytest.raises(ValueError) as ei:
        c.add_request([3], greedy(2), req_id="dup", rank=1)
    assert str(ei.value) == (
        "add_request: req_id 'dup' is already in flight on rank 0; request ids must be unique among "
        "unfinished requests"
    )
    c.abort("dup")
    assert first.wait(30).finish_reason == "abort"
    # a finished id may be reused
    assert c.add_request([3], greedy(2), req_id="dup", rank=1).wait(30).finish_reason == "length"
    assert not c.failures


def test_scheduler_ends_bad_and_duplicate_requests_with_their_own_error() -> None:
    """The engine-side defence on its own: rejected requests end at admission, good ones are unaffected."""
    import torch

    from weightsync.impl.engine.scheduler import Scheduler
    from weightsync.impl.engine.weights import random_weights
    from weightsync.impl.models.causal_lm import CausalLM

    torch.manual_seed(0)
    model = CausalLM(CFG)
    model.load_weights(random_weights(model, 3))
    sched = Scheduler(model, rank=1, max_batch=2)
    sched.add(Request("good", (1, 2, 3), greedy(3)))
    sched.add(Request("good", (4,), greedy(3)))  # duplicate id while "good" waits
    sched.add(Request("oov", (1, 2, 3, 9999), greedy(3)))
    sched.add(Request("empty", (), greedy(3)))
    sched.add(Request("params", (1,), None))  # type: ignore[arg-type]
    sched.add("not a request")  # type: ignore[arg-type]
    sched.add(Request("good2", (5,), greedy(2)))  # a one-token prompt prefills (it used to decode)
    assert len(sched.waiting) == 7 and sched.has_work()
    first = sched.step()
    errors = {d.req_id: d.error for d in first if d.finish_reason == "error"}
    assert errors == {
        "good": "ValueError: req_id 'good' is already in flight on this rank; request ids must be unique "
        "(rejected by engine rank 1)",
        "oov": f"ValueError: prompt token id 9999 at position 3 is outside the vocabulary [0, {V}) "
        "(rejected by engine rank 1)",
        "empty": "ValueError: prompt must be non-empty (got 0 token ids); every request needs at least one "
        "prompt token (rejected by engine rank 1)",
        "params": "ValueError: params must be a SamplingParams, got NoneType (rejected by engine rank 1)",
        # not even a Request: it has no req_id to name, and still ends (never raises, never runs)
        "": "ValueError: expected a Request, got str (rejected by engine rank 1)",
    }
    assert all(d.tokens == () for d in first if d.finish_reason == "error")
    finished: dict[str, str] = {}
    for d in first:
        if d.finish_reason not in (None, "error"):
            finished[d.req_id] = d.finish_reason
    while sched.has_work():
        for d in sched.step():
            if d.finish_reason is not None:
                finished[d.req_id] = d.finish_reason
    assert finished == {"good": "length", "good2": "length"}
    assert not sched.waiting and not sched.running


def test_bad_requests_on_both_ranks_then_both_serve_and_a_weight_round_works(cluster: Cluster) -> None:
    c = cluster.client
    # good requests in flight on both ranks while the bad ones arrive
    long_ = [c.add_request([5, 6, 7], greedy(60), req_id=f"long-{r}", rank=r) for r in (0, 1)]
    bad = [_bypass(c, Request(f"oov-{r}", (1, 2, 3, 9999), greedy(4)), r) for r in (0, 1)] + [
        _bypass(c, Request(f"neg-{r}", (-5,), _unchecked(max_new_tokens=0)), r) for r in (0, 1)
    ]
    for r, s in enumerate(bad[:2]):
        assert s.wait(15).finish_reason == "error"
        assert s.error == (
            f"ValueError: prompt token id 9999 at position 3 is outside the vocabulary [0, {V}) "
            f"(rejected by engine rank {r})"
        )
    for r, s in enumerate(bad[2:]):
        assert s.wait(15).finish_reason == "error"
        assert s.error == (
            f"ValueError: prompt token id -5 at position 0 is outside the vocabulary [0, {V}) "
            f"(rejected by engine rank {r})"
        )
    for s in long_:
        assert s.wait(30).finish_reason == "length" and len(s.tokens) == 60
    assert not c.failures
    assert {v["state"] for v in c.get_state()} == {"running"}
    # a fresh good request on each rank is served (one-token prompts included)
    for r in (0, 1):
        for prompt in ([1, 2, 3], [7]):
            s = c.add_request(prompt, greedy(5), req_id=f"after-bad-{r}-{len(prompt)}", rank=r).wait(30)
            assert s.finish_reason == "length" and len(s.tokens) == 5 and s.error is None
    # and a weight round still works on both ranks
    v0 = c.get_weight_version()
    cluster.update(seed=11, mode="keep", weight_version=f"{v0}+bad-input")
    assert c.get_weight_versions() == [f"{v0}+bad-input"] * 2
    for r in (0, 1):
        s = c.add_request([4, 5], greedy(3), req_id=f"after-round-{r}", rank=r).wait(30)
        assert s.finish_reason == "length" and s.versions == [f"{v0}+bad-input"] * 3
    assert not c.failures


def _ws_message(sizes: dict[int, int]) -> str:
    shown = ", ".join(f"rank {r}{' (trainer)' if r == 0 else ''} says {w}" for r, w in sorted(sizes.items()))
    return (
        f"init_weight_transfer_engine: the ranks disagree on world_size: {shown}; every rank (the trainer "
        "and each engine worker) must pass the same world_size, 1 + the number of engine workers; "
        "no group was formed"
    )


@pytest.mark.parametrize(("trainer_ws", "engine_ws"), [(3, 2), (2, 3)])
def test_world_size_disagreement_on_the_dp_cluster_fails_every_side_within_the_timeout(
    trainer_ws: int, engine_ws: int
) -> None:
    """2 DP engines (transfer ranks 1, 2) and a trainer that disagree on world_size: every side raises
    within the configured timeout, naming each rank's world_size; nothing hangs."""
    import threading
    import time

    from weightsync.impl.engine.client import free_port
    from weightsync.impl.transfer.broadcast import BroadcastTrainer
    from weightsync.spec.errors import WireMismatchError

    timeout = 10.0
    c = Cluster(dp_size=2, sync_interval=4, timeout_s=timeout)
    try:
        port = free_port()
        info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "timeout_s": timeout,
            "group_backend": "gloo",
        }
        box: list[BaseException] = []

        def trainer() -> None:
            try:
                BroadcastTrainer({**info, "world_size": trainer_ws})
            except BaseException as exc:
                box.append(exc)

        th = threading.Thread(target=trainer)
        t0 = time.monotonic()
        th.start()
        with pytest.raises(WireMismatchError):
            c.client.init_weight_transfer_engine({**info, "world_size": engine_ws}, timeout=timeout + 5)
        th.join(timeout + 5)
        elapsed = time.monotonic() - t0
        assert not th.is_alive() and elapsed < timeout, f"{elapsed:.1f} s"
        # the failed init is a table event: every engine is in `failed` with its own error
        assert [st["state"] for st in c.client.get_state()] == ["failed", "failed"]
        errors = {r: c.client.call_rank(r, "round_error").result(10.0) for r in range(2)}
        if engine_ws == 2:  # engine 1 would be rank 2 of 2: rejected locally; the others see 3 vs 2
            seen = {0: 3, 1: 2}
            assert errors[1] == (
                "ValueError: transfer rank 2 = rank_offset 1 + dp_index 1 * 1 + local_rank 0 is outside 1..1 "
                "(world_size=2; vLLM PR #36940)"
            )
            mismatched = [0]
        else:
            seen = {0: 2, 1: 3, 2: 3}
            mismatched = [0, 1]
        assert [type(e).__name__ for e in box] == ["WireMismatchError"]
        assert str(box[0]) == _ws_message(seen)
        for r in mismatched:
            assert errors[r] == f"WireMismatchError: {_ws_message(seen)}"
    finally:
        c.close()


def test_a_raw_pause_with_a_bad_mode_or_argument_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    """A pause that skips the client's own check (a foreign controller) is refused by the rank with the
    spec's ``call_args`` error, before the table sees it: the rank stays running, unharmed, and serves."""
    c = cluster.client
    with pytest.raises(
        Exception, match=r"pause: mode='bogus' is no pause mode; use one of \['abort', 'wait', 'keep'\]"
    ):
        c.call_rank(0, "pause", mode="bogus").result(10.0)
    with pytest.raises(Exception, match=r"pause takes no argument\(s\) \['drain'\]; its arguments are"):
        c.call_rank(1, "pause", mode="keep", drain=True).result(10.0)
    for r in (0, 1):
        st = c.call_rank(r, "get_state").result(10.0)
        assert (st["state"], st["pause_state"], st["pending_pause"]) == ("running", 0, False), (
            st
        )  # PauseState.UNPAUSED
    assert c.add_request([1, 2], greedy(3)).wait(30).finish_reason == "length"
    assert not c.failures
