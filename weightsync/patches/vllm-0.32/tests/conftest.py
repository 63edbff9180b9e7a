# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the tests of the patch series, written as vLLM's own tests
(tests/v1/engine/ in vLLM's tree): a tiny local Mixtral (no download) served by
AsyncLLM(data_parallel_size=2)."""

import asyncio
import os
import threading

import pytest
import torch
from vllm import SamplingParams


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("tiny-mixtral")
    config = MixtralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).to(torch.float32).save_pretrained(str(path))
    return str(path)


class LoopThread:
    """An event loop on its own thread: the engine lives there for the module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def dp_moe_engine(tiny_moe_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    backend = os.environ.get("VLLM_TEST_WEIGHT_TRANSFER_BACKEND", "nccl")
    # the DP group's collective timeout: a test that expects a one-sided
    # collective shortens it so the engines die within the test
    timeouts = {}
    if os.environ.get("VLLM_TEST_DP_TIMEOUT_S"):
        seconds = int(os.environ["VLLM_TEST_DP_TIMEOUT_S"])
        timeouts = {
            "distributed_timeout_seconds": seconds,
            "cpu_distributed_timeout_seconds": seconds,
        }
    args = AsyncEngineArgs(
        model=tiny_moe_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        data_parallel_size=2,
        disable_log_stats=True,
        weight_transfer_config={"backend": backend},
        **timeouts,
    )
    lt = LoopThread()

    async def start():
        return AsyncLLM.from_engine_args(args)

    llm = lt.run(start(), 300)
    try:
        yield llm, lt
    finally:
        llm.shutdown()
        lt.close()


@pytest.fixture
def generate():
    """``await generate(llm, request_id, rank, max_tokens)``: the final output of one greedy request on DP
    rank ``rank`` (the same prompt for every test)."""

    async def run(llm, request_id: str, rank: int, max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        last = None
        async for out in llm.generate(
            {"prompt_token_ids": [1, 5, 6, 7]},
            params,
            request_id=request_id,
            data_parallel_rank=rank,
        ):
            last = out
        return last

    return run
