"""``weightsync bench vllm``: one sync round into a real vLLM 0.32 engine, against vLLM's own packed path
and the limit set by the transfer and the reload.

Setup: a synthetic dense ``LlamaForCausalLM`` checkpoint built locally (:data:`FULL_MODEL`: 255.3 MiB of
float32 in 156 tensors; ``quick``: :data:`QUICK_MODEL`, 6.5 MiB in 21 tensors), served by one real
``AsyncLLM`` (``data_parallel_size`` 1 or 2, ``enforce_eager=True``, ``dtype="float32"``,
``weight_transfer_config={"backend": "weightsync"}``) on its own event-loop thread in this process; this
process is also the trainer, holding the ``transformers`` model. Every figure is measured on the trainer
with ``time.perf_counter`` around the round alone, inside a ``pause_generation(mode="keep")`` /
``resume_generation()`` bracket (the bracket itself is not timed), in GB/s = model bytes / seconds / 1e9.

Configurations: ``data_parallel_size`` 1 and 2 (dense: DP engines of one worker each; ``--dp``), one
engine start each; every method runs on every worker of the configuration.

Methods (all over gloo on 127.0.0.1, the trainer as rank 0 and worker ``i`` of DP engine ``i`` as rank
``1 + i``):

- ``raw`` (the transfer alone): one ``broadcast`` of the model's bytes as one flat uint8 tensor into a
  buffer each worker allocated once; nothing is loaded. One RPC tells the workers to receive.
- ``reload_only`` (the loading alone): the round's weights are put into every worker before the timed
  window (a raw broadcast); timed are the three RPCs of a round (``initialize_layerwise_reload``, one
  ``model.load_weights`` of those tensors, ``finalize_layerwise_reload``), as vLLM's NCCL engine brackets
  a round (``distributed/weight_transfer/nccl_engine.py:159-173``), with no transfer.
- ``limit_s`` = max(``raw``, ``reload_only``): a round cannot be faster than the slower of its two halves
  run side by side.
- ``side_by_side`` (the two halves at once, on this machine): ``raw``'s broadcast into a second buffer of
  each worker, received on a thread of its own, while the worker runs ``reload_only``'s three RPCs on the
  weights already in it; nothing couples the two (no bucket waits for the load, no load for a bucket).
  ``limit_s`` assumes the halves do not slow each other; where they share the cores they do, and
  ``vs_limit_here`` = ``limit_s`` / min(``side_by_side``, ``raw`` + ``reload_only``) is the ``vs_limit``
  that running the two halves uncoupled (at once, or one after the other) reaches on this machine.
  ``vs_side_by_side`` = ``side_by_side`` / ``weightsync``.
- ``vllm_packed`` (what a user of vLLM's built-in backend gets): vLLM 0.32's own
  ``packed_nccl_broadcast_producer`` on the trainer and ``packed_nccl_broadcast_consumer`` in each worker
  (``distributed/weight_transfer/packed_tensor.py:146-300``), called as vLLM ships them and as its NCCL
  engine calls them (``nccl_engine.py:176-215``: the metadata iterator, ``post_unpack_func=
  model.load_weights``, the same ``buffer_size_bytes`` and ``num_buffers`` as weightsync), inside the same
  reload bracket, over the same gloo group. On CPU their CUDA stream calls are the only thing replaced, by
  no-ops (``_get_streams``, ``torch.cuda.stream``, ``torch.accelerator.current_device_index``:
  :func:`weightsync.vllm_tools.bench_worker.vllm_packed_on_cpu`); the group's ``broadcast`` completes
  before it returns, since there is no stream to enqueue it on.
- ``per_tensor`` (what ad-hoc integrations do, OpenRLHF's ``_broadcast_to_vllm``): per tensor one
  ``collective_rpc`` carrying ``(name, dtype, shape)`` to the workers, which allocate the tensor, receive
  its broadcast and ``model.load_weights([(name, tensor)])`` it, and the trainer waits for that reply
  before the next tensor; bracketed by the reload like the others (on vLLM 0.32 a live ``load_weights``
  alone cannot update this model: on CPU the linear layers drop their ``weight`` after packing it for
  oneDNN, ``layers/linear.py:206-216``, ``layers/utils.py:470-610`` with ``remove_weight=True``).
- ``per_tensor_bare``: vLLM's own unpacked NCCL receive loop (``nccl_engine.py:217-229``) over gloo: one
  RPC for the whole round, then per tensor allocate, broadcast, ``load_weights``.
- ``weightsync``: the real path: ``WeightTransferTrainerFactory.trainer_init`` with
  :class:`~weightsync.vllm.trainer.WeightsyncTrainerInitInfo` (packed, ``bucket_bytes`` buckets,
  ``num_buffers`` slots) and ``trainer.send_weights(weight_version=...)`` from a vLLM ``ModuleSource``:
  ``start_weight_update`` / one ``update_weights`` / ``finish_weight_update`` through vLLM's RPCs, the
  engine's layerwise reload and weightsync's completeness check included.

Time split (``split``, the ``weightsync`` rounds' medians on the first worker, seconds, measured by the
transport, :class:`~weightsync.impl.transfer.base.RoundTimings`): ``agree_s`` (wire agreement),
``control_s`` (waiting for bucket headers, and the end status), ``transfer_wait_s`` (blocked on a payload
that has not arrived), ``unpack_s``, ``load_s`` (inside ``load_weights``: vLLM's loaders and the layerwise
processing of completed layers, and ``copy_s`` of it copying what the reload keeps of a reused buffer),
``total_s`` (the whole ``update_weights`` receive), ``reload_s`` (inside vLLM's reload functions, below)
and ``outside_s`` (the round on the trainer minus ``total_s``: the RPCs, ``start`` and ``finish``).

Code in the worker runs through ``AsyncLLM.collective_rpc(callable)`` (``v1/engine/async_llm.py:1205``
-> ``core_client.py:1384`` -> ``v1/engine/core.py:1073`` -> ``v1/executor/uniproc_executor.py:90`` ->
``v1/serial_utils.py:485`` ``run_method``, which calls it with the worker as first argument). A callable
crosses the front-end/EngineCore socket only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
(``v1/serial_utils.py:213-230``, pickled by reference: the worker imports this module), so the bench sets
it for the engine it starts and restores it afterwards. The worker's model is
``worker.model_runner.model``, the same object the ``weightsync`` engine loads into.

Interleaving and statistics: one untimed warm-up round per method, then ``repeats`` repetitions of every
method, interleaved (the order rotated by one each repetition) so load swings on a shared machine hit
every method alike; each method's median and minimum are reported, and the headline GB/s and ratios use
the medians. ``loadavg`` is ``os.getloadavg()`` at the end (``loadavg_start`` before the engine starts).

Reload time: the seconds the worker spends inside vLLM's layerwise reload (``initialize_layerwise_reload``,
every ``_layerwise_process`` a completed layer triggers from its weight loader, and
``finalize_layerwise_reload``: ``model_executor/model_loader/reload/layerwise.py:83,226,287,344``), timed
by wrappers the bench installs in the worker for its duration (nested calls counted once). Reported per
round and method; ``reload_seconds`` is the median over the ``weightsync`` rounds. Those calls overlap
the transfer of later buckets, so the figure is a share of the round, not an addend.

Verification (every round, warm-up included): before each round the trainer negates every weight in
place (so each round's bytes differ from the previous round's in every element) and records the CRC-32
of each tensor (``raw``: of the flat buffer). After the round each worker reports the CRC-32 of every
tensor handed to ``model.load_weights`` in that round (a wrapper around the model's ``load_weights``
copies each into a preallocated, touched arena at hand-off, inside the timed window of every loading
method alike, since the buffers behind it may be reused before the round ends; the CRC is computed after
the round; ``raw``: of its receive buffer) and of every parameter the
engine's model still holds as a plain tensor (embeddings, norms, ``lm_head``; the oneDNN-packed linear
weights cannot be read back), which must equal what was sent. A round is verified when every byte of the
model arrived bit-exact (``bytes_verified == model_bytes``), nothing else was loaded and every readable
engine parameter matches.

Targets (judged at full size only, in every configuration): ``vs_vllm_packed >= 1.2``,
``vs_limit >= 0.8`` and ``vs_per_tensor >= 1.5``.

This module is the benchmark without vLLM (its sizes, figures and rendering); the run is
:func:`weightsync.vllm_tools.bench.run_vllm_bench` and the worker side :mod:`weightsync.vllm_tools.bench_worker`, since
only :mod:`weightsync.vllm` imports vllm.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from weightsync.impl.transfer.base import RoundTimings

#: ``build_tiny_llama`` overrides of the full model: 66,930,176 float32 parameters (267,720,704 bytes,
#: 255.3 MiB) in 156 tensors (17 layers of 9, embeddings, final norm, ``lm_head``); head dimension 64.
FULL_MODEL: dict[str, int] = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 17,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 16384,
}
#: ``--quick``: 1,705,216 parameters (6,820,864 bytes, 6.5 MiB) in 21 tensors.
QUICK_MODEL: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
#: timed repetitions of every method (full size, ``quick``)
REPEATS = (5, 2)
#: bucket size of ``quick`` (several buckets for its 6.5 MiB); the full size uses the transfer bench's
QUICK_BUCKET_BYTES = 1 << 20
METHODS = ("raw", "per_tensor", "per_tensor_bare", "vllm_packed", "reload_only", "side_by_side", "weightsync")
#: the engine configurations of a full run: DP engines of one worker each (dense)
DP_CONFIGS = (1, 2)
#: the CRC key of the raw method's one flat buffer
RAW_KEY = "<raw>"
TARGET_VS_VLLM_PACKED = 1.2
TARGET_VS_LIMIT = 0.8
TARGET_VS_PER_TENSOR = 1.5
#: the worker's time split of a round: the seconds fields of
#: :class:`weightsync.impl.transfer.base.RoundTimings`, in its order
SPLIT = tuple(f.name for f in fields(RoundTimings) if f.name.endswith("_s"))


@dataclass
class RoundResult:
    """One verified (or not) round of one method.

    Attributes:
        seconds: wall time of the round on the trainer.
        reload_s: seconds the worker spent inside vLLM's layerwise reload in this round.
        load_s: seconds the worker spent inside ``model.load_weights`` in this round (most of the reload
            runs in there, from the weight loaders of completed layers).
        bytes_verified: bytes whose CRC-32 on the engine equals the trainer's.
        engine_params_checked: readable engine parameters compared (all equal when ``ok``).
        ok: every byte arrived bit-exact on every worker, nothing else was loaded, every readable parameter
            matches.
        problem: why not ``ok`` ("" when ok).
        timings: the first worker's time split of the round (``weightsync`` only: its transport's
            :class:`~weightsync.impl.transfer.base.RoundTimings`).
    """

    seconds: float
    reload_s: float
    load_s: float
    bytes_verified: int
    engine_params_checked: int
    ok: bool
    problem: str
    timings: dict[str, float] = field(default_factory=dict)


def method_summary(results: list[RoundResult], model_bytes: int) -> dict[str, Any]:
    """One method's rounds: seconds (median, min), GB/s, reload and ``load_weights`` seconds, verification."""
    secs = [r.seconds for r in results]
    med, best = statistics.median(secs), min(secs)
    return {
        "seconds": secs,
        "median_s": med,
        "min_s": best,
        "gbps": model_bytes / med / 1e9,
        "gbps_best": model_bytes / best / 1e9,
        "reload_seconds": [r.reload_s for r in results],
        "load_weights_seconds": [r.load_s for r in results],
        "bytes_verified_min": min(r.bytes_verified for r in results),
        "engine_params_checked_min": min(r.engine_params_checked for r in results),
        "rounds": len(results),
        "rounds_verified": sum(r.ok for r in results),
        "problems": sorted({r.problem for r in results if r.problem}),
    }


def _split(results: list[RoundResult], reload_s: float) -> dict[str, float]:
    """Median per field of the worker's time split over ``results``, with vLLM's reload seconds."""
    out = {k: statistics.median(r.timings.get(k, 0.0) for r in results) for k in SPLIT}
    out["reload_s"] = reload_s
    return out


def figures(
    warm: dict[str, RoundResult],
    results: dict[str, list[RoundResult]],
    *,
    quick: bool,
    dp: int,
    model_bytes: int,
    start_s: float,
) -> dict[str, Any]:
    """One engine configuration's figures from its rounds: per method (:func:`method_summary`), the
    headline GB/s and seconds (medians), the ratios, ``limit_s``, the weightsync round's time split,
    verification and the targets (judged at full size only)."""
    methods = {m: method_summary(results[m], model_bytes) for m in METHODS}
    verified = all(warm[m].ok for m in METHODS) and all(
        s["rounds_verified"] == s["rounds"] for s in methods.values()
    )
    out: dict[str, Any] = {
        "data_parallel_size": dp,
        "engine_workers": dp,
        "methods": methods,
        "warmup": {m: {"seconds": r.seconds, "ok": r.ok, "problem": r.problem} for m, r in warm.items()},
        "engine_start_seconds": start_s,
    }
    for m in METHODS:
        out[f"{m}_gbps"] = methods[m]["gbps"]
        out[f"{m}_gbps_best"] = methods[m]["gbps_best"]
        out[f"{m}_s"] = methods[m]["median_s"]
    for base in ("raw", "per_tensor", "per_tensor_bare", "vllm_packed"):
        out[f"vs_{base}"] = out["weightsync_gbps"] / out[f"{base}_gbps"]
        out[f"vs_{base}_best"] = out["weightsync_gbps_best"] / out[f"{base}_gbps_best"]
    out["limit_s"] = max(out["raw_s"], out["reload_only_s"])
    out["vs_limit"] = out["limit_s"] / out["weightsync_s"]
    out["vs_side_by_side"] = out["side_by_side_s"] / out["weightsync_s"]
    out["vs_limit_here"] = out["limit_s"] / min(out["side_by_side_s"], out["raw_s"] + out["reload_only_s"])
    ws_reload = methods["weightsync"]["reload_seconds"]
    out["reload_seconds"] = statistics.median(ws_reload)
    out["reload_seconds_min"] = min(ws_reload)
    out["reload_share"] = out["reload_seconds"] / methods["weightsync"]["median_s"]
    out["split"] = _split(results["weightsync"], out["reload_seconds"])
    out["split"]["outside_s"] = out["weightsync_s"] - out["split"]["total_s"]
    out["verification"] = {
        m: {
            "rounds": s["rounds"] + 1,
            "rounds_verified": s["rounds_verified"] + int(warm[m].ok),
            "bytes_verified_min": s["bytes_verified_min"],
            "engine_params_checked_min": s["engine_params_checked_min"],
        }
        for m, s in methods.items()
    }
    out["verified"] = verified
    out["targets"] = {
        f"vs_vllm_packed>={TARGET_VS_VLLM_PACKED}": out["vs_vllm_packed"] >= TARGET_VS_VLLM_PACKED,
        f"vs_limit>={TARGET_VS_LIMIT}": out["vs_limit"] >= TARGET_VS_LIMIT,
        f"vs_per_tensor>={TARGET_VS_PER_TENSOR}": out["vs_per_tensor"] >= TARGET_VS_PER_TENSOR,
    }
    out["targets_met"] = all(out["targets"].values())
    out["ok"] = verified and (out["targets_met"] or quick)
    return out


def combined(
    configs: list[dict[str, Any]],
    *,
    quick: bool,
    model_bytes: int,
    num_tensors: int,
    overrides: dict[str, int],
    bucket: int,
    num_buffers: int,
    reps: int,
    vllm_version: str,
    loadavg_start: list[float],
) -> dict[str, Any]:
    """The result of :func:`weightsync.vllm_tools.bench.run_vllm_bench`: the settings, every configuration
    (``configurations``, one :func:`figures` each, by its number of engine workers) and, at the top level,
    the headline fields of the first (one engine worker); ``ok`` and ``targets_met`` hold for all."""
    first = configs[0]
    out: dict[str, Any] = {
        "bench": "vllm",
        "vllm_version": vllm_version,
        "quick": quick,
        "model_config": {"architecture": "LlamaForCausalLM", "dtype": "float32", **overrides},
        "model_bytes": model_bytes,
        "num_tensors": num_tensors,
        "backend": "gloo",
        "bucket_bytes": bucket,
        "num_buffers": num_buffers,
        "repetitions": reps,
        "warmup_rounds": 1,
        "order": "interleaved, rotated by one method each repetition",
        "gbps_definition": "model_bytes / seconds / 1e9; headline figures use each method's median round",
        "vllm_packed_on_cpu": "vLLM's packed_nccl_broadcast_producer / _consumer as shipped; their CUDA "
        "stream calls are no-ops and each broadcast completes before it returns (no stream to enqueue on)",
        "limit_definition": "max(raw_s, reload_only_s): the transfer alone and the reload alone",
        **first,
        "configurations": {str(c["engine_workers"]): c for c in configs},
    }
    out["targets"] = {
        f"{k} (workers={c['engine_workers']})": v for c in configs for k, v in c["targets"].items()
    }
    out["targets_met"] = all(c["targets_met"] for c in configs)
    out["targets_judged"] = not quick
    out["verified"] = all(c["verified"] for c in configs)
    out["ok"] = out["verified"] and (out["targets_met"] or quick)
    out["loadavg_start"] = loadavg_start
    out["loadavg"] = list(os.getloadavg())
    return out


def human_summary(out: dict[str, Any]) -> str:
    """The figures of :func:`run_vllm_bench` as a few lines for people, per configuration."""
    rows = [
        ("raw broadcast (no load)", "raw"),
        ("per-tensor, RPC per tensor", "per_tensor"),
        ("per-tensor, one RPC", "per_tensor_bare"),
        ("vLLM's packed path", "vllm_packed"),
        ("reload only (no transfer)", "reload_only"),
        ("transfer and reload at once", "side_by_side"),
        ("weightsync", "weightsync"),
    ]
    lines = [
        f"bench vllm: {out['model_bytes'] / 2**20:.1f} MiB float32 Llama ({out['num_tensors']} tensors) into "
        f"vLLM {out['vllm_version']}, gloo, {out['repetitions']} repetitions, median s / GB/s (best)"
        + ("" if out["targets_judged"] else "; --quick: targets not judged")
    ]
    for c in out["configurations"].values():
        m = c["methods"]
        lines.append(f"  {c['engine_workers']} engine worker(s):")
        for label, key in rows:
            s = m[key]
            lines.append(
                f"    {label:<28} {s['median_s']:6.3f} s {s['gbps']:7.3f} ({s['gbps_best']:.3f})  "
                f"verified {s['rounds_verified']}/{s['rounds']}"
            )
        sp = c["split"]
        lines.append(
            f"    vs vLLM packed {c['vs_vllm_packed']:.2f} (>= {TARGET_VS_VLLM_PACKED}), vs limit "
            f"{c['vs_limit']:.2f} (>= {TARGET_VS_LIMIT}; limit {c['limit_s']:.3f} s), vs per-tensor "
            f"{c['vs_per_tensor']:.2f}; targets met: {c['targets_met']}"
        )
        lines.append(
            f"    the two halves uncoupled on this machine reach vs limit {c['vs_limit_here']:.2f}; weightsync "
            f"vs them at once {c['vs_side_by_side']:.2f}"
        )
        lines.append(
            "    weightsync round, worker split (s): " + ", ".join(f"{k} {v:.3f}" for k, v in sp.items())
        )
    lines.append(f"  verified: {out['verified']}; loadavg {out['loadavg']}")
    return "\n".join(lines)


__all__ = [
    "DP_CONFIGS",
    "FULL_MODEL",
    "METHODS",
    "QUICK_MODEL",
    "SPLIT",
    "RoundResult",
    "combined",
    "figures",
    "human_summary",
    "method_summary",
]
