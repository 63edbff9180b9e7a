"""weightsync inside a real vLLM 0.32 ``AsyncLLM`` (CPU build), one engine for the whole module.

A tiny dense Llama (hidden 128, 2 layers, vocabulary 512) and a WordLevel tokenizer are built locally,
served by ``AsyncLLM(enforce_eager=True, weight_transfer_config={"backend": "weightsync"})``, and synced
from a trainer written against vLLM's public trainer API (``WeightTransferTrainerFactory.trainer_init``
with weightsync's init info, ``ModuleSource``) through an in-process client. After each round the
engine's greedy tokens must equal transformers' with the same weights, its prompt logprobs must be
within 1e-4 of transformers' float32 log-softmax, and ``get_weight_version()`` must be the version the
round finished with.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import torch
from transfer_procs import free_port
from vllm_util import require_vllm

require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

from weightsync.spec.errors import WireMismatchError  # noqa: E402
from weightsync.vllm.clients import AsyncLLMWeightSyncClient  # noqa: E402
from weightsync.vllm.models import build_tiny_llama, perturbed_state  # noqa: E402
from weightsync.vllm.trainer import WeightsyncBroadcastTrainer, WeightsyncTrainerInitInfo  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
T = TypeVar("T")
PROBES = [[1, 5, 6, 7, 8], [1, 300, 17, 99], [1, 42]]
N_TOKENS = 8
BUFFER = 96 << 10  # several buckets for a 2.6 MB model


class Served:
    """The module's engine on its own event loop thread, the trainer, and the weights the engine holds."""

    def __init__(self, model_dir: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self.thread.start()
        self.hf = build_tiny_llama(model_dir, seed=0)
        args = AsyncEngineArgs(
            model=model_dir,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=8,
            disable_log_stats=True,
            weight_transfer_config={"backend": "weightsync"},
        )

        async def start() -> Any:
            return AsyncLLM.from_engine_args(args)

        t0 = time.monotonic()
        self.llm = self.run(start())
        self.start_s = time.monotonic() - t0
        self.client = AsyncLLMWeightSyncClient(self.llm, self.loop, timeout_s=120)
        self.trainer: WeightsyncBroadcastTrainer | None = None
        self.n = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 180) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def connect(self, **kw: Any) -> WeightsyncBroadcastTrainer:
        """(Re)connect a trainer: vLLM's public factory, weightsync's init info."""
        if self.trainer is not None:
            self.trainer.shutdown()
        info = WeightsyncTrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=2,
            rank=0,
            packed_buffer_size_bytes=BUFFER,
            timeout_s=60,
            **kw,
        )
        tr = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=ModuleSource(self.hf))
        assert isinstance(tr, WeightsyncBroadcastTrainer)
        self.trainer = tr
        return tr

    async def _generate(self, prompt: list[int], sp: SamplingParams) -> Any:
        self.n += 1
        last = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, sp, request_id=f"probe-{self.n}"):
            last = out
        return last

    def greedy(self, prompt: list[int]) -> list[int]:
        out = self.run(self._generate(prompt, SamplingParams(max_tokens=N_TOKENS, temperature=0.0)))
        return list(out.outputs[0].token_ids)

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = self.run(self._generate(prompt, sp))
        return [float(d[tok].logprob) for d, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]

    def version(self) -> str:
        return str(self.run(self.llm.get_weight_version()))

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(str(tmp_path_factory.mktemp("tiny-llama")))
    print(f"\nAsyncLLM start: {s.start_s:.1f} s")
    try:
        yield s
    finally:
        s.close()


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=N_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids)
        )
    return [int(t) for t in out[0, len(prompt) :]]


def hf_prompt_logprobs(model: Any, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


def assert_serves(served: Served, model: Any) -> float:
    """Greedy tokens equal, prompt logprobs within 1e-4; returns the max logprob difference."""
    worst = 0.0
    for p in PROBES:
        assert served.greedy(p) == hf_greedy(model, p), p
        diffs = [
            abs(a - b) for a, b in zip(served.prompt_logprobs(p), hf_prompt_logprobs(model, p), strict=True)
        ]
        worst = max(worst, *diffs)
    assert worst <= 1e-4, worst
    return worst


def test_weightsync_round_into_real_asyncllm(served: Served) -> None:
    assert served.version() == "default"
    assert_serves(served, served.hf)  # the checkpoint as loaded
    before = [served.greedy(p) for p in PROBES]
    tr = served.connect()
    served.hf.load_state_dict(perturbed_state(served.hf, seed=1, scale=0.5))
    t0 = time.monotonic()
    tr.send_weights(weight_version="step-1")
    round_s = time.monotonic() - t0
    assert served.version() == "step-1"
    worst = assert_serves(served, served.hf)
    assert [served.greedy(p) for p in PROBES] != before  # the new weights are really in use
    print(f"\nround {round_s:.3f} s, max prompt-logprob diff {worst:.2e}")
    assert served.client.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_incomplete_round_is_refused_names_the_missing_and_can_be_completed(served: Served) -> None:
    tr = served.trainer or served.connect()
    new = perturbed_state(served.hf, seed=2, scale=0.5)
    held_back = "model.layers.1.mlp.down_proj.weight"
    served.client.start_weight_update()
    tr.update([(n, t) for n, t in new.items() if n != held_back])
    with pytest.raises(Exception, match=r"IncompleteUpdateError|not received") as exc:
        served.client.finish_weight_update("step-2")
    assert "layers.1.mlp.down_proj.weight" in str(exc.value)
    assert served.version() == "step-1"  # nothing committed
    tr.update([(held_back, new[held_back])])  # the round is still open: send the rest
    served.client.finish_weight_update("step-2")
    served.hf.load_state_dict(new)
    assert served.version() == "step-2"
    assert_serves(served, served.hf)


def test_rejected_request_fails_fast_and_leaves_the_weights_as_they_were(served: Served) -> None:
    tr = served.trainer or served.connect()
    half = {n: t.to(torch.float16) for n, t in perturbed_state(served.hf, seed=3).items()}
    t0 = time.monotonic()
    with pytest.raises(WireMismatchError, match=r"rejected the update before any payload moved.*float16"):
        tr.send_weights(half, weight_version="step-3")
    assert time.monotonic() - t0 < 30  # the engine's veto, not the 60 s timeout
    assert served.version() == "step-2"
    assert_serves(served, served.hf)  # the failed round was abandoned: the previous weights serve
    tr = served.connect()  # the endpoint is unusable after a failed round; a new one works
    served.hf.load_state_dict(perturbed_state(served.hf, seed=4, scale=0.5))
    tr.send_weights(weight_version="step-4")
    assert served.version() == "step-4"
    assert_serves(served, served.hf)
