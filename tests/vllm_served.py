"""Shared by the real-vLLM test modules: one ``AsyncLLM`` on its own event loop thread (the tiny local
Llama, or another local model such as the tiny Mixtral; backend ``weightsync``), a trainer from vLLM's
public factory, and the transformers references.

Import only after ``vllm_util.require_vllm()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from transfer_procs import free_port
from vllm import SamplingParams
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

from weightsync.vllm.clients import AsyncLLMWeightSyncClient
from weightsync.vllm.trainer import WeightsyncBroadcastTrainer, WeightsyncTrainerInitInfo
from weightsync.vllm_tools.models import build_tiny_llama
from weightsync.vllm_tools.serving import LoopThread, start_async_llm

T = TypeVar("T")
PROBES = [[1, 5, 6, 7, 8], [1, 300, 17, 99], [1, 42]]
N_TOKENS = 8
BUFFER = 96 << 10  # several buckets for a 2.6 MB model


class Served:
    """The module's engine on its own event loop thread, the trainer, and the weights the engine holds."""

    def __init__(
        self,
        model_dir: str,
        dp: int = 1,
        max_model_len: int = 128,
        builder: Callable[[str], Any] = build_tiny_llama,
    ) -> None:
        self.dp = dp
        self.lt = LoopThread("vllm-loop")
        self.loop = self.lt.loop
        self.hf = builder(model_dir)
        self.llm, self.start_s = start_async_llm(self.lt, model_dir, dp=dp, max_model_len=max_model_len)
        self.client = AsyncLLMWeightSyncClient(self.llm, self.loop, timeout_s=120)
        self.trainer: WeightsyncBroadcastTrainer | None = None
        self.n = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 180) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def connect(self, client: Any = None, **kw: Any) -> WeightsyncBroadcastTrainer:
        """(Re)connect a trainer: vLLM's public factory, weightsync's init info; ``client``: the trainer's
        ``VLLMWeightSyncClient`` (default: the in-process one, unchecked); ``kw``: init info fields."""
        if self.trainer is not None:
            self.trainer.shutdown()
        fields: dict[str, Any] = {"packed_buffer_size_bytes": BUFFER, "timeout_s": 60, **kw}
        info = WeightsyncTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=1 + self.dp, rank=0, **fields
        )
        tr = WeightTransferTrainerFactory.trainer_init(
            info, client=self.client if client is None else client, source=ModuleSource(self.hf)
        )
        assert isinstance(tr, WeightsyncBroadcastTrainer)
        self.trainer = tr
        return tr

    async def generate(self, prompt: list[int], sp: SamplingParams, rank: int | None = None) -> Any:
        """The final output of one request (on DP rank ``rank``, or where vLLM routes it)."""
        self.n += 1
        last = None
        gen = self.llm.generate(
            {"prompt_token_ids": prompt}, sp, request_id=f"probe-{self.n}", data_parallel_rank=rank
        )
        async for out in gen:
            last = out
        return last

    def greedy(self, prompt: list[int], rank: int | None = None) -> list[int]:
        sp = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)
        out = self.run(self.generate(prompt, sp, rank))
        return list(out.outputs[0].token_ids)

    def prompt_logprobs(self, prompt: list[int], rank: int | None = None) -> list[float]:
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = self.run(self.generate(prompt, sp, rank))
        return [float(d[tok].logprob) for d, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]

    def probe_all(self, ranks: list[int]) -> list[tuple[int, list[int], list[int], list[float]]]:
        """Every probe on every DP rank of ``ranks``, all requests at once (one batch per rank: a MoE DP
        engine steps its ranks in lockstep, so sequential probes cost a dummy step per token on the
        other rank): ``(rank, prompt, greedy tokens, prompt logprobs)`` each."""
        greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)
        plp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        jobs = [(r, p) for r in ranks for p in PROBES]

        async def every() -> list[Any]:
            outs = [self.generate(p, sp, r) for r, p in jobs for sp in (greedy, plp)]
            return list(await asyncio.gather(*outs))

        outs = self.run(every())
        res = []
        for i, (r, p) in enumerate(jobs):
            g, lp = outs[2 * i], outs[2 * i + 1]
            lps = [float(d[tok].logprob) for d, tok in zip(lp.prompt_logprobs[1:], p[1:], strict=True)]
            res.append((r, p, list(g.outputs[0].token_ids), lps))
        return res

    def version(self) -> str:
        return str(self.run(self.llm.get_weight_version()))

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
        self.llm.shutdown()
        self.lt.close()


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


#: Prompt-logprob agreement of vLLM's CPU kernels with transformers' float32 eager forward: 1e-4 absolute
#: plus 1e-5 of the logprob's size (float32 accumulation grows with the activations: after two updates of
#: scale-0.5 noise a logprob near -23 differs by 1.9e-4 on one 2-core machine and less on another, with the
#: greedy tokens equal; a weight missing or misplaced moves logprobs by far more, tests/test_vllm_moe.py).
ABS_TOL, REL_TOL = 1e-4, 1e-5


def logprobs_close(got: list[float], want: list[float], where: object) -> float:
    """Assert each of ``got`` within ``ABS_TOL + REL_TOL * |want|`` of ``want``; returns the max difference."""
    bad = [(a, b) for a, b in zip(got, want, strict=True) if abs(a - b) > ABS_TOL + REL_TOL * abs(b)]
    assert not bad, (where, bad)
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)


def assert_serves(served: Served, model: Any, rank: int | None = None) -> float:
    """Greedy tokens equal, prompt logprobs close (:func:`logprobs_close`; on DP rank ``rank``, or where vLLM
    routes the requests); returns the max logprob difference."""
    worst = 0.0
    for p in PROBES:
        assert served.greedy(p, rank) == hf_greedy(model, p), p
        lps = served.prompt_logprobs(p, rank)
        worst = max(worst, logprobs_close(lps, hf_prompt_logprobs(model, p), p))
    return worst


def assert_serves_on(served: Served, model: Any, ranks: list[int]) -> float:
    """:func:`assert_serves` on each DP rank of ``ranks``, all probes at once (:meth:`Served.probe_all`)."""
    worst = 0.0
    for r, p, tokens, lps in served.probe_all(ranks):
        assert tokens == hf_greedy(model, p), (r, p)
        worst = max(worst, logprobs_close(lps, hf_prompt_logprobs(model, p), (r, p)))
    return worst
