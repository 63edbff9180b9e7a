"""Issue 19, acceptance 1: re-exploring every ``proofs/`` row with the compact engine (the default) gives the
states, transitions and depth the row records, mode by mode, under the row's own settings (its symmetry
flag; no other reduction). Rows of up to :data:`FAST_STATES` states run in the default suite (a few seconds
each), the others are marked slow (``weightsync prove --check`` compares digests only, not counts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from weightsync.model.check import build_model, explore_model
from weightsync.model.system import Bounds

PROOFS = Path(__file__).resolve().parent.parent / "proofs"
#: rows with at most this many states (over all modes) run in the default suite
FAST_STATES = 150_000


def _rows() -> list[Any]:
    out = []
    for path in sorted(PROOFS.glob("*.json")):
        row = json.loads(path.read_text())
        if "per_mode" not in row:  # mutation.json, summary.json
            continue
        marks = [] if row["states"] <= FAST_STATES else [pytest.mark.slow]
        out.append(pytest.param(row, id=path.stem, marks=marks))
    return out


@pytest.mark.parametrize("row", _rows())
def test_compact_engine_reproduces_the_row(row: dict[str, Any]) -> None:
    for mode, want in row["per_mode"].items():
        m = build_model(row["variant"], row["ranks"], mode, row["channels"], Bounds(**row["bounds"]))
        ex = explore_model(m, symmetry=row["symmetry"], max_states=20_000_000)
        got = {"states": len(ex.states), "transitions": ex.transitions, "depth": ex.depth}
        assert got == {k: want[k] for k in got}, (mode, got, want)
