"""The RPC fan-out of the reference client: utility calls to one rank or every rank, with deadlines that
name the missing ranks; the protocol calls (pause, resume, the weight-transfer calls of vLLM 0.32) and the
queries."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from weightsync.impl.engine.core import EngineCore
from weightsync.impl.engine.front_end import FrontEnd
from weightsync.impl.engine.messages import (
    UtilityCall,
)
from weightsync.spec.calls import front_end_answers
from weightsync.spec.errors import (
    TransferTimeoutError,
    WeightSyncError,
)
from weightsync.spec.rank import version_order
from weightsync.spec.states import PauseMode


class WeightVersionMismatchError(WeightSyncError, RuntimeError):
    """``get_weight_version()``: the ranks report different versions (vLLM's consensus raises
    ``RuntimeError``, ``v1/engine/core_client.py:1271-1277``; this is one too).

    Attributes:
        versions: each rank's version, in rank order.
    """

    def __init__(self, versions: list[str]) -> None:
        self.versions = list(versions)
        shown = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(self.versions))
        super().__init__(
            f"get_weight_version: the engines report different weight versions ({shown}); there is no "
            "consensus (get_weight_versions() lists them)"
        )


def _check_version(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise ValueError(
            f"{what} must be a str (vLLM 0.32's string weight versions), got {type(value).__name__} {value!r}"
        )


class RPCFanOut(FrontEnd):
    """The utility-call path of :class:`~weightsync.impl.engine.client.DPEngineClient`."""

    # ------------------------------------------------------------------ utility calls
    def call_rank(self, rank: int, method: str, **kwargs: Any) -> Future[Any]:
        """Send one utility call to ``rank``; the future resolves with its reply (or the remote error)."""
        cid = next(self._ids)
        fut: Future[Any] = Future()
        with self._lock:
            self._futures[cid] = (rank, method, fut)
        self._send(rank, "control", UtilityCall(cid, method, dict(kwargs)))
        return fut

    def gather(self, method: str, futs: list[Future[Any]], timeout: float) -> list[Any]:
        """Wait for one future per rank; returns their results in rank order.

        Raises:
            TransferTimeoutError: some ranks did not answer within ``timeout`` seconds (named).
            The first remote error otherwise (LocalProtocolError, TransferTimeoutError, ...).
        """
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(futs)
        missing: list[int] = []
        errors: list[BaseException] = []
        for r, f in enumerate(futs):
            try:
                results[r] = f.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                missing.append(r)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        if missing:
            fails = "; ".join(
                f"rank {r} failed in {f.phase}: {f.error}" for r, f in sorted(self.failures.items())
            )
            raise TransferTimeoutError(method, missing, timeout, fails or "no reply")
        return results

    def fan_out(self, method: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Send ``method`` to every rank and wait for all replies (see :meth:`gather`)."""
        t = timeout if timeout is not None else 4 * self.cfg.collective_timeout_s
        if (
            self._trace_ctrl is not None and method in EngineCore.CALL_EVENTS
        ):  # a protocol call, before the sends
            kw = {k: kwargs[k] for k in ("mode", "clear_cache", "weight_version") if k in kwargs}
            self._trace_ctrl.write("call", method=method, kwargs=kw)
        futs = [self.call_rank(r, method, **kwargs) for r in range(self.dp_size)]
        return self.gather(method, futs, t)

    def pause(
        self, mode: str | PauseMode = "abort", clear_cache: bool = True, timeout: float | None = None
    ) -> None:
        """``pause_generation(mode, clear_cache)`` on every rank; returns when every rank's pause completed.
        The front-end pause gate (front-end-pause) closes when a rank's row names ``front_end_gate``
        (the launcher's ``_on_engine_msg``), before that rank's reply."""
        m = PauseMode(mode)
        self._call_all("pause", timeout, mode=m.value, clear_cache=clear_cache)

    def resume(self, timeout: float | None = None) -> None:
        """``resume_generation`` on every rank (the resume barrier); returns when all answered."""
        self._call_all("resume", timeout)

    def _call_all(self, method: str, timeout: float | None, **kwargs: Any) -> None:
        if self.hold and front_end_answers(self.variant.pause_in_front_end, method):
            # repro: the schedule releases these calls one by one; the front-end answers at once
            for r in range(self.dp_size):
                self.call_rank(r, method, **kwargs)
            return
        self.fan_out(method, timeout, **kwargs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """Every rank joins the weight-transfer group (concurrently with the trainer's init); ``init_info``
        is vLLM 0.32's (:class:`~weightsync.impl.transfer.base.InitInfo`: packing fields included)."""
        self.fan_out("init_weight_transfer_engine", timeout, init_info=init_info)

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        """Open an update round on every rank (legal only once every rank is verified), in ``init_info``'s
        format (vLLM 0.32's ``start_weight_update()`` takes no argument)."""
        self.fan_out("start_weight_update", timeout)

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """Every rank receives the weights described by ``update_info`` (concurrently with the trainer): a
        dict, or a list indexed by global worker rank (vLLM's ``v1/worker/gpu_worker.py:1570-1578``)."""
        self.fan_out("update_weights", timeout, update_info=update_info)

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        """Close the round on every rank. ``weight_version`` becomes each rank's version only if its finish
        succeeded; None leaves the version (vLLM 0.32, ``v1/engine/async_llm.py:1351-1355``). ``monotonic``
        (weightsync) refuses a version older than the served one, by the trailing step number
        (:func:`~weightsync.spec.rank.version_order`): the rank then fails the round.

        Raises:
            ValueError: before anything is sent: ``weight_version`` not a str or None; with ``monotonic``, a
                version (this one or a rank's current one) that has no trailing step number.
            The ranks' errors (IncompleteUpdateError, LocalProtocolError for a refused version, ...).
        """
        if weight_version is not None:
            _check_version(weight_version, "finish_weight_update: weight_version")
        if monotonic and weight_version is not None:
            version_order(weight_version)
            for r, v in enumerate(self.get_weight_versions()):
                try:
                    version_order(v)
                except ValueError as exc:
                    raise ValueError(
                        f"finish_weight_update(monotonic=True): rank {r}'s version: {exc}"
                    ) from None
        self.fan_out("finish_weight_update", timeout, weight_version=weight_version, monotonic=monotonic)

    def update_weight_version(self, new_version: str, *, timeout: float | None = None) -> None:
        """Set every rank's version label without updating weights (vLLM 0.32 ``update_weight_version``,
        ``v1/engine/async_llm.py:1357-1359``): legal in any state, no transition
        (:func:`~weightsync.spec.rank.relabel_weight_version`); each rank reports and traces it.

        Raises:
            ValueError: ``new_version`` is not a str (before anything is sent).
        """
        _check_version(new_version, "update_weight_version: new_version")
        self.fan_out("update_weight_version", timeout, new_version=new_version)

    def get_weight_versions(self) -> list[str]:
        """Each rank's weight version, in rank order."""
        return [str(v) for v in self.fan_out("get_weight_version", 10.0)]

    def get_weight_version(self) -> str:
        """The engines' weight version: vLLM 0.32's consensus (``call_utility_consensus_async``,
        ``v1/engine/core_client.py:1271-1277``).

        Raises:
            WeightVersionMismatchError: the ranks report different versions (naming each).
        """
        versions = self.get_weight_versions()
        if any(v != versions[0] for v in versions):
            raise WeightVersionMismatchError(versions)
        return versions[0]

    def trace_to(self, path: str | None) -> None:
        """Every rank appends one JSONL line per transition to ``path`` itself (O_APPEND, written before the
        transition's effects), so file order is a linearization; None stops tracing."""
        self.fan_out("set_trace", 10.0, path=path)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each rank's ``{"vars": RankVars dict, "rank_seq": transitions fired so far}``, in rank order."""
        return list(self.fan_out("snapshot", 10.0))

    def get_state(self) -> list[dict[str, Any]]:
        """Each rank's protocol variables (RankVars as dicts), in rank order."""
        return list(self.fan_out("get_state", 10.0))

    def reference_generate(
        self, rank: int, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[list[int], list[float]]:
        """A fresh single-request run on ``rank``'s current weights (no batching, fresh KV)."""
        toks, lps = self.call_rank(
            rank,
            "reference_generate",
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        ).result(30.0)
        return list(toks), list(lps)
