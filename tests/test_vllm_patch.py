"""weightsync's patch series for vLLM 0.32 (``weightsync/patches/vllm-0.32/``) against the installed vLLM: it
applies with ``patch -p1`` in order, and vLLM's own ``DPEngineCoreProc`` code with it behaves as variant
``vllm-0.32-epoch`` says, on a real gloo DP group, where the shipped code deadlocks or keeps the waves apart
as variant ``vllm-0.32`` says.

No engine is started: the roles (``tests/vllm_patch_roles.py``) call vLLM's pause/resume methods on its
class with the attributes those methods read set by hand, so each case costs an import, not an engine.
The engine-level tests of each patch, written as vLLM tests, are ``tests/vllm_upstream/`` (run by
``tests/test_vllm_upstream.py``, slow).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from vllm_util import require_vllm

vllm = require_vllm()

from transfer_procs import free_port, ok, reset_pool, run_roles  # noqa: E402
from vllm_patch_roles import epoch_resume_role, load_core, make_engine, stray_resume_role  # noqa: E402

from weightsync.vllm_tools import fix  # noqa: E402

SITE = Path(vllm.__file__).parents[1]


def _apply(root: Path, *args: str) -> str:
    out = []
    for patch in fix.SERIES:
        r = subprocess.run(
            ["patch", "-p1", "--forward", "--fuzz=0", *args, "-i", str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, (patch.name, r.stdout + r.stderr)
        out.append(r.stdout)
    return "".join(out)


@pytest.fixture(scope="module")
def patched() -> str:
    if vllm.__version__ != "0.32.0":
        pytest.skip(f"the patches are for vLLM 0.32.0, installed: {vllm.__version__}")
    if shutil.which("patch") is None:
        pytest.skip("patch(1) is not installed (apt-get install patch)")
    return "patched"


def test_the_series_applies_in_order_to_a_copy_of_the_installed_tree(patched: str, tmp_path: Path) -> None:
    """``patch -p1`` of each patch, in order, with no fuzz, to copies of the files it changes; the
    installed tree itself is untouched (a dry run there must apply too)."""
    assert [p.name[:4] for p in fix.SERIES] == [
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
        "0006",
        "0007",
        "0008",
    ]
    for rel in fix.SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / rel, tmp_path / rel)
    said = _apply(tmp_path)
    for rel in fix.SOURCES:
        assert f"patching file {rel}" in said
        assert (tmp_path / rel).read_text() == fix.patched_sources()[rel]
    text = fix.patched_sources()
    for patch in fix.SERIES:  # upstreamable: no weightsync names, no imports inside methods
        body = patch.read_text()
        assert "weightsync" not in body.lower() and "+        import " not in body, patch.name
    assert "sync_dp_resume_state" in text["vllm/config/parallel.py"]


def test_the_first_patch_alone_applies_and_the_gate_needs_it(patched: str, tmp_path: Path) -> None:
    """0001 applies alone (the race fix does not need the gate); 0002 is written on top of it."""
    for rel in fix.SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / rel, tmp_path / rel)
    r = subprocess.run(
        ["patch", "-p1", "--dry-run", "--fuzz=0", "-i", str(fix.SERIES[0])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _run(
    roles: list[tuple[Any, tuple[Any, ...]]], deadline_s: float = 60.0, grafts: bool = True
) -> list[tuple[Any, ...]]:
    """The roles on the pooled processes. After roles that graft the series (``grafts``) the pool is reset:
    a grafted process must not serve a "shipped" role (``load_core`` asserts it). Shipped roles leave
    their processes as they were, so the next run reuses them and their import of vLLM."""
    try:
        return run_roles(roles, deadline_s=deadline_s)
    finally:
        if grafts:
            reset_pool()


def _pair(role: Any, which: str, *args: Any, deadline_s: float = 60.0) -> list[tuple[Any, ...]]:
    port = free_port()
    roles = [(role, (0, port, which, *args)), (role, (1, port, which, *args))]
    return _run(roles, deadline_s=deadline_s, grafts=which != "shipped")


def test_stray_resume_deadlocks_vllm_032_and_not_the_patch(patched: str) -> None:
    """vLLM 0.32: the idle rank takes the stray resume into the barrier (a MAX all-reduce) while its
    peer, serving, takes its DP step (a SUM all-reduce): mismatched collectives, caught by the 6 s group
    timeout (or by gloo's size check). Patched: the resume is a no-op on both, the idle rank joins the
    wave and the DP step completes with the request counted."""
    before = [ok(r) for r in _pair(stray_resume_role, "shipped")]
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
        for r in _run(
            [
                (epoch_resume_role, (0, port, "shipped", 3)),
                (epoch_resume_role, (1, port, "shipped", 5)),
            ],
            grafts=False,
        )
    ]
    assert [r["current_wave"] for r in before] == [3, 5]
    port = free_port()
    after = [
        ok(r)
        for r in _run(
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
    with pytest.raises(RuntimeError, match="start_weight_update called while the engines are not paused"):
        running.collective_rpc("start_weight_update")
    with pytest.raises(RuntimeError, match="update_weights called without an active weight update"):
        running.collective_rpc("update_weights", kwargs={"update_info": {}})
    assert running.model_executor.calls == []

    paused = make_engine(core, None, 0, paused=True, fail="update_weights")
    paused.collective_rpc("start_weight_update")
    assert paused.weight_update_state == "active"
    state = paused.scheduler.pause_state
    with pytest.raises(RuntimeError, match="pause_scheduler called during a weight update"):
        paused.pause_scheduler("keep")
    with pytest.raises(RuntimeError, match="resume_scheduler called during a weight update"):
        paused.resume_scheduler()
    assert paused.scheduler.pause_state == state and paused.ignore_start_dp_wave
    with pytest.raises(RuntimeError, match="worker update_weights failed"):
        paused.collective_rpc("update_weights", kwargs={"update_info": {}})
    assert paused.weight_update_state == "failed"
    with pytest.raises(RuntimeError, match=r"during a weight update \(failed\)"):
        paused.resume_scheduler()
    paused.model_executor.fail = ""
    for call in ("start_weight_update", "update_weights", "finish_weight_update"):
        paused.collective_rpc(call)
    assert paused.weight_update_state == "idle"
    assert paused.model_executor.calls[-3:] == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]


def test_a_pause_on_paused_engines_changes_nothing_and_init_waits_for_the_pause(patched: str) -> None:
    """Patch 0006: a pause in another mode on a paused engine (consensus reached) returns None at once and
    leaves the scheduler's PauseState (keep's PAUSED_ALL) alone, so a kept request is not scheduled; a
    transfer init while a pause is in flight or during a session is refused before it reaches a worker, and
    let through once the pause returned and after a failed session."""
    from vllm.v1.core.sched.interface import PauseState

    core = load_core(patched)
    paused = make_engine(core, None, 0, paused=True, unfinished=True)
    for mode in ("wait", "abort", "keep"):
        assert paused.pause_scheduler(mode, clear_cache=False) is None
        assert paused.scheduler.pause_state == PauseState.PAUSED_ALL
        assert not paused.engines_running and not paused.pending_pause and paused.ignore_start_dp_wave
    pausing = make_engine(core, None, 0, pending_pause=True, engines_running=True)
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine called while a pause is in flight"):
        pausing.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    paused.collective_rpc("start_weight_update")
    with pytest.raises(RuntimeError, match="a weight update is active"):
        paused.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    assert pausing.model_executor.calls == [] and paused.model_executor.calls == ["start_weight_update"]
    paused.model_executor.fail = "update_weights"
    with pytest.raises(RuntimeError, match="worker update_weights failed"):
        paused.collective_rpc("update_weights", kwargs={"update_info": {}})
    paused.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})  # after a failed session
    assert paused.model_executor.calls[-1] == "init_weight_transfer_engine"


def test_a_pause_retried_past_the_consensus_joins_the_pause_in_progress(patched: str) -> None:
    """Patch 0007: a pause that reaches a rank past the DP pause consensus (``ignore_start_dp_wave``) while
    it still drains (``engines_running``) changes nothing, whatever its mode: ``pending_pause`` stays clear
    (set again, the rank would wait alone for a consensus its peers never join) and the PauseState stays.
    Its future resolves when the rank is idle, as the pause it joins does."""
    from vllm.v1.core.sched.interface import PauseState

    core = load_core(patched)
    eng = make_engine(
        core, None, 0, paused=True, unfinished=True, engines_running=True, _idle_state_callbacks=[]
    )
    eng.scheduler.pause_state = PauseState.PAUSED_NEW  # a wait pause drains
    futures = [eng.pause_scheduler(mode, clear_cache=False) for mode in ("wait", "abort", "keep")]
    assert all(f is not None and not f.done() for f in futures)
    assert not eng.pending_pause and eng.ignore_start_dp_wave and eng.engines_running
    assert eng.scheduler.pause_state == PauseState.PAUSED_NEW and eng.model_executor.calls == []
    eng.engines_running = False  # drained: the loop finds the rank idle
    eng._notify_idle_state_callbacks()
    assert [f.result(0) for f in futures if f is not None] == [None, None, None]
    assert eng.model_executor.calls == ["synchronize_device"] * 3


def test_init_is_taken_only_before_serving_or_while_paused(patched: str) -> None:
    """Patch 0008: ``init_weight_transfer_engine`` on a rank that served (a wave ended or a resume re-based
    it: ``current_wave`` > 0) or that runs a wave is refused, naming the wave, before it reaches a worker;
    a rank that never served takes it, and so does a paused one (consensus reached) whatever its wave."""
    core = load_core(patched)
    for fields in (
        {"current_wave": 1},
        {"engines_running": True},
        {"current_wave": 3, "engines_running": True},
    ):
        eng = make_engine(core, None, 0, **fields)
        wave = fields.get("current_wave", 0)
        with pytest.raises(RuntimeError, match=rf"while the engines serve \(wave {wave}\)"):
            eng.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        assert eng.model_executor.calls == [], fields
    for fields in ({}, {"paused": True, "current_wave": 3}):
        eng = make_engine(core, None, 0, **fields)
        eng.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        assert eng.model_executor.calls == ["init_weight_transfer_engine"], fields
