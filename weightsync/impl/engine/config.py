"""Configuration of a reference DP engine cluster: :class:`EngineConfig` (picklable, sent to every process),
one rank's FIFOs (:class:`EngineQueues`) and the small test model (:func:`tiny_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from weightsync.impl.models.config import LMConfig


def tiny_config(vocab: int = 64, hidden: int = 32, layers: int = 2) -> LMConfig:
    """A small Llama config for tests and benchmarks (fast on CPU)."""
    return LMConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
    )


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of a DP engine cluster (picklable; sent to every process).

    Attributes:
        dp_size: number of DP engine ranks.
        model: the reference LM's config.
        variant: protocol variant (a :data:`~weightsync.spec.rank.VARIANTS` name).
        sync_interval: K, the DP sync all-reduce cadence in steps (32 in vLLM, PR #21617).
        init_seed: seed of the engines' initial random weights (None: the model's zero init).
        collective_timeout_s: deadline of every DP collective and of the DP rendezvous, seconds (the weight
            transfer's deadline is its ``init_info['timeout_s']``).
        transfer: weight-transfer worker factory ``"package.module:fn"`` (see
            :func:`weightsync.impl.engine.weights.make_worker`); default: the broadcast transport's
            ``weightsync.impl.transfer.worker:broadcast_worker``.
        max_batch: most requests running per rank.
        idle_sleep_s: how long an idle loop iteration sleeps, seconds.
        step_sleep_s: extra sleep after every executed step (dummy or real), seconds (slows the loop for
            schedule-sensitive tests; 0 in normal runs).
        host: address for the gloo rendezvous.
        dp_port: TCPStore port of the DP group (0: pick a free one at launch).
        allow_unauthenticated: let the DP group rendezvous on a non-loopback ``host`` without the
            deployment's secret (:mod:`weightsync.impl.transfer.rendezvous` rule 2; default refused).
        threads: torch intra-op threads per engine process.
        system_trace: a system-trace file (:mod:`weightsync.impl.engine.tracing`) that every process of the
            cluster (ranks, coordinator, front-end, controller) appends to from its start; None: none.
        core: the engine class each rank process runs, ``"package.module:Class"`` (an
            :class:`EngineCore` subclass; ``weightsync replay --self-test`` runs deliberately broken ones);
            "" runs :class:`EngineCore`.
    """

    dp_size: int = 2
    model: LMConfig | None = None
    variant: str = "two-phase-epoch"
    sync_interval: int = 32
    init_seed: int | None = 0
    collective_timeout_s: float = 30.0
    transfer: str = "weightsync.impl.transfer.worker:broadcast_worker"
    max_batch: int = 64
    idle_sleep_s: float = 0.002
    step_sleep_s: float = 0.0
    host: str = "127.0.0.1"
    dp_port: int = 0
    allow_unauthenticated: bool = False
    threads: int = 1
    system_trace: str | None = None
    core: str = ""

    def __post_init__(self) -> None:
        """Check every number before any process starts.

        Raises:
            ValueError: naming the field, its value and the rule: ``dp_size``, ``sync_interval``,
                ``max_batch`` and ``threads`` are ints of at least 1; ``collective_timeout_s`` is a finite
                number of seconds above 0; ``idle_sleep_s`` and ``step_sleep_s`` are finite and at least 0;
                ``dp_port`` is 0 (pick one) or a TCP port.
        """
        for name in ("dp_size", "sync_interval", "max_batch", "threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int of at least 1")
        for name, low_open in (
            ("collective_timeout_s", True),
            ("idle_sleep_s", False),
            ("step_sleep_s", False),
        ):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (low_open and value == 0):
                rule = "above 0" if low_open else "at least 0"
                raise ValueError(f"EngineConfig.{name}={value!r}: must be a finite number of seconds {rule}")
        if type(self.dp_port) is not int or not 0 <= self.dp_port <= 65535:
            raise ValueError(
                f"EngineConfig.dp_port={self.dp_port!r}: must be 0 (pick a free port) or 1..65535"
            )


@dataclass
class EngineQueues:
    """The FIFOs of one rank: inputs (front-end, controller, coordinator wave) and outputs."""

    front_in: Any  # front-end -> engine: AddMsg, AbortMsg
    control_in: Any  # controller -> engine: UtilityCall, Shutdown
    wave_in: Any  # coordinator -> engine: StartDPWave
    out: Any  # engine -> front-end: StepOutputs, UtilityReply, TransitionRecord, EngineFailure
    to_coord: Any  # engine -> coordinator: WaveComplete, StartWave
    step_gate: Any = None  # repro only: a shared int; -1 steps freely, n >= 0 permits n acting steps
