"""``weightsync prove --missing``: only the rows whose file is missing (or proved against another table) are
checked again; the others are kept as they are, and ``prove --check`` accepts the result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from weightsync.model.proofs import check_fresh, proof_name, prove
from weightsync.spec.table import registry_digest

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


_REGISTRY = """
GUARDS = {{"busy": lambda v, a: _busy(v), "idle": lambda v, a: not _busy(v)}}


def _busy(v):
    {doc}
    return {body}
"""


def _digest(tmp_path: Path, name: str, body: str, doc: str = '"""Whether the rank works."""') -> str:
    (tmp_path / f"{name}.py").write_text(_REGISTRY.format(body=body, doc=doc))
    return registry_digest(name, "GUARDS")


def test_a_guard_body_change_makes_the_digest_and_so_the_proofs_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table names its guards; the digest ``prove --check`` compares also covers their code, through the
    functions they call. Docstrings, comments and layout do not count."""
    monkeypatch.syspath_prepend(str(tmp_path))
    base = _digest(tmp_path, "reg_a", "v.running > 0")
    assert _digest(tmp_path, "reg_b", "v.running > 1") != base  # the helper the guards call
    assert _digest(tmp_path, "reg_c", "(v.running>0)  # reworded", doc='"""Other words."""') == base
    assert _digest(tmp_path, "reg_d", "v.running > 0", doc="") == base  # no docstring at all
    with pytest.raises(ValueError, match=r"reg_a\.NOPE is not a dict literal"):
        registry_digest("reg_a", "NOPE")


def test_the_protocol_digest_covers_every_guard_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each table's digest takes its registries' code digest: the rank tables (each variant), the worker,
    coordinator, front-end and controller tables."""
    import weightsync.spec.controller as controller
    import weightsync.spec.coordinator as coordinator
    import weightsync.spec.front_end as front_end
    import weightsync.spec.rank as rank
    import weightsync.spec.worker as worker

    seen: list[str] = []
    before = rank.spec_digest()
    for module in (rank, worker, coordinator, front_end, controller):
        monkeypatch.setattr(module, "registry_digest", lambda name, *regs: seen.append(name) or "changed")
    assert rank.spec_digest() != before
    assert set(seen) == {
        "weightsync.spec.rank_vars",
        "weightsync.spec.worker",
        "weightsync.spec.coordinator",
        "weightsync.spec.front_end",
        "weightsync.spec.controller",
    }
