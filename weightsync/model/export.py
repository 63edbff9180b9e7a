"""``weightsync export``: per-rank FSM, global state graph and counterexamples in DOT, Mermaid, GraphML, SVG.

SVG is rendered by Graphviz ``dot`` (Debian package ``graphviz``) from the DOT text.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from weightsync.model.check import check, counterexample_mermaid, state_graph
from weightsync.model.fsm_export import rank_fsm_dot, rank_fsm_mermaid
from weightsync.model.system import Bounds
from weightsync.spec.rank import get_variant

#: Formats each export supports.
FORMATS: dict[str, tuple[str, ...]] = {
    "rank-fsm": ("dot", "mermaid", "svg"),
    "state-graph": ("graphml", "dot", "svg"),
    "counterexample": ("mermaid",),
}


class ExportError(ValueError):
    """An export that cannot be produced (unsupported format, no counterexample, no ``dot``)."""


def render_svg(dot_text: str, out: Path, timeout_s: float = 120.0) -> None:
    """Render DOT text to ``out`` as SVG with Graphviz ``dot``.

    Raises:
        ExportError: ``dot`` is not installed, fails, or runs longer than ``timeout_s`` seconds.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise ExportError("SVG needs Graphviz `dot` (install the Debian package `graphviz`)")
    try:
        proc = subprocess.run(
            [exe, "-Tsvg", "-o", str(out)], input=dot_text.encode(), capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise ExportError(f"dot took longer than {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise ExportError(f"dot failed: {proc.stderr.decode(errors='replace').strip()}")


def _graph_dot(graph: Any, title: str) -> str:
    lines = [f'digraph "{title}" {{', "  node [shape=point];", f'  label="{title}";']
    for n, attrs in sorted(graph.nodes(data=True)):
        colour = "red" if attrs.get("initial") else ("green" if attrs.get("end") else "black")
        lines.append(f'  {n} [color="{colour}"];')
    for u, v in sorted(graph.edges()):
        lines.append(f"  {u} -> {v};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def export(
    what: str,
    fmt: str,
    out: Path,
    *,
    variant: str = "two-phase-epoch",
    ranks: int = 2,
    mode: str = "keep",
    channels: str = "per-socket",
    requests: int = 1,
) -> dict[str, Any]:
    """Write one export to ``out`` and return a summary (what, format, out, variant, ranks, …).

    Raises:
        ExportError: ``fmt`` is not supported for ``what`` (the message lists what is), the variant has no
            counterexample to export, or SVG rendering failed.
        ValueError: unknown variant.
    """
    v = get_variant(variant)
    if fmt not in FORMATS[what]:
        raise ExportError(f"{what} cannot be exported as {fmt!r}; supported: {', '.join(FORMATS[what])}")
    out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"what": what, "format": fmt, "out": str(out), "variant": variant}
    if what == "rank-fsm":
        if fmt == "mermaid":
            out.write_text(rank_fsm_mermaid(v))
        elif fmt == "dot":
            out.write_text(rank_fsm_dot(v))
        else:
            render_svg(rank_fsm_dot(v), out)
        return summary
    bounds = Bounds(requests=requests)
    summary.update(ranks=ranks, mode=mode, channels=channels, bounds=bounds._asdict())
    if what == "state-graph":
        import networkx as nx

        graph = state_graph(variant, ranks, mode, channels, bounds)
        summary.update(nodes=graph.number_of_nodes(), edges=graph.number_of_edges())
        title = f"{variant} N={ranks} mode={mode} channels={channels} requests={requests}"
        if fmt == "graphml":
            graph.graph.update(title=title, symmetry=False)
            nx.write_graphml(graph, str(out))
        elif fmt == "dot":
            out.write_text(_graph_dot(graph, title))
        else:
            render_svg(_graph_dot(graph, title), out)
        return summary
    result = check(variant, ranks, mode=mode, channels=channels, bounds=bounds, progress=False)
    cx = result.get("counterexample")
    if cx is None:
        raise ExportError(
            f"{variant} has no counterexample with N={ranks}, mode={mode}, channels={channels}: "
            f"verdict {result['verdict']}"
        )
    out.write_text(counterexample_mermaid(cx, ranks, title=f"{variant}: {cx['property']} ({cx['mode']})"))
    summary.update(property=cx["property"], steps=len(cx["steps"]))
    return summary
