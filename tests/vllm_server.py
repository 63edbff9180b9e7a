"""Shared by the tests that run a real ``vllm serve``: the server process (``python -m
weightsync.vllm_tools.serve``, optionally inside a network namespace) and an HTTP client of its routes.

``ServerAPI`` needs only the URL, so a process in another network namespace (the netns test's trainer)
uses the same calls as the test that started the server. Import only after ``vllm_util.require_vllm()``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import requests
from transfer_procs import free_port
from vllm_served import N_TOKENS
from vllm_util import CPU_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: how long a server may take to answer ``/health`` after it was started, seconds
START_S = 240


class ServerAPI:
    """The HTTP routes of one ``vllm serve`` at ``url`` serving ``model`` (its path, vLLM's model name)."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model

    def healthy(self) -> bool:
        """``GET /health`` answered 200 (False on any connection error)."""
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def post(self, path: str, **kw: Any) -> Any:
        """``POST path`` (60 s timeout); its JSON. Fails unless the status is 200."""
        r = requests.post(f"{self.url}{path}", timeout=60, **kw)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    def weight_info(self) -> Any:
        return requests.get(f"{self.url}/weight_info", timeout=5).json()

    def _complete(self, prompt: list[int], **sampling: Any) -> Any:
        body = {"model": self.model, "prompt": prompt, "temperature": 0.0, **sampling}
        return self.post("/v1/completions", json=body)["choices"][0]

    def greedy(self, prompt: list[int]) -> list[int]:
        """The server's ``N_TOKENS`` greedy tokens after ``prompt``."""
        choice = self._complete(prompt, max_tokens=N_TOKENS, return_token_ids=True)
        return [int(t) for t in choice["token_ids"]]

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """The log-probability of each prompt token after the first, given the ones before it."""
        choice = self._complete(prompt, max_tokens=1, prompt_logprobs=0)
        plp = choice["prompt_logprobs"]
        return [float(d[str(tok)]["logprob"]) for d, tok in zip(plp[1:], prompt[1:], strict=True)]


class Server(ServerAPI):
    """``python -m weightsync.vllm_tools.serve MODEL ...`` in its own process group, logging to ``log``.

    Args:
        host, port: where it listens (``port`` None: a free port of this namespace).
        netns: run it inside this network namespace (``ip netns exec``).
        healthy: how to ask whether it answers ``/health`` (default: from this process); the server's
            exit and ``START_S`` are watched either way.
        extra: more ``vllm serve`` arguments.

    Raises:
        AssertionError: it exited, or did not answer within ``START_S`` (with its log's tail).
    """

    def __init__(
        self,
        model_dir: pathlib.Path,
        log: pathlib.Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        netns: str | None = None,
        healthy: Callable[[], bool] | None = None,
        extra: Sequence[str] = (),
        env_extra: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        super().__init__(f"http://{host}:{self.port}", str(model_dir))
        self.log_path = log
        env = {**os.environ, **CPU_ENV, "VLLM_SERVER_DEV_MODE": "1", **(env_extra or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        argv = [
            *(["ip", "netns", "exec", netns] if netns else []),
            sys.executable,
            "-m",
            "weightsync.vllm_tools.serve",
            self.model,
            "--host",
            host,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            *extra,
        ]
        self.log = log.open("wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_healthy(t0, healthy or self.healthy)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, t0: float, healthy: Callable[[], bool]) -> None:
        while time.monotonic() - t0 < START_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            if healthy():
                return
            time.sleep(0.5)
        raise AssertionError(f"no /health within {START_S} s:\n{self.tail()}")

    def stop(self) -> int:
        """SIGTERM to its process group, SIGKILL after 30 s; its exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return int(self.proc.returncode)
