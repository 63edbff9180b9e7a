"""Helpers for the engine tests: a small DP cluster whose engines receive weights through the real broadcast
transport (``weightsync.impl.transfer``, gloo on CPU), with the trainer side in this process."""

from __future__ import annotations

import threading
import time
from typing import Any

from weightsync.impl.engine.client import DPEngineClient, RequestStream, free_port
from weightsync.impl.engine.controller import RoundTimes, update_round
from weightsync.impl.engine.core import EngineConfig, tiny_config
from weightsync.impl.engine.weights import BROADCAST_WORKER, random_weights, update_info_for
from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.models.sampling import SamplingParams
from weightsync.impl.transfer.broadcast import BroadcastTrainer

CFG = tiny_config()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


class Cluster:
    """A started DP cluster plus the trainer side (rank 0) of the broadcast transport."""

    def __init__(
        self,
        dp_size: int = 2,
        variant: str = "two-phase-epoch",
        sync_interval: int = 4,
        timeout_s: float = 20.0,
        step_sleep_s: float = 0.0,
        engine: Any = None,
        hold: bool = False,
        transfer: str = BROADCAST_WORKER,
    ) -> None:
        cfg = EngineConfig(
            dp_size=dp_size,
            model=CFG,
            variant=variant,
            sync_interval=sync_interval,
            collective_timeout_s=timeout_s,
            step_sleep_s=step_sleep_s,
            transfer=transfer,
        )
        self.client = DPEngineClient(cfg, hold=hold).start()
        self.engine = engine(self.client) if engine is not None else self.client
        self.trainer: BroadcastTrainer | None = None
        self.timeout_s = timeout_s
        self.model = CausalLM(CFG)

    def init_transfer(self) -> None:
        port = free_port()
        info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + self.client.dp_size,
            "timeout_s": self.timeout_s,
            "backend": "gloo",
        }
        box: list[BroadcastTrainer] = []
        errors: list[BaseException] = []

        def host() -> None:
            try:
                box.append(BroadcastTrainer(info))
            except BaseException as exc:
                errors.append(exc)

        th = threading.Thread(target=host, daemon=True)
        th.start()
        self.engine.init_weight_transfer_engine(info)
        th.join(self.timeout_s + 5)
        if errors:
            raise errors[0]
        assert box, f"the trainer did not join the transfer group within {self.timeout_s + 5} s"
        self.trainer = box[0]

    def send(self, weights: list[tuple[str, Any]]) -> None:
        """The trainer's side of one ``update_weights``: broadcast ``weights`` (one tensor per bucket)."""
        assert self.trainer is not None
        self.trainer.send(weights)

    def update(self, seed: int, mode: str = "keep", clear_cache: bool = True) -> RoundTimes:
        if self.trainer is None:
            self.init_transfer()
        assert self.trainer is not None
        ws = random_weights(self.model, seed)
        return update_round(
            self.engine, update_info_for(ws), lambda: self.send(ws), mode=mode, clear_cache=clear_cache
        )

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.client.shutdown()


def wait_tokens(streams: list[RequestStream], n: int, timeout: float = 30.0) -> None:
    """Wait until every stream has at least ``n`` tokens."""
    deadline = time.monotonic() + timeout
    while any(len(s.tokens) < n and s.finish_reason is None for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {n} tokens: {[len(s.tokens) for s in streams]}")
        time.sleep(0.005)
