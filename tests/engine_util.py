"""Helpers for the engine tests: a small DP cluster whose engines receive weights through the real broadcast
transport (``weightsync.impl.transfer``, gloo on CPU), with the trainer side in this process: vLLM 0.32's
trainer API (``BroadcastTrainerEngine.trainer_init(init_info, client=<the engine client>)``)."""

from __future__ import annotations

import time
from typing import Any

from weightsync.impl.engine.client import DPEngineClient, RequestStream, free_port
from weightsync.impl.engine.config import EngineConfig, tiny_config
from weightsync.impl.engine.controller import RoundTimes, update_round
from weightsync.impl.engine.weights import BROADCAST_WORKER, random_weights
from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.models.sampling import SamplingParams
from weightsync.impl.transfer.trainer import BroadcastTrainerEngine, TrainerInitInfo

CFG = tiny_config()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


class Cluster:
    """A started DP cluster plus the trainer side (rank 0) of the broadcast transport, whose client is the
    engine client (``engine``: a wrapper of it, e.g. CheckedEngine)."""

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
        self.trainer: BroadcastTrainerEngine | None = None
        self.timeout_s = timeout_s
        self.model = CausalLM(CFG)

    def init_transfer(self, **info: Any) -> None:
        """``trainer_init`` through the engine client (``info``: more :class:`TrainerInitInfo` fields); a
        trainer from an earlier init is shut down once the engines have left its group."""
        old, self.trainer = self.trainer, None
        tinfo = TrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=1 + self.client.dp_size,
            timeout_s=self.timeout_s,
            group_backend="gloo",
            rank=0,
            **info,
        )
        try:
            self.trainer = BroadcastTrainerEngine.trainer_init(tinfo, client=self.engine)
        finally:
            if old is not None:
                old.shutdown()

    def send(self, weights: list[tuple[str, Any]]) -> None:
        """The ``update_weights`` part of a round: ``update_weights`` through the engine client, concurrently
        with the trainer's broadcast of ``weights``."""
        assert self.trainer is not None
        self.trainer.update(weights)

    def update(
        self, seed: int, mode: str = "keep", clear_cache: bool = True, weight_version: str | None = None
    ) -> RoundTimes:
        if self.trainer is None:
            self.init_transfer()
        assert self.trainer is not None
        ws = random_weights(self.model, seed)
        return update_round(
            self.engine,
            self.trainer,
            ws,
            mode=mode,
            clear_cache=clear_cache,
            weight_version=weight_version,
        )

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
        self.client.shutdown()


def wait_tokens(streams: list[RequestStream], n: int, timeout: float = 30.0) -> None:
    """Wait until every stream has at least ``n`` tokens."""
    deadline = time.monotonic() + timeout
    while any(len(s.tokens) < n and s.finish_reason is None for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {n} tokens: {[len(s.tokens) for s in streams]}")
        time.sleep(0.005)
