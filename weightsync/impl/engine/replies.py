"""The engine core's replies to controller calls (a mixin of :class:`~weightsync.impl.engine.core.EngineCore`):
the effects that answer a call (``reply``, ``reply_pause``, ``reply_resume``, ``refuse``,
``reply_failure``), the pause replies a later transition gives (spec ``DEFERRED_REPLY``), and the halt on an
engine failure, which answers every pending call with the failure (spec :data:`~weightsync.spec.refusal.HALTED`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.impl.engine.config import EngineQueues
from weightsync.impl.engine.messages import EngineFailure, UtilityCall, UtilityReply
from weightsync.spec.errors import LocalProtocolError, PeerFailedError
from weightsync.spec.rank import RankMachine
from weightsync.spec.refusal import refusal_text
from weightsync.spec.table import Fired

if TYPE_CHECKING:
    from weightsync.impl.engine.dp import DPGroup


class CallReplies:
    """Replies to controller calls, and the halt (an ``EngineFailure``) of one engine rank."""

    rank: int
    q: EngineQueues
    machine: RankMachine
    dp: DPGroup
    failure: EngineFailure | None
    _round_error: BaseException | None
    _ctx_call: UtilityCall | None
    _pending_calls: dict[int, UtilityCall]
    _deferred: dict[str, list[UtilityCall]]

    def _reply_error(self, call: UtilityCall | None, exc: BaseException) -> None:
        if call is None:
            return
        self._pending_calls.pop(call.call_id, None)
        self._forget_deferred(call)
        self.q.out.put(
            UtilityReply(self.rank, call.call_id, None, f"{type(exc).__name__}: {exc}", type(exc).__name__)
        )

    def _reply_failure(self, fired: Fired) -> None:
        err = self._round_error or PeerFailedError([self.rank], str(fired.after.state), "round failed")
        self._reply_error(self._ctx_call, err)

    def _refuse(self, fired: Fired) -> None:
        """The row refused the call (effect ``refuse``): the error names the state and event it was refused in
        and the row's reason (:func:`~weightsync.spec.refusal.refusal_text`)."""
        call = self._ctx_call
        err = self._round_error
        cause = "" if err is None else f"{type(err).__name__}: {err}"
        text = refusal_text(
            self.rank,
            call.method if call else fired.event.value,
            fired.before.state,
            fired.event,
            fired.transition.rule,
            cause,
        )
        self._reply_error(call, LocalProtocolError(text))

    def _reply_to(self, call: UtilityCall, result: Any = None) -> None:
        self._pending_calls.pop(call.call_id, None)
        self.q.out.put(UtilityReply(self.rank, call.call_id, result))

    def _forget_deferred(self, call: UtilityCall) -> None:
        for pending in self._deferred.values():
            if call in pending:
                pending.remove(call)

    def _reply_pause(self, fired: Fired) -> None:
        pending, self._deferred["reply_pause"] = self._deferred["reply_pause"], []
        for call in pending:
            self._reply_to(call)

    def _reply_resume(self, fired: Fired) -> None:
        assert self._ctx_call is not None
        self._reply_to(self._ctx_call)

    def _reply(self, fired: Fired) -> None:
        assert self._ctx_call is not None
        self._reply_to(self._ctx_call)

    def _current_kwargs(self) -> dict[str, Any]:
        return dict(self._ctx_call.kwargs) if self._ctx_call is not None else {}

    def _fail(self, exc: BaseException, phase: str) -> None:
        if self.failure is not None:
            return
        cur = self.dp.current
        kind, _, seq = cur.partition("#")
        try:
            peers = self.dp.board()
        except Exception:
            peers = {}
        missing = tuple(getattr(exc, "missing_ranks", ()))
        self.failure = EngineFailure(
            self.rank,
            getattr(exc, "phase", phase),
            f"{type(exc).__name__}: {exc}",
            type(exc).__name__,
            kind if kind != "idle" else "",
            int(seq) if seq.isdigit() else -1,
            missing,
            peers,
            self.machine.state.value,
        )
        self.q.out.put(self.failure)
        for call in list(self._pending_calls.values()):
            self.q.out.put(
                UtilityReply(self.rank, call.call_id, None, self.failure.error, self.failure.error_type)
            )
        self._pending_calls.clear()
        for pending in self._deferred.values():
            pending.clear()


__all__ = ["CallReplies"]
