"""The demo's client adapter: the engine client, failing fast when an engine process dies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from weightsync.demo.config import EngineDiedError

__all__ = ["ClientGuard"]


class ClientGuard:
    """Pass-through of the engine client whose controller calls fail fast when an engine process dies.

    Each call runs in a helper thread; the caller polls the engines' liveness every 50 ms and raises
    :class:`EngineDiedError` (naming the rank) instead of waiting for the client's own reply deadline.
    Calls without a timeout get ``timeout``; ``init_weight_transfer_engine`` adds ``init_extra`` (the demo
    keys) to the trainer's ``init_info``.
    """

    def __init__(self, client: Any, timeout: float | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self.init_extra: dict[str, Any] = {}
        self.on_pause_done: Callable[[], None] | None = None

    def dead(self) -> dict[int, int | None]:
        """DP rank -> exit code of every engine process that is no longer alive."""
        out: dict[int, int | None] = {}
        for r, p in enumerate(self.client.procs[1 : 1 + self.client.dp_size]):
            if not p.is_alive():
                out[r] = p.exitcode
        return out

    def pids(self) -> dict[int, int]:
        return {r: int(p.pid or -1) for r, p in enumerate(self.client.procs[1 : 1 + self.client.dp_size])}

    def raise_if_dead(self, phase: str) -> None:
        """Raise :class:`EngineDiedError` if an engine process exited."""
        d = self.dead()
        if d:
            raise EngineDiedError(sorted(d), phase, d, self.pids())

    def _watch(self, phase: str, fn: Callable[[], Any]) -> Any:
        box: list[Any] = []
        err: list[BaseException] = []

        def run() -> None:
            try:
                box.append(fn())
            except BaseException as exc:
                err.append(exc)

        th = threading.Thread(target=run, name=f"weightsync-demo-{phase}", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.05)
            if th.is_alive():
                self.raise_if_dead(phase)
        if err:
            self.raise_if_dead(phase)  # a dead peer explains the error better than its symptom
            raise err[0]
        return box[0] if box else None

    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None) -> None:
        self._watch("pause", lambda: self.client.pause(mode, clear_cache, self._t(timeout)))
        if self.on_pause_done is not None:
            self.on_pause_done()

    def resume(self, timeout: float | None = None) -> None:
        self._watch("resume", lambda: self.client.resume(self._t(timeout)))

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        info = {**init_info, **self.init_extra}
        t = self._t(timeout)
        self._watch(
            "init_weight_transfer_engine", lambda: self.client.init_weight_transfer_engine(info, timeout=t)
        )

    def start_weight_update(self, *, timeout: float | None = None) -> None:
        t = self._t(timeout)
        self._watch("start_weight_update", lambda: self.client.start_weight_update(timeout=t))

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        t = self._t(timeout)
        self._watch("update_weights", lambda: self.client.update_weights(update_info, timeout=t))

    def finish_weight_update(
        self, weight_version: str | None = None, *, monotonic: bool = False, timeout: float | None = None
    ) -> None:
        t = self._t(timeout)
        self._watch(
            "finish_weight_update",
            lambda: self.client.finish_weight_update(weight_version, monotonic=monotonic, timeout=t),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
