"""The API front-end of the reference client: requests through the spec front-end table
(:mod:`weightsync.spec.front_end`: ADD stamped with the believed wave, FIRST_REQ while the engines are
believed idle, the stats refresh, the front-end pause gate and its held requests)."""

from __future__ import annotations

import functools
import operator
from dataclasses import replace
from typing import Any

from weightsync.impl.engine.launcher import COORD, Launcher, RequestStream
from weightsync.impl.engine.messages import (
    AbortMsg,
    AddMsg,
    FirstReq,
    Request,
    Stats,
    request_error,
)
from weightsync.impl.models.sampling import SamplingParams
from weightsync.spec.front_end import FrontEvent, Table, front_end_fire, front_end_table


@functools.cache
def _front_table(latches: bool) -> Table:
    """The front-end table for a variant's :attr:`~weightsync.spec.rank.Variant.front_end_latches`."""
    return front_end_table(latches)


class FrontEnd(Launcher):
    """The request path of :class:`~weightsync.impl.engine.client.DPEngineClient`."""

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: list[int] | tuple[int, ...],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        rank: int | None = None,
    ) -> RequestStream:
        """Send ADD(request, current_wave) to one engine; FIRST_REQ to the coordinator if idle (s5).

        Returns the request's :class:`RequestStream`.

        Raises:
            ValueError: before anything is sent, naming the value and the rule: a request breaking
                :func:`~weightsync.impl.engine.messages.request_error` for the cluster's model (an empty
                prompt, a token id outside ``[0, vocab_size)`` -- e.g. ``add_request: prompt token id 9999
                at position 3 is outside the vocabulary [0, 64)`` --, a non-int token, a prompt too long
                for ``max_position_embeddings``...), ``params`` not a :class:`SamplingParams`, a
                ``req_id`` already in flight, or a rank outside ``[0, dp_size)``.
        """
        assert self.cfg.model is not None
        if isinstance(prompt, str | bytes) or not hasattr(prompt, "__iter__"):
            raise ValueError(
                f"add_request: prompt must be a sequence of int token ids, got {type(prompt).__name__}"
            )
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ValueError(f"add_request: rank must be an int in [0, {self.dp_size}), got {rank!r}")
        if rank is not None and not 0 <= rank < self.dp_size:
            raise ValueError(f"add_request: rank {rank} outside [0, {self.dp_size})")
        rid = req_id if req_id is not None else f"req-{next(self._ids)}"
        raw = Request(rid, tuple(prompt), params or SamplingParams())
        why = request_error(raw, self.cfg.model.vocab_size, self.cfg.model.max_position_embeddings)
        if why is not None:
            raise ValueError(f"add_request: {why}")
        req = replace(raw, prompt=tuple(operator.index(t) for t in raw.prompt))
        with self._lock:
            prev = self.streams.get(rid)
            if prev is not None and not prev.done.is_set():
                raise ValueError(
                    f"add_request: req_id {rid!r} is already in flight on rank {prev.rank}; request ids must be "
                    "unique among unfinished requests"
                )
            r = next(self._rr) % self.dp_size if rank is None else rank
            stream = RequestStream(rid, r, req.prompt)
            self.streams[rid] = stream
            self._submit(r, req)
        return stream

    @property
    def current_wave(self) -> int:
        """The wave this front-end believes current (stamped on every ADD)."""
        return self.front.current_wave

    @property
    def engines_running(self) -> bool:
        """Whether this front-end believes the engines run (no FIRST_REQ then)."""
        return self.front.engines_running

    def _front_stats(self, st: Stats) -> None:
        """The coordinator's stats through the front-end table (caller holds the lock)."""
        before = self.front
        _, self.front = front_end_fire(
            self.front,
            FrontEvent.STATS,
            {"wave": st.current_wave, "running": st.engines_running},
            _front_table(self.variant.front_end_latches),
        )
        if self._trace_front is not None:
            self._trace_front.write(
                "front",
                event=FrontEvent.STATS.value,
                wave=st.current_wave,
                running=st.engines_running,
                before=before._asdict(),
                after=self.front._asdict(),
            )

    def _submit(self, r: int, req: Any) -> None:
        """One request to rank ``r`` through the front-end table: ADD stamped with the believed wave, a
        FIRST_REQ while the engines are believed idle, or held while the front-end pause gate is closed
        (caller holds the lock)."""
        wave = self.front.current_wave
        before = self.front
        tr, self.front = front_end_fire(
            self.front, FrontEvent.SEND_REQUEST, {"target": r}, _front_table(self.variant.front_end_latches)
        )
        if self._trace_front is not None:  # before any send
            self._trace_front.write(
                "front",
                event=FrontEvent.SEND_REQUEST.value,
                target=r,
                req=req.req_id,
                wave=wave,
                effects=list(tr.effects),
                before=before._asdict(),
                after=self.front._asdict(),
            )
        for eff in tr.effects:
            if eff == "hold_request":
                self._held_adds.append((r, req))
            elif eff == "send_add":
                self._send(r, "front", AddMsg(req, wave))
            elif eff == "send_first_req":
                if self.hold and self.hold_coord:
                    self.held[(-1, COORD)].append(FirstReq(r, wave))
                else:
                    self._fe2coord.put(FirstReq(r, wave))
            else:
                raise AssertionError(f"front-end effect {eff!r} has no executor")

    def _front_gate(self, event: FrontEvent) -> None:
        """Close or open the front-end pause gate through the table; opening releases the held requests,
        in order, through :meth:`_submit` (caller holds the lock)."""
        tr, self.front = front_end_fire(self.front, event, {})
        if "release_held" in tr.effects:
            held, self._held_adds = self._held_adds, []
            for r, req in held:
                self._submit(r, req)

    def abort(self, req_id: str) -> None:
        """Send ABORT(req_id) to the engine serving it."""
        s = self.streams[req_id]
        self._send(s.rank, "front", AbortMsg(req_id))
