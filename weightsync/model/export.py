"""``weightsync export``: per-rank FSM, global state graph and counterexamples in DOT, Mermaid, GraphML, SVG.

SVG is rendered by Graphviz ``dot`` (Debian package ``graphviz``) from the DOT text.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from weightsync.model.check import build_model, check, explore_model
from weightsync.model.fsm_export import rank_fsm_dot, rank_fsm_mermaid
from weightsync.model.system import Bounds, G, Step, describe
from weightsync.spec.rank import get_variant
from weightsync.spec.states import PauseMode


def counterexample_mermaid(cx: dict[str, Any], ranks: int, title: str = "") -> str:
    """A counterexample record (from :func:`~weightsync.model.check.check` / :func:`~weightsync.model.check.counterexample_record`) as a Mermaid
    ``sequenceDiagram`` with one lane per process: controller, front-end, coordinator, trainer, rank 0..N-1."""
    lanes = ["controller", "front-end", "coordinator", "trainer", *(f"rank {i}" for i in range(ranks))]
    ids = {name: name.replace(" ", "").replace("-", "") for name in lanes}

    def clean(x: str) -> str:
        return x.replace(";", ",").replace("#", "no. ").replace("\n", " ")

    lines = ["sequenceDiagram"]
    if title:
        lines.insert(0, f"%% {clean(title)}")
    for name in lanes:
        lines.append(f"    participant {ids[name]} as {name}")
    for k, rec in enumerate(cx.get("records", []), start=1):
        st = Step(**rec)
        lanes_ = [ln for ln in st.lanes if ln in ids]
        text = clean(f"{k}. {st.text}")
        if st.action in ("fans out", "sends") and st.lane_from in ids and lanes_:
            lines.append(f"    {ids[st.lane_from]}-){ids[lanes_[0]]}: {text}")
        elif st.process == "coordinator":
            lines.append(f"    Note over {ids['coordinator']}: {text}")
        elif len(lanes_) > 1:
            lines.append(f"    Note over {ids[lanes_[0]]},{ids[lanes_[-1]]}: {text}")
        elif lanes_:
            lines.append(f"    Note over {ids[lanes_[0]]}: {text}")
    if cx.get("steps"):
        lines.append(f"    Note over {ids['controller']},{ids[lanes[-1]]}: {clean(cx['steps'][-1])}")
    return "\n".join(lines) + "\n"


def state_graph(
    variant: str = "two-phase-epoch",
    ranks: int = 2,
    mode: PauseMode | str = PauseMode.KEEP,
    channels: str = "per-socket",
    bounds: Bounds | None = None,
) -> Any:
    """The explored state graph as a ``networkx.DiGraph`` (meant for N=2): nodes are state indices with
    scalar attributes only (``repr``, ``level``, ``initial``, per-rank ``state_i`` / ``wave_i``, ``phase``,
    ``end``), edges carry the human ``label``. GraphML-safe."""
    import networkx as nx

    from weightsync.model.explorer import to_networkx

    model = build_model(variant, ranks, mode, channels, bounds)
    ex = explore_model(model, keep_edges=True, keep_labels=True)

    def attrs(s: G) -> dict[str, Any]:
        d: dict[str, Any] = {
            "phase": int(s.ctrl.phase),
            "end": model.is_end(s),
            "violation": bool(model.invariant(s)),
        }
        for i, r in enumerate(s.ranks):
            d[f"state_{i}"] = r.vars.state.value
            d[f"wave_{i}"] = int(r.vars.current_wave)
            d[f"blocked_{i}"] = r.blocked
        return d

    g = to_networkx(ex, attrs)
    assert ex.src is not None and ex.dst is not None and ex.labels is not None
    for k, (a, b) in enumerate(zip(ex.src, ex.dst, strict=True)):
        g.edges[int(a), int(b)]["label"] = describe(model, ex.states[a], ex.labels[k], ex.states[b]).text
    g.graph.update(
        {
            "variant": variant,
            "ranks": ranks,
            "mode": PauseMode(mode).value,
            "channels": channels,
            "bounds": repr(model.config.bounds),
            "symmetry": False,
            "states": len(ex.states),
            "transitions": ex.transitions,
        }
    )
    assert isinstance(g, nx.DiGraph)
    return g


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
