"""The checked adapter over ``vllm serve``'s HTTP routes (:func:`weightsync.vllm_tools.checked.checked_http`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from weightsync.spec.states import RankEvent
from weightsync.vllm_tools.checked.adapter import CALL_OF_EVENT, DEFAULT_TIMEOUT_S, VLLMAdapter

#: The JSON field that carries each weight call's payload (``entrypoints/rl/online/api_router.py``; the
#: route is the spec's call name of the event; None: no body)
BODY_FIELD: dict[RankEvent, str | None] = {
    RankEvent.INIT_TRANSFER: "init_info",
    RankEvent.START_UPDATE: None,
    RankEvent.UPDATE_WEIGHTS: "update_info",
    RankEvent.FINISH_UPDATE: "weight_version",
}


class VLLMCallError(RuntimeError):
    """``vllm serve`` answered a call with an error status (an ``AsyncLLM`` raises vLLM's own exception).

    Attributes:
        method: the vLLM call.
        detail: vLLM's error text.
    """

    def __init__(self, method: str, detail: str) -> None:
        self.method = method
        self.detail = detail
        super().__init__(f"vLLM {method} failed: {detail}")


class HTTPServerAdapter(VLLMAdapter):
    """:class:`VLLMAdapter` over the HTTP routes of ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``
    (``entrypoints/rl/online/api_router.py``): ``POST /pause?mode=&clear_cache=``, ``POST /resume``,
    ``GET /is_paused``, ``POST /init_weight_transfer_engine {"init_info"}``, ``POST /start_weight_update``,
    ``POST /update_weights {"update_info"}``, ``POST /finish_weight_update {"weight_version"}``,
    ``POST /update_weight_version {"new_version"}``, ``GET /weight_info``; ``GET /get_world_size`` with and without DP gives ``dp_size``.

    The server reports no request counts per engine, so every record's counts are -1 (unknown) and the
    outcome arguments are inferred from the returned calls alone (a returned pause: nothing schedulable).
    No route says whether the model is MoE: with DP > 1 the engines are taken as one DP world (lockstep)
    unless ``kw`` passes ``lockstep=False`` (a dense model, :func:`~weightsync.spec.rank.rank_machines`).

    Raises:
        ValueError: the server is paused (rule 4).
        VLLMCallError: a route answered with an error status.
    """

    def __init__(self, base_url: str, **kw: Any) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(kw.get("timeout_s", DEFAULT_TIMEOUT_S))
        with_dp = int(
            self._request("GET", "/get_world_size?include_dp=true", None, self.timeout_s)["world_size"]
        )
        without = int(
            self._request("GET", "/get_world_size?include_dp=false", None, self.timeout_s)["world_size"]
        )
        if self._is_paused(self.timeout_s):
            raise ValueError(
                "HTTPServerAdapter attaches to a serving engine; this one is paused (POST /resume)"
            )
        super().__init__(max(1, with_dp // max(1, without)), self.get_weight_version(), **kw)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise VLLMCallError(
                path.split("?")[0].lstrip("/"), f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            if "timed out" in str(exc):
                raise TimeoutError(f"{method} {path}: {exc}") from exc
            raise
        return json.loads(raw) if raw else None

    def _vllm_pause(self, mode: str, clear_cache: bool, timeout: float) -> tuple[list[int], list[int]]:
        q = urllib.parse.urlencode({"mode": mode, "clear_cache": str(bool(clear_cache)).lower()})
        self._request("POST", f"/pause?{q}", None, timeout)
        return [-1] * self.dp_size, [-1] * self.dp_size

    def _vllm_resume(self, timeout: float) -> None:
        self._request("POST", "/resume", None, timeout)

    def _unfinished(self, timeout: float) -> list[int]:
        return [-1] * self.dp_size

    def _is_paused(self, timeout: float) -> bool:
        return bool(self._request("GET", "/is_paused", None, timeout)["is_paused"])

    def get_weight_version(self) -> str:
        return str(self._request("GET", "/weight_info", None, self.timeout_s)["weight_version"])

    def _vllm_relabel(self, new_version: str, timeout: float) -> None:
        self._request("POST", "/update_weight_version", {"new_version": new_version}, timeout)

    def _vllm_call(self, event: RankEvent, payload: Any, timeout: float) -> None:
        field = BODY_FIELD[event]
        body = None if field is None else {field: payload}
        self._request("POST", f"/{CALL_OF_EVENT[event]}", body, timeout)


__all__ = ["BODY_FIELD", "HTTPServerAdapter", "VLLMCallError"]
