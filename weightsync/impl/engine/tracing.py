"""The system trace: one JSONL file that every process of a reference DP cluster appends to.

``weightsync replay`` walks the model's successor function over it
(:mod:`weightsync.model.trace_walk`), so the trace records what each process *observed and did*, not only
the transitions its table fired:

- ``recv``: an engine rank dequeued a message (its socket: ``front``, ``control`` or ``wave``), written at
  the socket, before the rank hands it to its table;
- ``transition``: a rank fired its table (:func:`weightsync.impl.engine.records.trace_line`, plus ``group``
  and ``depth``);
- ``send``: a rank put a message on its coordinator socket (written before the put);
- ``settle``: a rank's step ended (its effects ran, or it is about to block in a collective): the
  scheduler's observable counts (``waiting``, ``running``), the requests it finished / aborted in this step
  (``finished``, ``aborted``: request ids) and the collective it blocks in (``blocked``, "" if none);
- ``coord``: the coordinator handled one message (``source``: -1 the front-end, else the rank), with its
  variables before/after and the START_DP_WAVE broadcasts, written before any broadcast is sent;
- ``front``: the client's front-end fired its table (``send_request`` with the request id, target and
  stamped wave; ``stats`` with the coordinator's published stats);
- ``call``: the controller sent one protocol call (pause, resume, start/update/finish_weight_update,
  init_weight_transfer_engine) to every rank (written before the sends);
- ``fault``: (broken engines of ``weightsync replay --self-test`` only) where an injected fault acted.
  The walker never reads these; the self-test compares them with the walker's verdict.

Every record has ``proc`` (``rank<i>``, ``coord``, ``front``, ``ctrl``) and ``t`` (seconds since the epoch).
A rank's records of one model step share its ``group`` number. Records are written with one ``write(2)``
on a file opened ``O_APPEND``, so lines never interleave; a record that starts a step is written before
the step sends anything, so a message's send always precedes its receipt in file order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

#: First line of a system trace: ``{"kind": "header", "schema": SCHEMA, ...}``.
SCHEMA = "weightsync-system-trace/1"


def jsonable(v: Any) -> Any:
    """``v`` with enums as their values, tuples as lists and unknown objects as their repr (JSON-able)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return repr(v)


class TraceWriter:
    """Appends records of one process (``proc``) to a system trace file.

    Args:
        path: the trace file (created if missing, appended to).
        proc: this process's name in the trace.
    """

    def __init__(self, path: str, proc: str) -> None:
        self.proc = proc
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record ``{"kind": kind, "proc": ..., "t": ..., **fields}`` (one ``write(2)``)."""
        if self._fd is None:
            return
        rec = {"kind": kind, "proc": self.proc, "t": time.time(), **jsonable(fields)}
        os.write(self._fd, (json.dumps(rec, sort_keys=True) + "\n").encode())

    def close(self) -> None:
        """Stop writing (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_trace(path: str | None, proc: str) -> TraceWriter | None:
    """A :class:`TraceWriter` for ``proc`` when ``path`` is set, else None."""
    return TraceWriter(path, proc) if path else None


def message_dict(msg: Any) -> dict[str, Any]:
    """A message (``AddMsg``, ``AbortMsg``, ``StartDPWave``, ``UtilityCall``, ``StartWave``,
    ``WaveComplete``, ``FirstReq``) as a trace dict: ``{"type": class name, ...its fields}``; an
    ``AddMsg`` carries its request id only, a ``UtilityCall`` its method and the protocol arguments
    (``mode``, ``clear_cache``, ``weight_version``; payload dicts are left out)."""
    name = type(msg).__name__
    if name == "AddMsg":
        return {"type": name, "req": msg.request.req_id, "wave": msg.wave}
    if name == "AbortMsg":
        return {"type": name, "req": msg.req_id}
    if name == "UtilityCall":
        kw = {k: msg.kwargs[k] for k in ("mode", "clear_cache", "weight_version") if k in msg.kwargs}
        return {"type": name, "method": msg.method, "kwargs": jsonable(kw)}
    fields = getattr(msg, "__dataclass_fields__", {})
    return {"type": name, **{k: jsonable(getattr(msg, k)) for k in fields}}


class StepTracer:
    """One rank's records in the system trace, grouped by model step (module docstring).

    A step begins with a received message (:meth:`begin` with ``received``), a loop step (the first
    :meth:`transition` of a closed step) or a collective's completion (``completion=True``: always
    traced), and ends with :meth:`settle`: the scheduler's counts, the requests the step finished or
    aborted (:meth:`outputs`) and the collective the rank now blocks in. A loop step that fires a
    transition with no effect and no variable change is an idle pass: nothing of it is written.

    Args:
        writer: the rank's trace writer (None: no trace; every method is then a no-op but the counting).
        counts: ``() -> (waiting, running)``, the scheduler's queue lengths.
    """

    def __init__(self, writer: TraceWriter | None, counts: Callable[[], tuple[int, int]]) -> None:
        self.writer = writer
        self.counts = counts
        self.group = -1
        self.open = False
        self.written = False
        self.finished: list[str] = []
        self.aborted: list[str] = []

    def begin(self, received: Any = None, socket: str = "", completion: bool = False) -> None:
        """Start the rank's next step; ``received``: the message dequeued from ``socket``."""
        self.group += 1
        self.open = True
        self.written = completion
        self.finished, self.aborted = [], []
        if self.writer is not None and received is not None:
            self.writer.write("recv", group=self.group, socket=socket, msg=message_dict(received))
            self.written = True

    def transition(self, line: dict[str, Any], idle: bool, depth: int) -> None:
        """A transition the rank fired (``line``: its per-rank trace record); ``idle``: it has no effect
        and changes no variable."""
        if self.writer is None:
            return
        if not self.open:
            self.begin()
        if not idle or self.written:
            self.writer.write(**line, group=self.group, depth=depth)
            self.written = True

    def outputs(self, finished: Sequence[str], aborted: Sequence[str]) -> None:
        """Requests this step finished / aborted (request ids)."""
        self.finished.extend(finished)
        self.aborted.extend(aborted)

    def send(self, msg: Any, socket: str = "to_coord") -> None:
        """A message this step puts on ``socket`` (recorded before the put)."""
        if self.writer is not None:
            self.writer.write("send", group=self.group, socket=socket, msg=message_dict(msg))

    def settle(self, blocked: str = "") -> None:
        """End the current step; ``blocked``: the collective the rank now blocks in ("" if none)."""
        if self.writer is not None and self.open and self.written:
            waiting, running = self.counts()
            self.writer.write(
                "settle",
                group=self.group,
                waiting=waiting,
                running=running,
                finished=self.finished,
                aborted=self.aborted,
                blocked=blocked,
            )
        self.open = False

    def fault(self, what: str) -> None:
        """A ``fault`` record (broken engines of ``weightsync replay --self-test`` only; the walker never
        reads them) for the step the fault acts in: the one under way, else the next one."""
        if self.writer is not None:
            self.writer.write("fault", group=self.group if self.open else self.group + 1, what=what)


__all__ = ["SCHEMA", "StepTracer", "TraceWriter", "jsonable", "message_dict", "open_trace"]
