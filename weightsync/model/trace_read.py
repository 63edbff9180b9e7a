"""Read a system trace (:mod:`weightsync.impl.engine.tracing`) into the steps the walker
(:mod:`weightsync.model.trace_walk`) takes: its header, each process's steps in order of their first
record, its ``fault`` records, and the model configuration the trace is walked under."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.model.system import Bounds, Config
from weightsync.spec.calls import PHASE_CALL, Phase
from weightsync.spec.states import PauseMode

#: The system-trace schema this walker reads (``weightsync.impl.engine.tracing.SCHEMA``).
SCHEMA = "weightsync-system-trace/1"


class TraceFormatError(ValueError):
    """The file is no system trace of this schema (named with the line)."""


@dataclass
class EngineStep:
    """The records of one step of one process, as the walker consumes them.

    Attributes:
        proc: ``rank<i>``, ``coord``, ``front`` or ``ctrl``.
        line: 1-based line of its first record.
        records: its records in file order (``fault`` records excluded).
        group: the rank's group number (ranks only).
    """

    proc: str
    line: int
    records: list[dict[str, Any]]
    group: int = -1

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Its records of ``kind``."""
        return [r for r in self.records if r["kind"] == kind]


def read_trace(lines: Iterable[str]) -> tuple[dict[str, Any], list[EngineStep], list[dict[str, Any]]]:
    """Parse a system trace: its header, its steps in order of their first record, and its ``fault``
    records (each with its ``line``).

    Raises:
        TraceFormatError: no header of :data:`SCHEMA`, a line that is no JSON object, or a record without
            ``kind`` / ``proc``.
    """
    header: dict[str, Any] | None = None
    steps: list[EngineStep] = []
    faults: list[dict[str, Any]] = []
    open_groups: dict[tuple[str, int], EngineStep] = {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"line {n}: not JSON ({exc})") from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise TraceFormatError(f"line {n}: expected a JSON object with 'kind'")
        if header is None:
            if rec.get("kind") != "header" or rec.get("schema") != SCHEMA:
                raise TraceFormatError(f"line {n}: expected the header of {SCHEMA}, got {text.strip()[:120]}")
            header = rec
            continue
        proc = rec.get("proc")
        if not isinstance(proc, str):
            raise TraceFormatError(f"line {n}: record without 'proc'")
        rec["line"] = n
        if rec["kind"] == "fault":
            faults.append(rec)
            continue
        if proc.startswith("rank"):
            key = (proc, int(rec["group"]))
            st = open_groups.get(key)
            if st is None:
                st = open_groups[key] = EngineStep(proc, n, [], int(rec["group"]))
                steps.append(st)
            st.records.append(rec)
        else:
            steps.append(EngineStep(proc, n, [rec]))
    if header is None:
        raise TraceFormatError("empty file: no system-trace header")
    return header, steps, faults


def config_of(header: Mapping[str, Any], steps: Sequence[EngineStep]) -> Config:
    """The model configuration a trace is walked under: the header's variant, ranks, pause mode, sync
    interval, tokens and clear_cache, with bounds on requests and cycles that the trace's own traffic
    reaches (its requests sent and its pause calls)."""
    requests = sum(1 for s in steps if s.proc == "front" and s.records[0].get("event") == "send_request")
    cycles = sum(
        1 for s in steps if s.proc == "ctrl" and s.records[0].get("method") == PHASE_CALL[Phase.PAUSE]
    )
    bounds = Bounds(
        requests=requests,
        cycles=cycles,
        sync_interval=int(header["sync_interval"]),
        tokens=int(header["tokens"]),
        clear_cache=bool(header.get("clear_cache", True)),
        init_transfer=bool(header.get("init_transfer", False)),
    )
    return Config(
        str(header["variant"]), int(header["dp_size"]), PauseMode(header["mode"]), "per-socket", bounds
    )


__all__ = ["SCHEMA", "EngineStep", "TraceFormatError", "config_of", "read_trace"]
