"""``weightsync bench transfer --quick``: the JSON fields exist and memory does not grow across syncs."""

from __future__ import annotations

import pytest

from weightsync.bench.transfer import run_transfer_bench
from weightsync.bench.workload import synthetic_spec


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


@pytest.mark.parametrize(("quick", "code"), [(False, 1), (True, 0)])
def test_cli_exit_code_judges_targets_only_at_full_size(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], quick: bool, code: int
) -> None:
    """A missed target makes ``weightsync bench transfer`` exit 1; ``--quick`` reports without judging."""
    import json

    import weightsync.bench.transfer as bench
    from weightsync.cli import main

    def fake(quick: bool = False) -> dict[str, object]:
        return {"targets_met": False, "targets": {"packed_vs_raw>=0.9": False}, "quick": quick}

    monkeypatch.setattr(bench, "run_transfer_bench", fake)
    argv = ["bench", "transfer", "--json"] + (["--quick"] if quick else [])
    assert main(argv) == code
    out = json.loads(capsys.readouterr().out)
    assert out["targets_judged"] is not quick and out["ok"] is quick
