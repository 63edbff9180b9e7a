"""Bad numeric command-line input exits 2 (usage), never 1 (a found bug), and names the flag and the value."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from weightsync.cli import main
from weightsync.repro.engine import EXPECTED

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--max-states", "-5"], "argument --max-states: must be an integer >= 1, got -5"),
        (["check", "--max-states", "0"], "argument --max-states: must be an integer >= 1, got 0"),
        (["check", "--ranks", "0"], "argument --ranks: must be an integer >= 1, got 0"),
        (["check", "--requests", "-1"], "argument --requests: must be an integer >= 0, got -1"),
        (["check", "--cycles", "-2"], "argument --cycles: must be an integer >= 0, got -2"),
        (["check", "--sync-interval", "0"], "argument --sync-interval: must be an integer >= 1, got 0"),
        (["check", "--ranks", "two"], "argument --ranks: expected an integer >= 1, got 'two'"),
        (
            ["export", "rank-fsm", "--out", "x.mmd", "--ranks", "-1"],
            "argument --ranks: must be an integer >= 1, got -1",
        ),
        (
            ["export", "state-graph", "--out", "x.mmd", "--requests", "-1"],
            "argument --requests: must be an integer >= 0, got -1",
        ),
        (["mutate", "--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
        (["demo", "--ranks", "0"], "argument --ranks: must be an integer >= 1, got 0"),
        (["demo", "--steps", "-1"], "argument --steps: must be an integer >= 0, got -1"),
        (
            ["demo", "--timeout", "-3"],
            "argument --timeout: must be a positive finite number of seconds, got -3",
        ),
        (
            ["demo", "--timeout", "0"],
            "argument --timeout: must be a positive finite number of seconds, got 0",
        ),
        (
            ["demo", "--timeout", "inf"],
            "argument --timeout: must be a positive finite number of seconds, got inf",
        ),
        (
            ["demo", "--seed", "-1"],
            "argument --seed: must be an integer in [0, 9223372036854775807], got -1",
        ),
        (
            ["repro", "two-phase", "--timeout", "nan"],
            "argument --timeout: must be a positive finite number of seconds, got nan",
        ),
        (["record", "--cycles", "0"], "argument --cycles: must be an integer >= 1, got 0"),
        (
            ["record", "--seed", "-4"],
            "argument --seed: must be an integer in [0, 9223372036854775807], got -4",
        ),
    ],
)
def test_bad_numbers_exit_2_naming_flag_and_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    prog = f"weightsync {argv[0]}"
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert f"usage: {prog}" in cap.err and cap.err.endswith(f"{prog}: error: {message}\n")
    # with --json: one JSON object on stdout carrying the same message
    assert main([*argv, "--json"]) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out) == {"error": f"{prog}: error: {message}"}


def test_check_negative_max_states_is_a_usage_error_not_a_bug_found() -> None:
    """The reported case, as a user runs it: a separate process, its real exit status."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "check", "--max-states", "-5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 2, proc
    assert "weightsync check: error: argument --max-states: must be an integer >= 1, got -5" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["repro", "two-phase", "--engine", "vllm"],
            "--engine vllm drives vLLM 0.32 as shipped: variant must be vllm-0.32, got 'two-phase'",
        ),
        (
            ["repro", "two-phase-epoch", "--fix", "epoch"],
            "--fix applies to --engine vllm (the reference engine runs the fixed variants by name)",
        ),
        (
            ["repro", "two-phase", "--schedule", "ignore-wave"],
            "--schedule 'ignore-wave': two-phase runs the counterexample of two-phase",
        ),
        (
            ["repro", "two-phase-epoch", "--schedule", "two-phase-epoch"],
            "--schedule 'two-phase-epoch': two-phase-epoch runs the counterexample of front-end-pause, "
            "idle-fast-path, ignore-wave, two-phase",
        ),
        (["repro", "vllm-0.32"], "unknown variant 'vllm-0.32'; known: " + ", ".join(EXPECTED)),
    ],
)
def test_repro_engine_and_fix_misuse_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*argv, "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {"error": message}


def test_the_vllm_demos_last_line_names_both_replayed_traces(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``weightsync demo --engine vllm`` (as ``make demo`` prints it): with lockstep DP engines two traces
    are replayed, the CheckedEngine's and the engines' own, and ``trace_ok`` covers both, so the last line
    names both with their steps (it used to name the first alone). The demo run itself is replaced here by
    its result; ``tests/test_vllm_demo.py`` runs it on real vLLM."""
    import types

    from weightsync.cli import demo as cli_demo

    result = {
        "ok": True,
        "model": "tiny Mixtral (MoE)",
        "steps": 20,
        "reward_first": 0.004,
        "reward_last": 0.139,
        "greedy_equal": True,
        "max_logprob_diff": 1.4e-6,
        "lost_requests": 0,
        "versions_ok": True,
        "trace": "traces/d.jsonl",
        "trace_steps": 405,
        "engine_trace": "traces/d-engines.jsonl",
        "engine_trace_steps": 6931,
        "trace_ok": True,
        "seconds": 106.0,
    }
    fake = types.SimpleNamespace(VllmDemoConfig=lambda **kw: kw, run_vllm_demo=lambda cfg, log: result)
    monkeypatch.setattr(cli_demo, "vllm_module", lambda args, module, what: fake)
    assert main(["demo", "--engine", "vllm", "--moe"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        "traces/d.jsonl (405 steps) and the engines' traces/d-engines.jsonl (6931 steps) replay: True" in line
    )
    result["engine_trace"] = None  # a dense model: the CheckedEngine's trace alone
    assert main(["demo", "--engine", "vllm"]) == 0
    assert "trace traces/d.jsonl (405 steps) replay: True" in capsys.readouterr().out
