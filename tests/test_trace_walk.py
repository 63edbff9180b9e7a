"""``weightsync replay --self-test``: real reference engines, healthy and broken, traced and walked through the
model's successor function (weightsync.model.trace_walk), and the walker rejecting hand-edited traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from weightsync.model.trace_walk import TraceFormatError, read_trace, walk_trace
from weightsync.repro.selftest import CASES

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def self_test(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    """One run of the CLI's self-test (every case), as CI runs it."""
    d = tmp_path_factory.mktemp("selftest")
    p = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "replay", "--self-test", "--json", "--workdir", str(d)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert p.stdout, p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout), d


@pytest.mark.slow
@pytest.mark.ci
def test_self_test_rejects_every_broken_engine_at_its_fault(
    self_test: tuple[int, dict[str, Any], Path],
) -> None:
    rc, out, _ = self_test
    by_name = {e["name"]: e for e in out["results"]}
    assert set(by_name) == {c.name for c in CASES}
    assert len([c for c in CASES if c.expect_rejected]) >= 6
    for case in CASES:
        e = by_name[case.name]
        if case.expect_rejected:
            assert e["rejected"], e
            assert e["fault"] is not None, f"{case.name}: the fault never acted ({e['recorded']})"
            assert e["at_fault"], (
                f"{case.name}: rejected at line {e['first_bad_line']}, fault at {e['fault_line']}: {e}"
            )
            assert e["first_bad_line"] is not None and e["reason"]
            if case.name == "corrupted-weight-bytes":  # the payload's checksum caught it, not the header
                assert "ChecksumMismatchError" in e["reason"], e["reason"]
        else:
            assert not e["rejected"], e
            assert e["recorded"]["cycles"] == 20 and e["recorded"]["error"] is None
            assert e["recorded"]["requests"] > 0 and e["recorded"]["finished"] == e["recorded"]["requests"]
            assert e["steps"] > 20 * 10
    assert out["ok"] and rc == 0, out


def _healthy(d: Path) -> list[str]:
    return (d / "healthy-20-cycles.jsonl").read_text().splitlines(keepends=True)


def _edit(lines: list[str], pick: Any, change: Any) -> tuple[list[str], dict[str, Any], int]:
    """Apply ``change`` to the first record ``pick`` selects (None deletes it); returns the lines, the
    record and its 1-based line."""
    out = list(lines)
    for n, text in enumerate(lines[1:], 2):
        rec = json.loads(text)
        if pick(rec):
            new = change(rec)
            out[n - 1] = "" if new is None else json.dumps(new) + "\n"
            return out, rec, n
    raise AssertionError("no record to edit")


@pytest.mark.slow
@pytest.mark.ci
def test_the_healthy_trace_is_accepted_and_every_edit_of_it_rejected_at_its_line(
    self_test: tuple[int, dict[str, Any], Path],
) -> None:
    lines = _healthy(self_test[2])
    assert walk_trace(lines).accepted
    edits = {
        "ADD stamped with another wave": (
            lambda r: r["kind"] == "recv" and r["msg"]["type"] == "AddMsg",
            lambda r: {**r, "msg": {**r["msg"], "wave": r["msg"]["wave"] + 1}},
        ),
        "a wave_complete not sent": (
            lambda r: r["kind"] == "send" and r["msg"]["type"] == "WaveComplete",
            lambda r: None,
        ),
        "a request finished one step early": (
            lambda r: r["kind"] == "settle" and r["running"] > 0 and not r["finished"],
            lambda r: {**r, "running": r["running"] - 1},
        ),
        "a coordinator START_DP_WAVE to a different wave": (
            lambda r: r["kind"] == "coord" and r["broadcasts"],
            lambda r: {**r, "broadcasts": [[w + 1, x] for w, x in r["broadcasts"]]},
        ),
        "a STEP with has_work flipped": (
            lambda r: r["kind"] == "transition" and r["event"] == "step" and "has_work" in r["args"],
            lambda r: {**r, "args": {**r["args"], "has_work": not r["args"]["has_work"]}},
        ),
        "a DP sync completed with another sum": (
            lambda r: r["kind"] == "transition" and r["event"] == "dp_sync_done",
            lambda r: {**r, "args": {**r["args"], "sum_unfinished": r["args"]["sum_unfinished"] + 1}},
        ),
        "a pause reporting no running requests while some run": (
            lambda r: r["kind"] == "transition" and r["event"] == "pause" and r["args"].get("running", 0) > 0,
            lambda r: {**r, "args": {**r["args"], "running": 0}},
        ),
    }
    for name, (pick, change) in edits.items():
        edited, rec, line = _edit(lines, pick, change)
        r = walk_trace(edited)
        assert not r.accepted, name
        # rejected at the edited record's step: a rank's step by its group, another process's by its line
        if "group" in rec:
            assert [rec["proc"], rec["group"]] in r.bad_groups, (name, r.bad_groups, rec, r.reason)
        else:
            assert r.first_bad_line == line, (name, r.first_bad_line, line, r.reason)
        assert r.legal and r.model_state, name


def test_a_trace_that_is_no_system_trace_is_refused() -> None:
    with pytest.raises(TraceFormatError, match="header"):
        read_trace(['{"kind": "transition", "rank": 0}\n'])
    with pytest.raises(TraceFormatError, match="not JSON"):
        read_trace([json.dumps({"kind": "header", "schema": "weightsync-system-trace/1"}) + "\n", "{oops\n"])
