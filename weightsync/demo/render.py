"""The demo's rendering for people (``rich``): the per-sync table, the live progress and the summary.

The figures are explained in :class:`~weightsync.demo.config.SyncRecord` and the README's "What ``make
demo`` prints".
"""

from __future__ import annotations

from typing import Any

__all__ = ["COLUMNS", "DemoRenderer", "render_summary"]

_CPU_WIRE = {"nccl": "gloo for CPU tensors", "ipc": "CPU shared memory"}
"""What each backend runs on for the demo's CPU tensors (shown in the header)."""

#: The per-sync table: (header, width). Figures are explained in :class:`~weightsync.demo.config.SyncRecord`.
COLUMNS: tuple[tuple[str, int], ...] = (
    ("sync", 7),
    ("version", 7),
    ("MB", 5),
    ("buckets", 7),
    ("update s", 8),
    ("GB/s", 5),
    ("pause ms", 8),
    ("kept (mid-gen)", 14),
    ("aborted", 7),
    ("logit diff", 10),
    ("reward", 6),
)


def _console(console: Any = None) -> Any:
    from rich.console import Console

    if console is not None:
        return console
    con = Console()
    if not con.is_terminal:  # piped or captured: wide enough for the table (rich assumes 80 columns)
        con = Console(width=max(con.width, 112))
    return con


def _table(show_header: bool, title: str | None = None) -> Any:
    from rich.table import Table

    t = Table(show_header=show_header, box=None, pad_edge=False, title=title, title_justify="left")
    for name, w in COLUMNS:
        t.add_column(name, justify="right", min_width=w, no_wrap=True)
    return t


def render_summary(result: dict[str, Any], console: Any = None, table: bool = True) -> None:
    """Print the per-sync table (unless ``table`` is false) and the final summary of a
    :func:`~weightsync.demo.loop.run_demo`
    result with ``rich``."""
    con = _console(console)
    if table:
        t = _table(True, "weight syncs")
        for r in result["records"]:
            t.add_row(*_row(r))
        con.print(t)
    _print_summary(result, con)


def _row(r: dict[str, Any]) -> list[str]:
    versions = r["weight_versions"]
    ver = str(r["weight_version"]) if r["weight_version"] is not None else "/".join(map(str, versions)) + " !"
    kept = f"{r['kept_in_flight']} ({r['kept_mid_generation']})"
    diff = "0.0 exact" if r["logits_equal"] else f"{r['max_logit_diff']:.1e}"
    reward = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.3f}"
    return [
        "initial" if r["sync"] == 0 else str(r["sync"]),
        ver,
        f"{r['bytes'] / 1e6:.1f}",
        str(r["buckets"]),
        f"{r['seconds']:.3f}",
        f"{r['gbps']:.2f}",
        f"{r['pause_s'] * 1e3:.0f}",
        kept,
        str(r["aborted"]),
        diff,
        reward,
    ]


def _print_summary(result: dict[str, Any], con: Any) -> None:
    ok = result["ok"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    con.print(
        f"steps {result['steps']}  syncs {result['syncs']}  requests {result['requests']} "
        f"(finished {result['finished_requests']}, aborted {result['aborted_requests']}, "
        f"lost {result['lost_requests']}, kept in flight across syncs {result['kept_in_flight']})"
    )
    con.print(
        f"reward first {fmt(result['reward_first'])} -> last {fmt(result['reward_last'])}"
        f" (final policy rollouts {fmt(result['reward_final'])})   "
        f"max logit diff {result['max_logit_diff']}   weight versions {result['weight_versions']}"
    )
    if result["trace"]:
        con.print(f"trace: {result['trace']}", highlight=False)
        con.print(f"check it against the model: weightsync replay {result['trace']}", highlight=False)
    failed = [k for k, v in result["checks"].items() if not v]
    if result["error"]:
        con.print(f"[bold red]error:[/] {result['error']}", highlight=False)
    verdict = "[bold green]all checks passed[/]" if ok else f"[bold red]FAILED[/] ({', '.join(failed)})"
    con.print(f"{verdict} in {result['seconds']:.1f} s")


class DemoRenderer:
    """Live rendering for people: a progress bar over trainer steps and one table row per sync as it lands.

    Use as ``run_demo(cfg, on_event=renderer)`` (:func:`weightsync.demo.loop.run_demo`) inside ``with DemoRenderer() as renderer``.
    """

    def __init__(self, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = _console(console)
        self.progress = Progress(
            TextColumn("[bold]RL steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task: Any = None

    def __enter__(self) -> DemoRenderer:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "start":
            self.console.print(
                f"trainer: {data['architecture']}, {data['parameters'] / 1e6:.2f} M parameters in "
                f"{data['tensors']} tensors, {data['dtype']}, {data['bytes'] / 1e6:.1f} MB per sync",
                highlight=False,
            )
            self.console.print(
                f"engines: {data['ranks']} DP ranks, transport {data['transport']} (registered as "
                f"{data['backend']!r}; {_CPU_WIRE[data['backend']]}), "
                f"pause mode {data['mode']}, variant {data['variant']}",
                highlight=False,
            )
            self.task = self.progress.add_task("steps", total=data["steps"], info="starting engines")
        elif kind == "step" and self.task is not None:
            r = data["reward_mean"]
            info = f"reward {r:.3f}" if r is not None else "no finished samples"
            self.progress.update(self.task, info=f"step {data['step']}: {info}, syncing")
        elif kind == "sync":
            self._print_row(data)
            if self.task is not None:
                if data["sync"] > 0:
                    self.progress.advance(self.task)
                self.progress.update(self.task, info=f"synced {data['weight_version']}")

    def _print_row(self, r: dict[str, Any]) -> None:
        t = _table(show_header=r["sync"] == 0)
        t.add_row(*_row(r))
        self.console.print(t)
