"""``weightsync bench pause`` (acceptance 5) and ``weightsync replay`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync.cli import main


@pytest.mark.slow
@pytest.mark.ci  # a benchmark's quick run: once in CI (make test-slow-ci)
@pytest.mark.timeout(120)
def test_bench_pause_json(capsys: pytest.CaptureFixture[str]) -> None:
    # The K + 2 target is a benchmark figure (scheduling noise on a loaded machine can exceed it), not a
    # unit-test assertion: check the report's shape and that its verdict and exit code agree with it.
    rc = main(["bench", "pause", "--json", "--quick"])
    out = json.loads(capsys.readouterr().out)
    assert [r["sync_interval"] for r in out["runs"]] == [32, 4]
    for r in out["runs"]:
        assert {"pause_steps", "pause_seconds", "resume_seconds", "step_seconds"} <= set(r)
        assert r["pause_steps"] >= 1 and r["pause_seconds"] > 0 and r["step_seconds"] > 0
    within = all(r["pause_steps"] <= r["sync_interval"] + 2 for r in out["runs"])
    assert rc == (0 if within else 1)


@pytest.mark.timeout(30)
def test_cli_replay_accepts_and_rejects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from weightsync.spec import RankEvent, RankMachine

    # a tiny hand-written 1-rank trace: pause (two-phase, idle) is accepted...
    hdr = {"kind": "header", "variant": "two-phase-epoch", "dp_size": 1, "sync_interval": 2, "init": None}
    m = RankMachine(0, 1, "two-phase-epoch", 2)
    m.fire(RankEvent.PAUSE, mode="abort", clear_cache=True, running=0, waiting=0)
    good = tmp_path / "good.jsonl"
    rec = {
        "kind": "transition",
        "rank": 0,
        "event": "pause",
        "args": {"mode": "abort", "clear_cache": True, "running": 0, "waiting": 0},
    }
    good.write_text(json.dumps(hdr) + "\n" + json.dumps(rec) + "\n")
    assert main(["replay", str(good), "--json"]) == 0
    capsys.readouterr()
    # ...and start_weight_update before the pause verified is rejected with the step named
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        good.read_text()
        + json.dumps({"kind": "transition", "rank": 0, "event": "start_weight_update", "args": {}})
        + "\n"
    )
    assert main(["replay", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    div = out["traces"][0]["divergence"]
    assert div["line"] == 3 and div["event"] == "start_weight_update" and div["state"]["state"] == "paused"
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--json"]) == 2
