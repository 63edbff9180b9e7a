"""CheckedEngine around a real vLLM 0.32 ``AsyncLLM`` (issue 9 item 6, acceptance 4), one engine per module.

The tiny dense Llama with backend ``weightsync``; the controller drives
``CheckedEngine(AsyncLLMAdapter(llm, loop), trace_path=...)`` and the trainer (vLLM's public factory)
talks to it through the same CheckedEngine (a ``VLLMWeightSyncClient`` itself). "vLLM never saw the call" is measured, not assumed:
:class:`UtilityCounter` counts every utility call where it leaves the front-end for the engine cores
(``AsyncMPClient._call_utility_async``, the path of ``pause_generation``, ``resume_generation`` and every
``collective_rpc`` weight call); a direct, unchecked call is counted there (the control).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest  # noqa: E402
from vllm_served import Served, assert_serves  # noqa: E402

from weightsync.cli import main  # noqa: E402
from weightsync.impl.checked import CheckedEngine  # noqa: E402
from weightsync.spec.errors import LocalProtocolError  # noqa: E402
from weightsync.vllm.trainer import WeightsyncBroadcastTrainer, update_info_of  # noqa: E402
from weightsync.vllm_tools.checked import AsyncLLMAdapter  # noqa: E402
from weightsync.vllm_tools.models import perturbed_state  # noqa: E402

# slow, run once in CI (make test-slow-ci): an engine start of its own; the checked DP=2 round of
# tests/test_vllm_dp.py keeps CheckedEngine on a real vLLM in the default suite
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ci, pytest.mark.timeout(240)]
#: the utility calls of the controller surface, as they leave the front-end
CONTROLLER = (
    "pause_scheduler",
    "resume_scheduler",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)
MAX_TOKENS = 100  # prompt 2 + 100 < max_model_len 128; long enough to be mid-generation at the pause


class UtilityCounter:
    """Counts the utility calls ``llm.engine_core`` sends to the engine cores (``collective_rpc`` by the
    method it carries), per name."""

    def __init__(self, core: Any) -> None:
        self.counts: Counter[str] = Counter()
        inner = core._call_utility_async

        async def counted(method: str, *args: Any, engine: Any) -> Any:
            name = args[0] if method == "collective_rpc" and args and isinstance(args[0], str) else method
            self.counts[name] += 1
            return await inner(method, *args, engine=engine)

        core._call_utility_async = counted

    def controller(self) -> dict[str, int]:
        return {k: self.counts[k] for k in CONTROLLER}


@dataclass
class Rig:
    served: Served
    counter: UtilityCounter
    adapter: AsyncLLMAdapter
    eng: CheckedEngine
    client: CheckedEngine
    trainer: WeightsyncBroadcastTrainer
    trace: Path


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    s = Served(str(tmp_path_factory.mktemp("tiny-llama-checked")))
    print(f"\nAsyncLLM start: {s.start_s:.1f} s")
    try:
        counter = UtilityCounter(s.llm.engine_core)
        trace = tmp_path_factory.mktemp("trace") / "asyncllm.jsonl"
        adapter = AsyncLLMAdapter(s.llm, s.loop, timeout_s=120)
        eng = CheckedEngine(adapter, trace_path=trace)
        client = eng
        tr = s.connect(client=client)  # init_weight_transfer_engine, checked (legal while running)
        yield Rig(s, counter, adapter, eng, client, tr, trace)
    finally:
        s.close()


def in_flight(rig: Rig, n: int) -> list[Any]:
    """``n`` greedy requests of MAX_TOKENS tokens, returned once each produced a token."""
    s = rig.served
    progress: dict[int, int] = {}

    async def request(i: int) -> Any:
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        last = None
        async for out in s.llm.generate(
            {"prompt_token_ids": [1, 30 + i]}, sp, request_id=f"kept-{time.time()}-{i}"
        ):
            progress[i] = len(out.outputs[0].token_ids)
            last = out
        return last

    futs = [asyncio.run_coroutine_threadsafe(request(i), s.loop) for i in range(n)]
    deadline = time.monotonic() + 60
    while (len(progress) < n or min(progress.values()) < 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(progress) == n
    return futs


def test_update_weights_while_serving_is_refused_and_never_reaches_vllm(rig: Rig) -> None:
    info = update_info_of([(n, p.dtype, tuple(p.shape)) for n, p in rig.served.hf.named_parameters()][:2])
    before, records = rig.counter.controller(), len(rig.adapter.transitions)
    with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
        rig.eng.update_weights(info)
    with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
        rig.trainer.client.update_weights(info)  # the trainer's path
    assert rig.counter.controller() == before  # nothing left the front-end
    assert len(rig.adapter.transitions) == records  # nothing recorded
    # control: the same call, unchecked, does reach vLLM (counted), and vLLM does not refuse it for serving
    with pytest.raises(Exception, match="start_weight_update must be called before update_weights"):
        rig.served.run(rig.served.llm.update_weights(WeightTransferUpdateRequest(update_info=info)))
    assert rig.counter.controller()["update_weights"] == before["update_weights"] + 1
    assert rig.served.version() == "default"


def test_legal_round_with_a_kept_request_passes_through(rig: Rig) -> None:
    s, eng = rig.served, rig.eng
    futs = in_flight(rig, 1)
    before = rig.counter.controller()
    eng.pause(mode="keep")
    s.hf.load_state_dict(perturbed_state(s.hf, seed=21, scale=0.5))
    t0 = time.monotonic()
    rig.trainer.send_weights(weight_version="step-1")  # start -> update (real weights) -> finish, checked
    round_s = time.monotonic() - t0
    eng.resume()
    out = futs[0].result(120)
    assert len(out.outputs[0].token_ids) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
    assert eng.get_weight_version() == "step-1" == s.version()
    worst = assert_serves(s, s.hf)
    sent = {k: rig.counter.controller()[k] - before[k] for k in CONTROLLER}
    assert sent["pause_scheduler"] == sent["resume_scheduler"] == 1
    assert sent["start_weight_update"] == sent["finish_weight_update"] == 1 and sent["update_weights"] >= 1
    assert eng.violations == []
    recs = rig.adapter.transitions
    pause = next(r for r in reversed(recs) if r.event == "pause")
    barrier = recs[-1]
    assert pause.args["running"] == 1 and (pause.waiting, pause.running) == (0, 1)  # observed front-end count
    assert barrier.event == "resume_barrier_done" and barrier.args["max_unfinished"] == 1
    print(f"\nchecked round {round_s:.3f} s, max prompt-logprob diff {worst:.2e}")


def test_second_start_is_refused_and_never_reaches_vllm(rig: Rig) -> None:
    s, eng = rig.served, rig.eng
    eng.pause(mode="keep")
    eng.start_weight_update()
    before, records = rig.counter.controller(), len(rig.adapter.transitions)
    with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state updating"):
        eng.start_weight_update()
    with pytest.raises(LocalProtocolError, match="resume is illegal in state updating"):
        eng.resume()  # vLLM would resume serving on half-loaded weights (vLLM 0.32 resumes unconditionally, v1/engine/core.py:951-953)
    assert rig.counter.controller() == before and len(rig.adapter.transitions) == records
    new = perturbed_state(s.hf, seed=22, scale=0.5)
    rig.trainer.update(new)  # the rest of the round through the checked client
    eng.finish_weight_update(weight_version="step-2")
    eng.resume()
    s.hf.load_state_dict(new)
    assert s.version() == "step-2"
    assert_serves(s, s.hf)
    assert rig.counter.controller()["start_weight_update"] == before["start_weight_update"]


def test_the_trace_replays_and_a_corrupted_line_is_rejected(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    path = rig.trace
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "header" and len(lines) == 1 + len(rig.adapter.transitions)
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    assert out["notes"] == []  # every record has the front-end's counts: outcomes checked in full
    assert out["ok"] and out["steps"] == len(lines) - 1 and out["outcomes_checked"] == 4, (
        out
    )  # 2 pauses, 2 resumes
    events = [json.loads(x)["event"] for x in lines[1:]]
    assert events.count("start_weight_update") == 2 and events.count("finish_done") == 2
    # corrupt one line: the first pause's DP sync claims no rank was pausing
    idx = next(i for i, x in enumerate(lines) if '"dp_sync_done"' in x)
    rec = json.loads(lines[idx])
    rec["args"]["sum_pending_pause"] = 0
    bad = path.with_suffix(".corrupt.jsonl")
    bad.write_text("\n".join([*lines[:idx], json.dumps(rec), *lines[idx + 1 :]]) + "\n")
    assert main(["replay", str(bad), "--json"]) == 1
    div = json.loads(capsys.readouterr().out)["traces"][0]["divergence"]
    assert div["line"] == idx + 1 and div["event"] == "dp_sync_done", div
    # and an update_weights spliced in while serving (what CheckedEngine refused) is not an edge
    first = json.loads(lines[1])
    spliced = {**first, "event": "update_weights", "args": {}}
    bad.write_text("\n".join([lines[0], json.dumps(spliced), *lines[1:]]) + "\n")
    assert main(["replay", str(bad), "--json"]) == 1
    div = json.loads(capsys.readouterr().out)["traces"][0]["divergence"]
    assert div["line"] == 2 and "illegal" in div["reason"], div


def test_update_weight_version_relabels_vllm_and_the_trace_replays(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.32's ``update_weight_version`` (``v1/engine/async_llm.py:1357``): the label moves in vLLM and on
    every rank of the table, with no transition; the trace gets one relabel line per rank and replays."""
    s, eng = rig.served, rig.eng
    records = len(rig.adapter.transitions)
    eng.update_weight_version("relabelled")  # while serving: vLLM has no gate, nor does the table need one
    assert s.version() == "relabelled" == eng.get_weight_version()
    assert rig.adapter.get_weight_versions() == ["relabelled"] * rig.adapter.dp_size
    assert len(rig.adapter.transitions) == records and eng.violations == []  # no transition
    lines = [json.loads(x) for x in rig.trace.read_text().splitlines()]
    assert [x["weight_version"] for x in lines if x.get("kind") == "relabel"] == ["relabelled"] * eng.dp_size
    assert main(["replay", str(rig.trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["traces"][0]["ok"]
