"""The resume-epoch fix (``weightsync/patches/vllm-0.32-resume-epoch.patch``) installed into a running vLLM 0.32.0 by the
plugin: opt-in (:data:`ENV_FIX` = ``epoch``), version-gated to 0.32.0, and the patch itself, not a copy.

:func:`patched_core_source` applies the patch with ``patch(1)`` to a copy of the installed
``vllm/v1/engine/core.py``; :func:`install` compiles that copy and grafts onto the installed
``DPEngineCoreProc`` every method the patch changes or adds (compared by code object), each rebound to the
installed module's globals and to the installed class (its ``super()`` cell), so the engine runs the
patched methods and nothing else of the copy. The patch's ``__init__`` hunk only sets
``self.weight_round = "idle"``; the plugin runs inside ``EngineCore.__init__`` (``core.py:129``), after
``DPEngineCoreProc.__init__`` has begun, so that attribute is installed as a class default instead.

Raises (from :func:`install`, before anything is changed): :class:`RuntimeError` when vLLM is not 0.32.0,
``patch(1)`` is missing, or the patch does not apply to the installed source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path
from typing import Any

#: ``epoch``: install the fix in every engine process (unset: vLLM as shipped)
ENV_FIX = "WEIGHTSYNC_VLLM_FIX"
FIXES = ("epoch",)
#: the patch, at the top of the repository (an editable install: the package sits beside it)
PATCH = Path(__file__).resolve().parents[1] / "patches" / "vllm-0.32-resume-epoch.patch"
VLLM_VERSION = "0.32.0"

_installed: list[str] = []


def patched_core_source(patch: Path = PATCH) -> str:
    """The installed ``vllm/v1/engine/core.py`` with ``patch`` applied, as text.

    Raises:
        RuntimeError: vLLM is not 0.32.0, ``patch(1)`` or the patch file is missing, or it does not apply.
    """
    import vllm
    import vllm.v1.engine.core as core

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"the resume-epoch fix is for vLLM {VLLM_VERSION}; installed: {vllm.__version__}")
    if shutil.which("patch") is None:
        raise RuntimeError(
            "patch(1) is not installed (apt-get install patch): the fix applies the patch file"
        )
    if not patch.is_file():
        raise RuntimeError(
            f"{patch}: the patch file is missing (package data weightsync/patches/ is not installed)"
        )
    src = Path(str(core.__file__))
    with tempfile.TemporaryDirectory(prefix="weightsync-fix-") as tmp:
        out = Path(tmp) / "core.py"
        proc = subprocess.run(
            ["patch", "--forward", "--silent", "-o", str(out), str(src), str(patch)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to {src}: {proc.stdout}{proc.stderr}".strip())
        return out.read_text(encoding="utf-8")


def _rebind(fn: types.FunctionType, globals_: dict[str, Any], cls: type) -> types.FunctionType:
    closure = fn.__closure__
    if closure is not None:
        names = fn.__code__.co_freevars
        closure = tuple(
            types.CellType(cls) if name == "__class__" else cell
            for name, cell in zip(names, closure, strict=True)
        )
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


def install(fix: str = "epoch") -> list[str]:
    """Graft the patched ``DPEngineCoreProc`` methods onto the installed class (idempotent). Returns the
    names installed, e.g. ``["collective_rpc", "pause_scheduler", "resume_scheduler", ...]``.

    Raises:
        ValueError: ``fix`` is not one of :data:`FIXES`.
        RuntimeError: see :func:`patched_core_source`; or the patched source lacks ``DPEngineCoreProc``.
    """
    if fix not in FIXES:
        raise ValueError(f"{ENV_FIX}={fix!r}: the fixes are {', '.join(FIXES)}")
    if _installed:
        return list(_installed)
    import vllm.v1.engine.core as core

    text = patched_core_source()
    module = types.ModuleType("weightsync_vllm_patched_core")
    module.__dict__["__file__"] = "<patched vllm/v1/engine/core.py>"
    exec(compile(text, module.__dict__["__file__"], "exec"), module.__dict__)
    patched = module.__dict__.get("DPEngineCoreProc")
    if not isinstance(patched, type):
        raise RuntimeError("the patched core.py defines no DPEngineCoreProc")
    cls: Any = core.DPEngineCoreProc
    names: list[str] = []
    for name, value in patched.__dict__.items():
        if name == "__init__" or name.startswith("__"):
            continue
        mine = cls.__dict__.get(name)
        if isinstance(value, types.FunctionType):
            same = isinstance(mine, types.FunctionType) and (
                mine.__code__.co_code,
                mine.__code__.co_consts,
            ) == (
                value.__code__.co_code,
                value.__code__.co_consts,
            )
            if same:
                continue
            setattr(cls, name, _rebind(value, core.__dict__, cls))
            names.append(name)
        elif mine is None and not callable(value):
            setattr(cls, name, value)
            names.append(name)
    cls.weight_round = "idle"  # the __init__ hunk's attribute (see the module docstring)
    names.append("weight_round")
    _installed.extend(sorted(names))
    return list(_installed)


def install_from_env() -> list[str]:
    """:func:`install` when :data:`ENV_FIX` is set (the plugin's hook); ``[]`` otherwise."""
    fix = os.environ.get(ENV_FIX, "").strip()
    return install(fix) if fix else []


__all__ = ["ENV_FIX", "FIXES", "PATCH", "install", "install_from_env", "patched_core_source"]
