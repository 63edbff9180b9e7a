"""``weightsync bench pause``: pause and resume latency of 2 DP ranks for K = 32 and K = 4.

For each sync interval K the benchmark starts a 2-rank cluster of the tiny reference LM, keeps both ranks
busy with long requests, measures the step time while serving, then times ``pause(keep)`` (call to every
rank verified, i.e. the call returned) and ``resume`` (call to every rank running again). The pause's cost
in steps is the number of DP collectives the slowest rank ran between the call and the return; the target
(vLLM PR #39366, two-phase pause: consensus at the next K-step sync) is at most K + 2 steps.
"""

from __future__ import annotations

import time
from typing import Any

from weightsync.impl.engine.client import DPEngineClient
from weightsync.impl.engine.config import EngineConfig, tiny_config
from weightsync.impl.models.sampling import SamplingParams


def _coll(client: DPEngineClient) -> list[int]:
    return [int(c["coll_seq"]) for c in client.fan_out("counts", 10.0)]


def _one(k: int, reps: int) -> dict[str, Any]:
    cfg = EngineConfig(dp_size=2, model=tiny_config(), sync_interval=k, collective_timeout_s=20.0)
    with DPEngineClient(cfg) as client:
        streams = [
            client.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=400), rank=r % 2)
            for r in range(4)
        ]
        time.sleep(0.3)
        c0 = _coll(client)
        t0 = time.perf_counter()
        time.sleep(0.5)
        c1 = _coll(client)
        step_s = (time.perf_counter() - t0) / max(1, min(b - a for a, b in zip(c0, c1, strict=True)))
        pause_s: list[float] = []
        pause_steps: list[int] = []
        resume_s: list[float] = []
        for _ in range(reps):
            before = _coll(client)
            t = time.perf_counter()
            client.pause("keep", clear_cache=False)
            pause_s.append(time.perf_counter() - t)
            after = _coll(client)
            pause_steps.append(max(b - a for a, b in zip(before, after, strict=True)))
            t = time.perf_counter()
            client.resume()
            resume_s.append(time.perf_counter() - t)
            time.sleep(0.05)
        for s in streams:
            client.abort(s.req_id)
        return {
            "sync_interval": k,
            "pause_steps": max(pause_steps),
            "pause_steps_all": pause_steps,
            "pause_seconds": sum(pause_s) / len(pause_s),
            "resume_seconds": sum(resume_s) / len(resume_s),
            "step_seconds": step_s,
            "target_steps": k + 2,
            "within_target": max(pause_steps) <= k + 2,
        }


def run_pause_bench(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns ``{"runs": [per-K dict...], "ok": all within target, ...}``.

    Each run has ``sync_interval``, ``pause_steps`` (worst over repetitions), ``pause_seconds`` and
    ``resume_seconds`` (means, seconds), ``step_seconds`` (mean step time while serving, seconds),
    ``target_steps`` (K + 2) and ``within_target``.
    """
    reps = 2 if quick else 5
    runs = [_one(k, reps) for k in (32, 4)]
    return {
        "bench": "pause",
        "dp_size": 2,
        "runs": runs,
        "ok": all(r["within_target"] for r in runs),
        "ratio_pause_k32_over_k4": runs[0]["pause_seconds"] / max(1e-9, runs[1]["pause_seconds"]),
    }
