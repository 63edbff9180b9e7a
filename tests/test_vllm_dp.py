"""weightsync into a real vLLM ``AsyncLLM`` with two data-parallel engines, requests in flight.

The tiny dense Llama on ``AsyncLLM(data_parallel_size=2)`` (two independent engines for a dense model:
``v1/engine/core.py:1473-1478``), one transfer group of 1 trainer + 2 workers (worker rank
``1 + dp_index``). The cycle is the RL controller's: ``pause_generation(mode="keep")`` with requests
mid-generation, a weightsync round finished with ``weight_version="step-1"``, ``resume_generation()``.
Then every kept request finishes its full length (none lost, none aborted, none advanced while paused),
both engines report ``step-1``, and on each engine greedy tokens equal transformers' and prompt
logprobs are within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm_served import Served, assert_serves  # noqa: E402

from weightsync.cli import main  # noqa: E402
from weightsync.impl.checked import CheckedEngine  # noqa: E402
from weightsync.vllm_tools.checked import AsyncLLMAdapter  # noqa: E402
from weightsync.vllm_tools.models import perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
MAX_TOKENS = 200
PER_RANK = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(str(tmp_path_factory.mktemp("tiny-llama-dp")), dp=2, max_model_len=256)
    print(f"\nAsyncLLM DP=2 start: {s.start_s:.1f} s")
    try:
        yield s
    finally:
        s.close()


def test_dp2_round_with_requests_in_flight(served: Served) -> None:
    s = served
    assert_serves(s, s.hf)
    tr = s.connect()
    progress: dict[str, int] = {}

    async def request(i: int, rank: int) -> Any:
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        last = None
        async for out in s.llm.generate(
            {"prompt_token_ids": [1, 10 + i, 20 + i]}, sp, request_id=f"inflight-{i}", data_parallel_rank=rank
        ):
            progress[f"inflight-{i}"] = len(out.outputs[0].token_ids)
            last = out
        return last

    futs = [asyncio.run_coroutine_threadsafe(request(i, i % 2), s.loop) for i in range(2 * PER_RANK)]
    deadline = time.monotonic() + 60
    while (len(progress) < len(futs) or min(progress.values()) < 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    s.run(s.llm.pause_generation(mode="keep"))
    at_pause = dict(progress)
    mid = [r for r, n in at_pause.items() if 0 < n < MAX_TOKENS]
    s.hf.load_state_dict(perturbed_state(s.hf, seed=11, scale=0.5))
    t0 = time.monotonic()
    tr.send_weights(weight_version="step-1")
    round_s = time.monotonic() - t0
    time.sleep(0.2)
    assert progress == at_pause  # nothing advanced while paused
    assert s.version() == "step-1"
    s.run(s.llm.resume_generation())
    outs = [f.result(180) for f in futs]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)  # 0 lost, full length
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    worst = assert_serves(s, s.hf)  # on each engine
    print(
        f"\nDP=2 round {round_s:.3f} s with {len(mid)} of {len(futs)} requests kept mid-generation "
        f"(tokens at pause {sorted(at_pause.values())}); max prompt-logprob diff {worst:.2e}"
    )
    assert mid, f"no request was mid-generation at the pause: {at_pause}"


def test_dp2_checked_round_counts_each_engine_and_replays(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same cycle through ``CheckedEngine(AsyncLLMAdapter)``: two table ranks, each a DP world of one
    (a dense model), each with the front-end's count of its own requests (the DP client's routing table),
    and a trace ``weightsync replay`` accepts."""
    s = served
    trace = tmp_path / "dp2.jsonl"
    eng = CheckedEngine(AsyncLLMAdapter(s.llm, s.loop, timeout_s=120), trace_path=trace)
    assert eng.dp_size == 2
    tr = s.connect(client=eng)
    futs = _generating(s, "checked", [0, 1, 1], 150, 40)
    _keep_round(s, eng, tr, futs, 12, "step-2", 150)
    pauses = [r for r in eng.engine.transitions if r.event == "pause"]
    assert [(r.rank, r.args["running"]) for r in pauses] == [(0, 1), (1, 2)]
    assert main(["replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    # each dense engine is a DP world of one: its own pause sync and resume barrier, 2 outcomes each
    assert out["ranks"] == 2 and out["outcomes_checked"] == 4 and out["notes"] == [], out
    assert_serves(s, s.hf)


def test_dp2_dense_engines_take_a_reinit_while_serving_under_the_checker(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense model's DP engines are independent (``v1/engine/core.py:1473-1482``): the checked adapter
    makes each a DP world of one, so a trainer that reconnects (``init_weight_transfer_engine``) while both
    engines serve, after they served a round, is taken, as vLLM takes it; the next round moves the weights
    and the trace replays. (In one lockstep world the init gate would refuse that init: a MoE engine.)"""
    s = served
    trace = tmp_path / "dense-reinit.jsonl"
    eng = CheckedEngine(AsyncLLMAdapter(s.llm, s.loop, timeout_s=120), trace_path=trace)
    assert not eng.lockstep and [(m.rank, m.dp_size) for m in eng.machines] == [(0, 1), (0, 1)]
    tr = s.connect(client=eng)
    eng.pause(mode="abort")
    s.hf.load_state_dict(perturbed_state(s.hf, seed=21, scale=0.5))
    tr.send_weights(weight_version="dense-1")
    eng.resume()
    assert all(m.vars.current_wave > 0 for m in eng.machines)  # the engines have served a resume barrier

    futs = _generating(s, "reinit", [0, 1], 120, 60)
    t0 = time.monotonic()
    tr = s.connect(client=eng)  # the re-init, both engines serving
    reinit_s = time.monotonic() - t0
    _keep_round(s, eng, tr, futs, 22, "dense-2", 120)
    inits = [r.rank for r in eng.engine.transitions if r.event == "init_weight_transfer_engine"]
    assert inits == [0, 1, 0, 1], inits
    assert main(["replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    assert out["ranks"] == 2 and out["notes"] == [], out
    print(f"\nre-init while both dense engines serve: {reinit_s:.2f} s")
    assert_serves(s, s.hf)


def _generating(s: Served, prefix: str, ranks: list[int], max_tokens: int, base: int) -> list[Future[Any]]:
    """Greedy requests ``<prefix>-<i>`` on DP ranks ``ranks`` (prompt ``[1, base + i]``), each already
    generating (its first output seen, at most 60 s) when this returns; their final outputs."""
    started: set[str] = set()

    async def request(i: int, rank: int) -> Any:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        last = None
        async for out in s.llm.generate(
            {"prompt_token_ids": [1, base + i]}, sp, request_id=f"{prefix}-{i}", data_parallel_rank=rank
        ):
            started.add(f"{prefix}-{i}")
            last = out
        return last

    futs = [asyncio.run_coroutine_threadsafe(request(i, r), s.loop) for i, r in enumerate(ranks)]
    deadline = time.monotonic() + 60
    while len(started) < len(futs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(started) == len(futs), f"only {sorted(started)} started generating within 60 s"
    return futs


def _keep_round(
    s: Served, eng: CheckedEngine, tr: Any, futs: list[Future[Any]], seed: int, version: str, tokens: int
) -> None:
    """A keep-mode round through the checked client while ``futs`` generate: perturbed weights (``seed``)
    sent as ``version``; then every request finishes its ``tokens`` and the engines report ``version``."""
    eng.pause(mode="keep")
    s.hf.load_state_dict(perturbed_state(s.hf, seed=seed, scale=0.5))
    tr.send_weights(weight_version=version)
    eng.resume()
    outs = [f.result(180) for f in futs]
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    assert eng.get_weight_version() == version and eng.violations == []
