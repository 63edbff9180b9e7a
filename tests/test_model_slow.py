"""Exhaustive acceptance runs (slow; not in the default suite)."""

from __future__ import annotations

import pytest

from weightsync.model.check import check
from weightsync.model.system import Bounds

pytestmark = pytest.mark.slow


def _verified(out: dict[str, object]) -> None:
    assert out["verdict"] == "verified", out.get("counterexample")
    props = out["properties"]
    assert isinstance(props, dict) and all(v == "holds" for v in props.values()), props


def test_two_phase_epoch_n3_all_modes() -> None:
    out = check("two-phase-epoch", 3, bounds=Bounds(requests=1))
    _verified(out)
    print(out["states"], out["transitions"], out["seconds"], out["peak_rss_mb"])


def test_two_phase_epoch_n2_two_requests_all_modes() -> None:
    out = check("two-phase-epoch", 2, bounds=Bounds(requests=2))
    _verified(out)
    print(out["states"], out["transitions"], out["seconds"], out["peak_rss_mb"])


def test_two_phase_ordered_n3() -> None:
    _verified(check("two-phase", 3, channels="ordered", bounds=Bounds(requests=1)))


def test_two_phase_epoch_n4_symmetry_keep() -> None:
    out = check("two-phase-epoch", 4, mode="keep", symmetry=True, progress=False)
    assert out["verdict"] == "verified" and out["symmetry"] is True
    print(out["states"], out["seconds"])


def test_two_phase_epoch_n3_stray_and_retried_resume_within_300s() -> None:
    """Issue 11 acceptance 1 at N=3: every property, progress included, under symmetry reduction with the
    pause modes in parallel processes (measured 223 s on the quiet 2-core machine)."""
    out = check("two-phase-epoch", 3, bounds=Bounds(stray_resume=True, repeat_resume=True))
    _verified(out)
    assert out["symmetry"] is True
    assert out["seconds"] < 300, out["seconds"]
    print(out["states"], out["transitions"], out["seconds"], out["peak_rss_mb"])


def test_vllm_032_epoch_n3_all_modes_within_300s() -> None:
    """Issue 10 acceptance 1: the fix on vLLM 0.32 at N=3, every mode, every property."""
    out = check("vllm-0.32-epoch", 3)
    _verified(out)
    assert out["seconds"] < 300, out["seconds"]
