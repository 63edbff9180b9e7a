"""``weightsync/patches/vllm-0.32-resume-epoch.patch`` against the installed vLLM 0.32: it applies, and vLLM's own
``DPEngineCoreProc`` code with it behaves as variant ``vllm-0.32-epoch`` says, on a real gloo DP group,
where the unpatched code deadlocks or keeps the waves apart as variant ``vllm-0.32`` says.

No engine is started: the roles (``tests/vllm_patch_roles.py``) call vLLM's pause/resume methods on its
class with the attributes those methods read set by hand, so each case costs an import, not an engine.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

vllm = require_vllm()

from transfer_procs import free_port, ok, run_roles  # noqa: E402
from vllm_patch_roles import epoch_resume_role, load_core, make_engine, stray_resume_role  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "weightsync" / "patches" / "vllm-0.32-resume-epoch.patch"
INSTALLED = Path(vllm.__file__).parent / "v1" / "engine" / "core.py"


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the installed ``vllm/v1/engine/core.py`` with the patch applied by ``patch(1)``."""
    if vllm.__version__ != "0.32.0":
        pytest.skip(f"the patch is for vLLM 0.32.0, installed: {vllm.__version__}")
    if shutil.which("patch") is None:
        pytest.skip("patch(1) is not installed (apt-get install patch)")
    root = tmp_path_factory.mktemp("vllm-src")
    dst = root / "vllm" / "v1" / "engine" / "core.py"
    dst.parent.mkdir(parents=True)
    shutil.copy(INSTALLED, dst)
    for args in (["--dry-run"], []):
        r = subprocess.run(
            ["patch", "-p1", "--forward", *args, "-i", str(PATCH)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stdout + r.stderr
    return str(dst)


def test_the_patch_applies_to_the_installed_source_tree() -> None:
    if shutil.which("patch") is None:
        pytest.skip("patch(1) is not installed (apt-get install patch)")
    site = INSTALLED.parents[3]
    r = subprocess.run(
        ["patch", "-p1", "--dry-run", "--forward", "-i", str(PATCH)],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "core.py" in r.stdout


def _pair(role: Any, *args: Any, deadline_s: float = 60.0) -> list[tuple[Any, ...]]:
    port = free_port()
    return run_roles([(role, (0, port, *args)), (role, (1, port, *args))], deadline_s=deadline_s)


def test_stray_resume_deadlocks_vllm_032_and_not_the_patch(patched: str) -> None:
    """vLLM 0.32: the idle rank takes the stray resume into the barrier (a MAX all-reduce) while its
    peer, serving, takes its DP step (a SUM all-reduce): mismatched collectives, caught by the 6 s group
    timeout (or by gloo's size check). Patched: the resume is a no-op on both, the idle rank joins the
    wave and the DP step completes with the request counted."""
    before = [ok(r) for r in _pair(stray_resume_role, str(INSTALLED))]
    # rank 0 took the resume as a no-op (engines_running) and stepped; its DP step never matched
    assert before[0]["resume"] == "returned" and "error" in before[0], before
    # rank 1 entered the resume barrier and never came back from it: the group timeout caught it
    assert "resume" not in before[1] and "Timed out" in before[1]["error"], before
    after = [ok(r) for r in _pair(stray_resume_role, patched)]
    for r in after:
        assert "error" not in r, after
        assert r["resume"] == "returned" and r["engines_running"] is True
        assert tuple(r["step"]) == (True, False)  # has_unfinished (the request), no pause consensus


def test_resume_barrier_rebases_the_wave(patched: str) -> None:
    """Both ranks paused at waves 3 and 5 (a START_DP_WAVE or request reached one of them while paused):
    vLLM 0.32 resumes with the waves apart (the precondition of the resume-time race); patched, both
    adopt MAX + 1 = 6 with a fresh step counter, and rank 0 tells the coordinator the idle resume ended
    wave 5."""
    port = free_port()
    before = [
        ok(r)
        for r in run_roles(
            [
                (epoch_resume_role, (0, port, str(INSTALLED), 3)),
                (epoch_resume_role, (1, port, str(INSTALLED), 5)),
            ]
        )
    ]
    assert [r["current_wave"] for r in before] == [3, 5]
    port = free_port()
    after = [
        ok(r)
        for r in run_roles(
            [(epoch_resume_role, (0, port, patched, 3)), (epoch_resume_role, (1, port, patched, 5))]
        )
    ]
    assert [r["current_wave"] for r in after] == [6, 6]
    assert [r["step_counter"] for r in after] == [0, 0]
    assert after[0]["told_coordinator"] == [{"wave_complete": 5, "start_wave": None}]
    assert after[1]["told_coordinator"] == []


def test_weight_calls_are_gated_by_the_pause(patched: str) -> None:
    """Patched: a weight call outside a pause is refused before it reaches a worker; pause and resume
    are refused during a round (nothing changes); a failed call leaves the round failed until a new
    round finishes."""
    core = load_core(patched)
    running = make_engine(core, None, 0)
    with pytest.raises(RuntimeError, match="start_weight_update refused: the engines are not paused"):
        running.collective_rpc("start_weight_update")
    with pytest.raises(RuntimeError, match="update_weights refused: no weight round is active"):
        running.collective_rpc("update_weights", kwargs={"update_info": {}})
    assert running.model_executor.calls == []

    paused = make_engine(core, None, 0, paused=True, fail="update_weights")
    paused.collective_rpc("start_weight_update")
    assert paused.weight_round == "active"
    state = paused.scheduler.pause_state
    with pytest.raises(RuntimeError, match="pause_scheduler refused during a weight update"):
        paused.pause_scheduler("keep")
    with pytest.raises(RuntimeError, match="resume_scheduler refused during a weight update"):
        paused.resume_scheduler()
    assert paused.scheduler.pause_state == state and paused.ignore_start_dp_wave
    with pytest.raises(RuntimeError, match="worker update_weights failed"):
        paused.collective_rpc("update_weights", kwargs={"update_info": {}})
    assert paused.weight_round == "failed"
    with pytest.raises(RuntimeError, match="round failed"):
        paused.resume_scheduler()
    paused.model_executor.fail = ""
    for call in ("start_weight_update", "update_weights", "finish_weight_update"):
        paused.collective_rpc(call)
    assert paused.weight_round == "idle"
    assert paused.model_executor.calls[-3:] == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
