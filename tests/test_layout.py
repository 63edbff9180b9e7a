"""The package layout (issue 23): one home for each job, the one-way layering, no file over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "weightsync"

#: What vLLM loads, and nothing else (tools around a running vLLM live in weightsync.vllm_tools).
VLLM_PLUGIN = {"__init__", "plugin", "engine", "trainer", "clients", "reload", "cpu_collectives"}
#: Files left over 500 lines, each with its reason (none).
OVER_500: dict[str, str] = {}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_vllm_package_is_only_the_plugin() -> None:
    found = {p.stem for p in (PKG / "vllm").iterdir() if p.suffix == ".py" or p.is_dir()}
    found.discard("__pycache__")
    assert found == VLLM_PLUGIN


def test_no_file_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    }
    assert set(long) <= set(OVER_500), long


def test_one_way_layering() -> None:
    """spec imports nothing of weightsync but spec; impl never imports model; nothing below the applications
    imports repro, the CLI or the vLLM tools; only the vLLM packages import vllm."""
    below = {"spec": {"spec"}, "impl": {"spec", "impl"}, "model": {"spec", "model", "impl"}}
    # (patches/: the series' tests are vLLM's own tests, to go upstream with the patches)
    vllm_ok = [PKG / "vllm", PKG / "vllm_tools", PKG / "repro" / "vllm", PKG / "patches"]
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).parts
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "vllm" and not any(a in path.parents for a in vllm_ok):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
            if (
                parts[0] == "weightsync"
                and len(parts) > 1
                and rel[0] in below
                and parts[1] not in below[rel[0]]
            ):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


def test_patch_series_is_package_data() -> None:
    import tomllib

    from weightsync.vllm_tools.fix import PATCH_DIR, SERIES

    assert len(SERIES) == 8 and all(p.is_file() and PKG in p.parents for p in SERIES)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(
        p.relative_to(PKG).match(g) for p in SERIES for g in globs["weightsync"] if g.endswith(".patch")
    )
    assert PATCH_DIR.name == "vllm-0.32"
