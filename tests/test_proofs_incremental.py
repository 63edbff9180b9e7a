"""``weightsync prove --missing``: only the rows whose file is missing (or proved against another table) are
checked again; the others are kept as they are, and ``prove --check`` accepts the result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from weightsync.model.proofs import check_fresh, proof_name, prove

ROOT = Path(__file__).resolve().parents[1]


def test_prove_missing_checks_only_the_missing_row(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "proofs", tmp_path / "proofs")
    shutil.copytree(ROOT / "spec", tmp_path / "spec")
    gone = tmp_path / "proofs" / proof_name("front-end-pause", "ordered", 2)
    want = json.loads(gone.read_text())
    gone.unlink()
    kept = tmp_path / "proofs" / proof_name("two-phase-epoch", "per-socket", 3)  # 85 s to re-check
    before = kept.stat().st_mtime_ns
    said: list[str] = []
    summary = prove(tmp_path, log=said.append, missing_only=True)
    assert len(said) == 1 and said[0].startswith("front-end-pause") and "ordered" in said[0], said
    got = json.loads(gone.read_text())
    assert (got["verdict"], got["states"], got["transitions"]) == (
        want["verdict"],
        want["states"],
        want["transitions"],
    )
    assert kept.stat().st_mtime_ns == before
    assert len(summary["proofs"]) == len(json.loads((ROOT / "proofs" / "summary.json").read_text())["proofs"])
    assert check_fresh(tmp_path, allow_stale_mutation=True) == []
