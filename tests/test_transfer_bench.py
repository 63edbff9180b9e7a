"""``weightsync bench transfer --quick``: the JSON fields exist and memory does not grow across syncs."""

from __future__ import annotations

import pytest

from weightsync.impl.transfer.bench import run_transfer_bench, synthetic_spec


def test_synthetic_model_size() -> None:
    full = synthetic_spec(quick=False)
    nbytes = sum(2 * __import__("math").prod(s) for _, s in full)
    assert 250 <= len(full) <= 350 and 480 << 20 <= nbytes <= 544 << 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_transfer_quick_fields_and_rss() -> None:
    out = run_transfer_bench(quick=True)
    for key in (
        "packed_gbps",
        "raw_gbps",
        "per_tensor_gbps",
        "ipc_gbps",
        "memcpy_gbps",
        "rss_growth_bytes",
        "bucket_bytes",
    ):
        assert key in out
    assert out["rss_growth_bytes"] < out["bucket_bytes"]
    assert out["trainer_pool_bytes"] <= out["num_buffers"] * out["bucket_bytes"]
