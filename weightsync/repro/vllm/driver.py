"""The vLLM repro's holding points: the driver that holds and releases the front-end's messages to each rank
(``AsyncMPClient._send_input_message``, the FIRST_REQ of ``DPAsyncMPClient.add_request_async``), and the
observer that reads the probe's records from vLLM's engine processes, and the helpers that read those
records (where a rank ended, one line per record)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from weightsync.repro.schedule import (
    HELD_KINDS,
)
from weightsync.vllm_tools.serving import LoopThread

T = TypeVar("T")


#: probe records that are no model step of their own (an effect of one, or the driver's own utility)
_UNSTEPPED = frozenset({"wave_complete", "start_wave", "pause_done", "released", "rpc"})


class _Driver:
    """An ``AsyncLLM`` on its own event-loop thread, with the driver-side holds installed."""

    def __init__(self, llm: Any, loop: LoopThread) -> None:
        self.llm = llm
        self.lt = loop
        self.client = llm.engine_core
        self.held: dict[tuple[int, str], deque[tuple[Any, Any]]] = {}
        self.log: list[str] = []
        self.holding = True
        send = self.client._send_input_message
        self._send = send
        import msgspec

        def held_send(message: tuple[Any, ...], engine: Any) -> Any:
            kind = _kind(message, msgspec)
            rank = int.from_bytes(bytes(engine), "little")
            if not self.holding or kind not in HELD_KINDS:
                return send(message, engine)
            self.held.setdefault((rank, kind), deque()).append((message, engine))
            self.log.append(f"held {kind} for rank {rank}")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

        self.client._send_input_message = held_send
        sock = self.client.first_req_send_socket
        self.first_req: deque[Any] = deque()
        driver = self

        class HeldSocket:
            async def send(self, msg: Any, *a: Any, **kw: Any) -> Any:
                if not driver.holding:
                    return await sock.send(msg, *a, **kw)
                driver.first_req.append((msg, a, kw))
                driver.log.append("held FIRST_REQ")
                return None

            def __getattr__(self, name: str) -> Any:
                return getattr(sock, name)

        self._sock = sock
        self.client.first_req_send_socket = HeldSocket()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.lt.run(coro, timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.lt.spawn(coro)

    def count(self, rank: int, kind: str) -> int:
        return len(self.held.get((rank, kind), ()))

    def release(self, rank: int, kind: str) -> None:
        q = self.held.get((rank, kind))
        if not q:
            raise RuntimeError(f"no held {kind} for rank {rank}")
        message, engine = q.popleft()

        async def go() -> None:
            await self._send(message, engine)

        self.run(go(), 30)

    def release_first_req(self) -> None:
        msg, a, kw = self.first_req.popleft()

        async def go() -> None:
            await self._sock.send(msg, *a, **kw)

        self.run(go(), 30)

    def utility(self, rank: int, method: str, timeout: float = 30) -> Any:
        engine = rank.to_bytes(2, "little")
        return self.run(self.client._call_utility_async(method, engine=engine), timeout)

    def release_everything(self) -> None:
        """Stop holding and send every held message, FIRST_REQs first, in the order held."""
        self.holding = False
        while self.first_req:
            self.release_first_req()
        for (rank, kind), q in list(self.held.items()):
            while q:
                self.release(rank, kind)


def _kind(message: tuple[Any, ...], msgspec: Any) -> str:
    """ADD / ABORT / the utility's method name for a client->engine message (``core_client.py:1250``)."""
    head = bytes(message[0])
    if head == b"\x00":
        return "ADD"
    if head == b"\x01":
        return "ABORT"
    if head == b"\x03":
        try:
            return str(msgspec.msgpack.decode(bytes(message[1]))[2])
        except Exception:
            return "OTHER"
    return "OTHER"


class _Observer:
    """Matches the probe's engine records against the schedule's expectations, per rank, in order."""

    def __init__(self, directory: Path, n: int) -> None:
        self.dir = directory
        self.n = n
        self.pos = [0] * n

    def records(self) -> dict[int, list[dict[str, Any]]]:
        from weightsync.vllm_tools.probe import read_events

        return read_events(self.dir)

    def wait(self, rank: int, ev: str, fields: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The next record ``ev`` of ``rank`` (skipping records that no model step names), or None."""
        deadline = time.monotonic() + timeout
        while True:
            recs = self.records().get(rank, [])
            k = self.pos[rank]
            while k < len(recs):
                rec = recs[k]
                k += 1
                if rec["ev"] in _UNSTEPPED:
                    continue
                if rec["ev"] == ev and all(rec.get(f) == x for f, x in fields.items()):
                    self.pos[rank] = k
                    return rec
                self.pos[rank] = k - 1
                return {"unexpected": rec}
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _state(fut: Any) -> str:
    if not fut.done():
        return "running"
    exc = fut.exception()
    return f"{type(exc).__name__}: {exc}" if exc else "returned"


def _brief(rec: dict[str, Any]) -> str:
    return str({k: v for k, v in rec.items() if k not in ("t", "rank", "ev", "vllm")})


def _until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _blocked(recs: list[dict[str, Any]]) -> tuple[str, dict[str, Any] | None]:
    """What a rank was blocked in at the end of its log, and the error that ended it (if any)."""
    last_step: dict[str, Any] | None = None
    for rec in recs:
        if rec["ev"] == "step":
            last_step = rec
        elif rec["ev"] == "step_done":
            last_step = None
        elif rec["ev"] == "step_error" and last_step is not None:
            return ("dp_sync" if last_step.get("sync") else "dp_step"), rec
    if last_step is not None:
        return ("dp_sync" if last_step.get("sync") else "dp_step"), None
    return "", None


def _idle(recs: list[dict[str, Any]]) -> bool:
    """The rank's last step ended its wave (its sync found no work anywhere) and no collective failed."""
    if any(r["ev"] == "step_error" for r in recs):
        return False
    steps = [r for r in recs if r["ev"] in ("step", "step_done")]
    return bool(steps) and steps[-1]["ev"] == "step_done" and not steps[-1]["result"]


def _line(rec: dict[str, Any]) -> str:
    v = rec.get("vllm", {})
    extra = _brief(rec)
    return (
        f"{rec['ev']} {extra} -> running={v.get('engines_running')} wave={v.get('current_wave')} "
        f"pending={v.get('pending_pause')} ignore={v.get('ignore_start_dp_wave')} pause={v.get('pause_state')}"
    )


__all__ = ["T"]


def record_end(served: Any, events: Path, res: Any) -> dict[str, int]:
    """Fill ``res``'s ``requests_finished`` (tokens per request, -1 unfinished), ``ranks`` (the collective
    each rank's log ends in) and ``events`` (each rank's last 8 records) from ``served``'s outputs and the
    probe's logs in ``events``; returns ``requests_finished``."""
    from weightsync.vllm_tools.probe import read_events

    fin = {
        rid: len(outs[-1].outputs[0].token_ids) if outs and outs[-1].finished else -1
        for rid, outs in served.outputs.items()
    }
    res.requests_finished = fin
    recs = read_events(events)
    res.ranks = {str(r): _blocked(rr)[0] for r, rr in recs.items()}
    res.events = {str(r): [_line(x) for x in rr[-8:]] for r, rr in recs.items()}
    return fin
