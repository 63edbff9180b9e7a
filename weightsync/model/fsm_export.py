"""Per-rank FSM diagrams (DOT, Mermaid) and ``spec/PROTOCOL.md``, generated from the spec tables.

Output is deterministic (sorted nodes and edges), so checked-in copies under ``spec/`` can be tested for
freshness.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

from weightsync.spec.calls import (
    CALL_ARGS,
    CALL_EVENT,
    DEFERRED_REPLY,
    PAUSE_ARGS,
    PHASE_CALL,
    TRAINER_COLLECTIVE,
    Phase,
)
from weightsync.spec.collectives import COLLECTIVES, collectives_digest
from weightsync.spec.controller import CTRL_EFFECTS, controller_digest, controller_table
from weightsync.spec.coordinator import coordinator_digest, coordinator_table
from weightsync.spec.front_end import FRONT_END_TABLE, FrontEvent, front_end_digest, front_end_table
from weightsync.spec.rank import EFFECTS, VARIANTS, Variant, spec_digest
from weightsync.spec.rules import RULES
from weightsync.spec.states import IN_FLIGHT_FINISH, LOCAL_CALLS, RankEvent, RankState
from weightsync.spec.table import ALWAYS, Transition
from weightsync.spec.worker import WORKER_TABLE, WorkerState

_MESSAGES = frozenset({RankEvent.ADD, RankEvent.ABORT, RankEvent.START_DP_WAVE})
_OUTCOMES = frozenset(
    {
        RankEvent.DP_STEP_DONE,
        RankEvent.DP_SYNC_DONE,
        RankEvent.RESUME_BARRIER_DONE,
        RankEvent.WEIGHT_BROADCAST_DONE,
        RankEvent.TRANSFER_INIT_DONE,
    }
)
#: Edge colour per event kind.
KIND_COLOURS = {"call": "#1f77b4", "message": "#2ca02c", "step": "#7f7f7f", "collective": "#ff7f0e"}


def event_kind(event: RankEvent) -> str:
    """'call', 'message', 'step' or 'collective' (used to colour edges)."""
    if event in LOCAL_CALLS:
        return "call"
    if event in _MESSAGES:
        return "message"
    if event in _OUTCOMES:
        return "collective"
    return "step"


def _edges(variant: Variant) -> list[tuple[str, str, str, str]]:
    """(source, target, event, guards) aggregated over rows, sorted."""
    agg: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for (s, e), rows in variant.table.items():
        for tr in rows:
            agg[(s.value, tr.target.value, e.value)].append(tr.guard)
    return sorted((s, t, e, " | ".join(g for g in gs if g != ALWAYS)) for (s, t, e), gs in agg.items())


def rank_fsm_dot(variant: Variant) -> str:
    """The per-rank FSM of ``variant`` as Graphviz DOT (edges coloured by event kind)."""
    lines = [
        f'digraph "{variant.name}" {{',
        "  rankdir=LR;",
        '  node [shape=box, style=rounded, fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=9];',
        f'  label="{variant.name}: per-rank FSM ({variant.source}); digest {variant.digest()[:12]}";',
        '  __start [shape=point, label=""];',
        f'  __start -> "{RankState.RUNNING.value}" [label="start"];',
    ]
    for s in sorted(st.value for st in RankState):
        lines.append(f'  "{s}";')
    for s, t, e, g in _edges(variant):
        label = e + (f" [{g}]" if g else "")
        colour = KIND_COLOURS[event_kind(RankEvent(e))]
        lines.append(f'  "{s}" -> "{t}" [label="{label}", color="{colour}", fontcolor="{colour}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def rank_fsm_mermaid(variant: Variant, self_loops: bool = False) -> str:
    """The per-rank FSM as a Mermaid ``stateDiagram-v2``; one edge per (source, target) listing events.

    Self-loops (messages and steps that keep the state) are omitted unless ``self_loops``.
    """
    agg: dict[tuple[str, str], list[str]] = defaultdict(list)
    for s, t, e, _g in _edges(variant):
        if s == t and not self_loops:
            continue
        if e not in agg[(s, t)]:
            agg[(s, t)].append(e)
    lines = [
        "stateDiagram-v2",
        f"    %% {variant.name}: per-rank FSM; digest {variant.digest()[:12]}",
        f"    [*] --> {RankState.RUNNING.value}",
    ]
    for (s, t), events in sorted(agg.items()):
        lines.append(f"    {s} --> {t} : {', '.join(sorted(events))}")
    err = RankState.ERROR.value
    lines.append(f'    state "{err} (sticky; every (state, event) pair without a row leads here)" as {err}')
    return "\n".join(lines) + "\n"


def worker_fsm_mermaid() -> str:
    """The worker weight-update machine as a Mermaid ``stateDiagram-v2``."""
    lines = ["stateDiagram-v2", f"    [*] --> {WorkerState.READY.value}"]
    for (s, e), rows in sorted(WORKER_TABLE.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
        for tr in rows:
            lines.append(f"    {s.value} --> {tr.target.value} : {e.value}")
    return "\n".join(lines) + "\n"


def _table_markdown(variant: Variant) -> str:
    return _rows_markdown(variant.table)


def _label(x: Any) -> str:
    """A state's name in a table: an IntEnum's (the controller's phases) lower-case name, else its value."""
    return x.name.lower() if isinstance(x, IntEnum) else str(x.value)


def _rows_markdown(table: Mapping[tuple[Any, Any], tuple[Transition, ...]]) -> str:
    out = [
        "| state | event | guard | target | updates | effects | rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for (s, e), rows in sorted(table.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
        for tr in rows:
            out.append(
                f"| {_label(s)} | {e.value} | {tr.guard} | {_label(tr.target)} | {', '.join(tr.updates) or '-'} | "
                f"{', '.join(tr.effects) or '-'} | {tr.rule} |"
            )
    return "\n".join(out)


def _controller_markdown() -> list[str]:
    """The RL controller's tables (``weightsync/spec/controller.py``) and the call maps."""
    parts = [
        "## RL controller",
        "",
        "The controller's state is the phase whose call it made last; its event the outcome of that call on "
        "every rank (and the trainer where it joins): `done`, `failed` (some answer was an error) or "
        "`waiting`. The model explores every row whose guard holds (policy `recover`); the reference "
        "`update_round` takes the first (policy `one_round`). Rows guarded `recovers*` / `gives_up` / "
        "`round_over*` are the two policies' difference (`weightsync/spec/controller.py`). "
        f"Digest `{controller_digest()[:16]}`.",
        "",
        "| phase | call | rank event | trainer joins |",
        "|---|---|---|---|",
    ]
    for ph, call in PHASE_CALL.items():
        joins = TRAINER_COLLECTIVE.get(ph)
        parts.append(
            f"| {Phase(ph).name.lower()} | `{call}` | `{CALL_EVENT[call].value}` | "
            f"{f'`{joins.value}`' if joins else '-'} |"
        )
    parts += ["", "Table arguments a call carries to the rank (`call_args`; defaults are vLLM 0.32's):", ""]
    for ev, names in CALL_ARGS.items():
        shown = [f"`{n}`={PAUSE_ARGS[n]!r}" if n in PAUSE_ARGS else f"`{n}` (the rank's)" for n in names]
        parts.append(
            f"- `{ev.value}`: {', '.join(shown)}; every other call: none (its kwargs are the worker's)"
        )
    parts += ["", "Replies a later transition gives (the call returns at that effect):", ""]
    parts += [f"- `{ev.value}`: at `{eff}`" for ev, eff in DEFERRED_REPLY.items()]
    parts += ["", "How a request in flight when the pause arrives may finish, per mode:", ""]
    parts += [f"- `{m.value}`: {', '.join(sorted(r))}" for m, r in IN_FLIGHT_FINISH.items()]
    parts += ["", "Effects:", ""]
    parts += [f"- `{name}`: {doc}" for name, doc in CTRL_EFFECTS.items()]
    for fe, title in ((False, "every variant but front-end-pause"), (True, "front-end-pause")):
        parts += ["", f"### Controller table ({title})", "", _rows_markdown(controller_table(fe)), ""]
    return parts


def _collectives_markdown() -> list[str]:
    """The collectives' data (``weightsync/spec/collectives.py``)."""
    parts = [
        "## Collectives",
        "",
        "Every member contributes the named values; they reduce as shown, and the completion event "
        "carries the outcome arguments (`weightsync/spec/collectives.py`; the model and the reference DP "
        f"group use these). Digest `{collectives_digest()[:16]}`.",
        "",
        "| collective | group | entered by | completes with | reduction | contributes | outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, c in COLLECTIVES.items():
        parts.append(
            f"| `{kind.value}` | {'DP' if c.dp else 'weight transfer (with the trainer)'} | `{c.enter}` | "
            f"`{c.done.value}` | {c.reduction.value} | {', '.join(c.contributes) or '-'} | "
            f"{', '.join(c.outcome) or '-'} |"
        )
    parts.append("")
    return parts


def protocol_markdown() -> str:
    """The full text of ``spec/PROTOCOL.md``: numbered rules, then per-variant tables and diagrams."""
    parts = [
        "# The weightsync protocol",
        "",
        "GENERATED by `weightsync prove` from `weightsync/spec` (rules: `weightsync/spec/rules.py`; rank tables: "
        "`weightsync/spec/rank_tables.py`, `weightsync/spec/rank_vllm032.py` over `weightsync/spec/rank_vars.py`; "
        "`weightsync/spec/worker.py`, `coordinator.py`, `front_end.py`, `controller.py`, `collectives.py`). "
        "Do not edit by hand.",
        "",
        f"Spec digest: `{spec_digest()}`",
        "",
        "## Rules",
        "",
    ]
    for i, rule in enumerate(RULES, 1):
        parts.append(f"{i}. **{rule.title}.** {rule.text} *(Source: {rule.source}.)*")
    parts += ["", "## States", ""]
    parts += [f"- `{s.value}`" for s in RankState]
    parts += ["", "## Effects", ""]
    parts += [f"- `{name}`: {doc}" for name, doc in sorted(EFFECTS.items())]
    parts += [
        "",
        "## Worker weight-update machine",
        "",
        "```mermaid",
        worker_fsm_mermaid().rstrip(),
        "```",
        "",
    ]
    parts += _coordinator_markdown()
    parts += _controller_markdown()
    parts += _collectives_markdown()
    parts += [
        "## API front-end",
        "",
        "vLLM's DP front-end client: its state is its `engines_running` belief, its variables the believed "
        "`current_wave` (stamped on every ADD) and the front-end pause gate (`weightsync/spec/front_end.py`). "
        f"Digest `{front_end_digest()[:16]}`.",
        "",
        _rows_markdown(FRONT_END_TABLE),
        "",
        "Variants with `front_end_latches=False` ("
        + ", ".join(f"`{v.name}`" for v in VARIANTS.values() if not v.front_end_latches)
        + ", weightsync's patch 0004) forward FIRST_REQ without setting `engines_running` "
        f"(digest `{front_end_digest(False)[:16]}`):",
        "",
        _rows_markdown(
            {k: rows for k, rows in front_end_table(False).items() if k[1] is FrontEvent.SEND_REQUEST}
        ),
        "",
    ]
    drains = [v.name for v in VARIANTS.values() if _drains_queued(v)]
    parts += [
        "## Which requests a wait-mode pause drains",
        "",
        "vLLM 0.32's `wait` drains the requests a step already scheduled (running) and leaves those still "
        "queued when the pause arrives queued under PAUSED_NEW until the resume "
        "(`v1/core/sched/scheduler.py:900-917`; `get_num_unfinished_requests` does not count them, "
        "`:2803-2811`). A request the client added before the pause is queued or running depending on "
        "whether a step ran between the two: `_process_input_queue` handles every queued message before the "
        "next step (`v1/engine/core.py:1573-1601`), so an ADD and a pause that arrive together leave the "
        "request queued. A client cannot tell the cases apart.",
        "",
        "Variants whose `wait` drains every request queued on the rank when the pause arrives ("
        + ", ".join(f"`{n}`" for n in drains)
        + ", weightsync's patch 0005): the pause row `pause_drains_queued` fires `admit_waiting`, and the "
        "rank counts them unfinished until they finish. Requests added after the pause stay queued. In "
        "`vllm-0.32-epoch` the row is `pause_drains_queued_entering_paused_new`, as the patch's "
        "`Scheduler.set_pause_state` runs it: the queue is taken when the scheduler enters PAUSED_NEW from "
        "UNPAUSED, or from keep's PAUSED_ALL when a wait follows a keep still in flight, and not when an "
        "abort or wait pause is in flight already. "
        "Property `wait_drains` judges it; under per-socket channels an ADD still in flight when the pause "
        "arrives counts as after it, as it is in vLLM between two API servers.",
        "",
    ]
    for v in VARIANTS.values():
        parts += [
            f"## Variant `{v.name}`",
            "",
            f"{v.description}. Source: {v.source}. Expected verdict: {v.expected}. Digest `{v.digest()[:16]}`.",
            "",
            "```mermaid",
            rank_fsm_mermaid(v).rstrip(),
            "```",
            "",
            _table_markdown(v),
            "",
        ]
    return "\n".join(parts)


def _coordinator_markdown() -> list[str]:
    """The DP coordinator's tables (``weightsync/spec/coordinator.py``), one per flag combination the
    variants use, naming the variants."""
    parts = [
        "## DP coordinator",
        "",
        "vLLM's `DPCoordinatorProc`: its state is `engines_running` (idle / running), its variable "
        "`current_wave`; START_DP_WAVE broadcasts carry `current_wave` after the row (`start_dp_wave_all`: "
        "every engine; `_but_target` / `_but_sender`: excluding FIRST_REQ's target or start_wave's sender). "
        "Run by the model and by the reference coordinator process (`weightsync/spec/coordinator.py`).",
        "",
    ]
    combos: dict[tuple[bool, bool], list[str]] = {}
    for v in VARIANTS.values():
        combos.setdefault((v.coordinator_latches, v.first_req_exclusion), []).append(v.name)
    for (latches, excludes), names in sorted(combos.items()):
        parts += [
            f"### latches={latches}, excludes={excludes} ({', '.join(f'`{n}`' for n in names)})",
            "",
            f"Digest `{coordinator_digest(latches, excludes)[:16]}`.",
            "",
            _rows_markdown(coordinator_table(latches, excludes)),
            "",
        ]
    return parts


def generated_spec_files() -> dict[str, str]:
    """Relative path under ``spec/`` -> content, for every generated file."""
    files = {"PROTOCOL.md": protocol_markdown()}
    for v in VARIANTS.values():
        files[f"rank-fsm-{v.name}.dot"] = rank_fsm_dot(v)
        files[f"rank-fsm-{v.name}.mmd"] = rank_fsm_mermaid(v)
    return files


def _drains_queued(v: Variant) -> bool:
    """Whether ``v``'s table has a pause row that drains queued requests (effect ``admit_waiting``)."""
    return any("admit_waiting" in tr.effects for trs in v.table.values() for tr in trs)


def write_spec_dir(root: Path) -> list[Path]:
    """Write every generated file under ``root`` (the repository's ``spec/``); returns the paths written."""
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, text in generated_spec_files().items():
        p = root / rel
        p.write_text(text)
        written.append(p)
    return written


def stale_spec_files(root: Path) -> list[str]:
    """Generated files under ``root`` that are missing or differ from what the tables generate now."""
    return [
        rel
        for rel, text in generated_spec_files().items()
        if not (root / rel).is_file() or (root / rel).read_text() != text
    ]
