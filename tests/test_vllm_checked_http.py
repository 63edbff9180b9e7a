"""``HTTPServerAdapter`` (CheckedEngine around ``vllm serve``'s dev-mode routes) against a stub server that
answers like ``entrypoints/rl/online/api_router.py`` and records every request: refused calls send no
request, a legal round sends vLLM's request shapes, an error status is a failed round, and the trace replays.
No vLLM needed (a real ``vllm serve`` run: ``test_vllm_checked.py`` covers the AsyncLLM path)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from weightsync.cli import main
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.vllm_tools.checked import VLLMCallError, checked_http


class Stub:
    """The routes' state: paused, version; ``requests`` as (method, path, query, body); ``fail``: a path
    answered with 500 once."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.paused = False
        self.version = "default"
        self.requests: list[tuple[str, str, dict[str, list[str]], Any]] = []
        self.fail: str | None = None

    def handle(self, method: str, url: str, body: Any) -> tuple[int, Any]:
        u = urlparse(url)
        q = parse_qs(u.query)
        self.requests.append((method, u.path, q, body))
        if self.fail == u.path:
            self.fail = None
            return 500, {"error": "scripted failure"}
        if u.path == "/get_world_size":
            return 200, {"world_size": self.dp if q.get("include_dp") == ["true"] else 1}
        if u.path == "/is_paused":
            return 200, {"is_paused": self.paused}
        if u.path == "/weight_info":
            return 200, {"weight_version": self.version}
        if u.path == "/pause":
            self.paused = True
            return 200, {"status": "paused"}
        if u.path == "/resume":
            self.paused = False
            return 200, {"status": "resumed"}
        if u.path == "/finish_weight_update":
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return 200, {"message": "Weight update finished"}
        if u.path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}
        if u.path in {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights"}:
            return 200, {"message": "ok"}
        return 404, {"detail": "Not Found"}

    def sent(self) -> list[str]:
        return [p for m, p, _, _ in self.requests if m == "POST"]


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    st = Stub(dp=2)

    class Handler(BaseHTTPRequestHandler):
        def _do(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            code, out = st.handle(method, self.path, body)
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._do("GET")

        def do_POST(self) -> None:
            self._do("POST")

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield st, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


INFO = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}


def test_http_round_shapes_refusals_and_replay(
    stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    st, url = stub
    trace = tmp_path / "http.jsonl"
    eng = checked_http(url, trace_path=trace, timeout_s=10)
    assert eng.dp_size == 2
    client = eng  # a CheckedEngine is a VLLMWeightSyncClient itself
    client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1, "world_size": 3})
    with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
        client.update_weights(INFO)
    assert st.sent() == ["/init_weight_transfer_engine"]
    eng.pause(mode="keep", clear_cache=False)
    client.start_weight_update()
    with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state updating"):
        client.start_weight_update()
    client.update_weights(INFO)
    client.finish_weight_update("step-1")
    eng.resume()
    assert st.sent() == [
        "/init_weight_transfer_engine",
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    posts = [(p, q, b) for m, p, q, b in st.requests if m == "POST"]
    assert posts[0][2] == {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 3}}
    assert posts[1][1] == {"mode": ["keep"], "clear_cache": ["false"]}
    assert posts[3][2] == {"update_info": INFO} and posts[4][2] == {"weight_version": "step-1"}
    assert eng.get_weight_version() == "step-1" and eng.violations == []
    assert main(["replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    assert out["ranks"] == 2 and out["outcomes_checked"] == 2  # counts unknown over HTTP: noted
    assert out["notes"] == ["trace has no scheduler counts: has-unfinished outcomes not checked"]


def test_http_error_status_is_a_failed_round(stub: tuple[Stub, str]) -> None:
    st, url = stub
    eng = checked_http(url, timeout_s=10)
    eng.pause(mode="abort")
    eng.start_weight_update()
    st.fail = "/update_weights"
    with pytest.raises(VLLMCallError, match="HTTP 500"):
        eng.update_weights(INFO)
    n = len(st.requests)
    with pytest.raises(LocalProtocolError, match="refused in state failed"):
        eng.resume()
    assert len(st.requests) == n  # refused locally
    eng.start_weight_update()
    eng.update_weights(INFO)
    eng.finish_weight_update(weight_version="step-1")
    eng.resume()
    assert st.version == "step-1" and not st.paused


def test_http_update_weight_version_is_a_relabel_that_replays(
    stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's ``POST /update_weight_version {"new_version"}`` (``api_router.py:214-220``): no transition, in
    any state; every rank's label moves, the trace gets one relabel line per rank and replays."""
    st, url = stub
    trace = tmp_path / "relabel.jsonl"
    eng = checked_http(url, trace_path=trace, timeout_s=10)
    eng.update_weight_version("while-serving")
    eng.pause(mode="keep")
    eng.update_weight_version("while-paused")
    eng.resume()
    posts = [(p, b) for m, p, _, b in st.requests if m == "POST"]
    assert posts[0] == ("/update_weight_version", {"new_version": "while-serving"})
    assert posts[2] == ("/update_weight_version", {"new_version": "while-paused"})
    assert st.version == "while-paused" == eng.get_weight_version() and eng.violations == []
    assert [m.vars.weight_version for m in eng.machines] == ["while-paused"] * 2
    # vLLM reporting another version afterwards is a divergence: the adapter stops (state unknown)
    eng.engine.get_weight_version = lambda: "someone-else"
    with pytest.raises(RemoteProtocolError, match="vLLM reports version 'someone-else', the table"):
        eng.update_weight_version("relabel-3")
    with pytest.raises(RemoteProtocolError, match="state is unknown"):
        eng.update_weight_version("relabel-4")
    assert main(["replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["traces"][0]
    assert out["ok"]
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert sum(1 for x in lines if x.get("kind") == "relabel") == 6  # 3 relabels x 2 ranks
