"""``weightsync replay --self-test``: run the reference DP engine healthy and with deliberately broken
behaviours, record a system trace of each (:mod:`weightsync.impl.engine.tracing`), and walk every trace
through the model's successor function (:func:`weightsync.model.trace_walk.walk_trace`).

Glue between the model and the implementation (it imports both), so it lives beside the CLI.

Each broken engine is an :class:`~weightsync.impl.engine.core.EngineCore` subclass
(:mod:`weightsync.impl.engine.faults`), run through ``EngineConfig.core``; it writes a ``fault`` record
where its fault first changes what the rank does. The walker never reads those records; the self-test
checks that the walker rejected the trace at the model step that fault record belongs to.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.impl.engine.tracing import SCHEMA


@dataclass(frozen=True)
class Case:
    """One self-test run.

    Attributes:
        name: the case's name in the report.
        core: the engine class (``EngineConfig.core``; "" the healthy engine).
        mode: the pause mode of every cycle.
        cycles: pause / update / resume cycles.
        verify: the transfer's checksum round (``init_info['verify']``).
        expect_rejected: whether the walker must reject the trace.
    """

    name: str
    core: str = ""
    mode: str = "keep"
    cycles: int = 4
    verify: bool = False
    expect_rejected: bool = True


_FAULTS = "weightsync.impl.engine.faults"

#: The self-test's cases: five broken engines from issue 12's list, corrupted weight bytes, and the healthy
#: 20-cycle run.
CASES = (
    Case("healthy-20-cycles", cycles=20, expect_rejected=False),
    Case("scheduler-advances-under-paused-all", f"{_FAULTS}:AdvancesWhilePaused", mode="keep"),
    Case("drops-start-dp-wave", f"{_FAULTS}:DropsStartDPWave", mode="keep"),
    Case("clear-cache-does-nothing", f"{_FAULTS}:ClearCacheDoesNothing", mode="keep"),
    Case("wave-complete-never-sent", f"{_FAULTS}:NoWaveComplete", mode="keep"),
    Case("abort-aborts-nothing", f"{_FAULTS}:AbortAbortsNothing", mode="abort"),
    Case("corrupted-weight-bytes", f"{_FAULTS}:CorruptsWeights", mode="keep", verify=True),
)


@dataclass
class Recorded:
    """What one recorded run did: requests sent and finished, and the error that ended it (None if the run
    completed every cycle)."""

    requests: int = 0
    finished: int = 0
    cycles: int = 0
    error: str | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def record(
    path: Path,
    case: Case,
    *,
    seed: int = 0,
    dp_size: int = 2,
    sync_interval: int = 4,
    tokens: int = 3,
    timeout_s: float = 8.0,
) -> Recorded:
    """Run ``case`` on a reference DP cluster (``dp_size`` ranks, variant two-phase-epoch, the tiny Llama,
    broadcast transport over gloo) and write its system trace to ``path``.

    Traffic: before each cycle 0-3 greedy requests of ``tokens`` tokens to random ranks, a random pause
    of 0-30 ms, then one round (``update_round``: pause(mode, clear_cache=True), start, update with fresh
    random weights, finish with ``weight_version="step-<c>"``, resume). After the cycles it waits for
    every request. A failure (a broken engine's timeout, a failed round) ends the run; it is reported in
    :attr:`Recorded.error`, not raised. ``timeout_s``: every collective's and call's deadline, seconds.
    """
    from weightsync.impl.engine.client import DPEngineClient, free_port
    from weightsync.impl.engine.controller import update_round
    from weightsync.impl.engine.core import EngineConfig, tiny_config
    from weightsync.impl.engine.weights import random_weights
    from weightsync.impl.models.causal_lm import CausalLM
    from weightsync.impl.models.sampling import SamplingParams
    from weightsync.impl.transfer.trainer import BroadcastTrainerEngine, TrainerInitInfo

    rng = random.Random(seed)
    model_cfg = tiny_config()
    header = {
        "kind": "header",
        "schema": SCHEMA,
        "case": case.name,
        "variant": "two-phase-epoch",
        "dp_size": dp_size,
        "sync_interval": sync_interval,
        "mode": case.mode,
        "clear_cache": True,
        "tokens": tokens,
        "init_transfer": True,
    }
    path.write_text(json.dumps(header, sort_keys=True) + "\n")
    cfg = EngineConfig(
        dp_size=dp_size,
        model=model_cfg,
        variant="two-phase-epoch",
        sync_interval=sync_interval,
        collective_timeout_s=timeout_s,
        system_trace=str(path),
        core=case.core,
    )
    out = Recorded()
    t0 = time.monotonic()
    client = DPEngineClient(cfg).start()
    trainer: BroadcastTrainerEngine | None = None
    streams = []
    try:
        info = TrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=1 + dp_size,
            timeout_s=timeout_s,
            group_backend="gloo",
            rank=0,
            verify=case.verify,
        )
        trainer = BroadcastTrainerEngine.trainer_init(info, client=client)
        lm = CausalLM(model_cfg)
        for c in range(case.cycles):
            for _ in range(rng.randint(0, 3)):
                prompt = [rng.randrange(model_cfg.vocab_size) for _ in range(rng.randint(1, 4))]
                params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
                streams.append(client.add_request(prompt, params, rank=rng.randrange(dp_size)))
            time.sleep(rng.uniform(0.0, 0.03))
            weights = random_weights(lm, seed * 1000 + c + 1)
            update_round(
                client,
                trainer,
                weights,
                mode=case.mode,
                clear_cache=True,
                timeout=4 * timeout_s,
                weight_version=f"step-{c + 1}",
            )
            out.cycles = c + 1
        for s in streams:
            s.wait(4 * timeout_s)
    except Exception as exc:  # a broken engine ends its run here; the trace is what it is
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.requests = len(streams)
        out.finished = sum(1 for s in streams if s.done.is_set())
        client.shutdown()
        if trainer is not None:
            try:
                trainer.shutdown()
            except Exception:
                pass
        out.seconds = round(time.monotonic() - t0, 2)
    return out


__all__ = ["CASES", "Case", "Recorded", "record"]
