"""The main job on real vLLM (``weightsync demo --engine vllm``): the RL loop on an ``AsyncLLM`` with 2 DP
engines, weights synced by weightsync's backend through vLLM's own weight-transfer API.

The policy is built locally (no hub): the default demo policy's Llama shape (``DEFAULT_MODEL_KWARGS``:
vocabulary 259, the byte tokenizer of :mod:`weightsync.demo.rl_task`) or, with ``moe``, a tiny Mixtral
(where vLLM's DP waves and two-phase pause run: lockstep ``DPEngineCoreProc`` ranks). Both are written as a
safetensors checkpoint with a local tokenizer file and served by ``AsyncLLM(data_parallel_size=2)`` with
``weight_transfer_config={"backend": "weightsync"}``; the trainer is :class:`~weightsync.demo.trainer.Trainer`
(GRPO-style policy gradient on :class:`~weightsync.demo.rl_task.DigitPatternTask`) and connects through
vLLM's public ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=ModuleSource(model))``.

One step: the engines sample a rollout batch (``prompts_per_step`` x ``group_size``, temperature 1, the
sampled tokens' log-probabilities), the trainer takes one optimizer step; then the sync, with the next
batch's requests already in flight: the spec's controller cycle as
:func:`~weightsync.impl.engine.controller.update_round` runs it (``pause_generation(mode=...)``, a weightsync
round: ``start_weight_update`` / the trainer's ``update_weights`` /
``finish_weight_update(weight_version="step-N")``, then ``resume_generation()``; a failed call follows the
table's ``one_round`` policy). Checks after every sync (the result's ``syncs``):

- greedy tokens of the probe prompts on every DP rank equal the trainer's (``greedy_equal``);
- vLLM's prompt log-probabilities within ``1e-4`` of the trainer's float32 log-softmax (``max_logprob_diff``);
- ``get_weight_version()`` on every engine equals ``step-N`` (``weight_versions``, per sync per engine);
- no request lost: every submitted request finishes with ``length`` or ``stop`` (kept requests too).

Every controller and trainer call goes through :class:`~weightsync.impl.checked.CheckedEngine` around the
``AsyncLLM`` (:mod:`weightsync.vllm_tools.checked`, weightsync's default table: an illegal call is refused before
vLLM sees it), which records ``trace``. With ``moe``
the engines run vLLM's DP protocol, and their own events, recorded by the plugin's probe
(:mod:`weightsync.vllm_tools.probe`), become ``engine_trace`` (:mod:`weightsync.vllm_tools.trace`; a dense model's DP
engines are independent and run no DP protocol). The run replays both (``trace_ok``; the engines' trace
against the variant they run: ``vllm-0.32-epoch`` with the plugin's default fix, ``vllm-0.32`` with
``WEIGHTSYNC_VLLM_FIX=none``; the result's ``vllm_fix`` says which). ``moe_reload_fix=False`` runs the MoE policy without weightsync's fix for vLLM 0.32's CPU
MoE reload (``weightsync.vllm.reload``): the checks then fail, which shows that they bite.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.demo.config import RLRunConfig
from weightsync.demo.rl_task import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, DigitPatternTask, Prompt, Sample
from weightsync.spec.errors import WeightSyncError
from weightsync.spec.states import IN_FLIGHT_FINISH, PauseMode
from weightsync.vllm_tools.fix import VARIANT, chosen_fix
from weightsync.vllm_tools.serving import LoopThread, shutdown_async_llm

MAX_LOGPROB_DIFF = 1e-4
PROBE_TOKENS = 6


@dataclass
class VllmDemoConfig(RLRunConfig):
    """Settings of one run (see the module docstring; the shared ones, validated there:
    :class:`~weightsync.demo.config.RLRunConfig`).

    Attributes:
        timeout_s: deadline of every vLLM call and of the transfer group, seconds (120 by default: vLLM's
            engines are slower to answer on 2 cores).
        moe: serve a tiny Mixtral instead of the dense Llama.
        moe_reload_fix: weightsync's MoE reload fix (None: where needed; False shows the checks bite).
        trace: replay trace path (None: ``traces/vllm-demo-<time>.jsonl``).
    """

    timeout_s: float = 120.0
    moe: bool = False
    moe_reload_fix: bool | None = None


def _policy(cfg: VllmDemoConfig, out: Path) -> Any:
    from weightsync.demo.trainer import DEFAULT_MODEL_KWARGS
    from weightsync.vllm_tools.models import build_tiny_llama, build_tiny_mixtral

    ids = {"vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    if cfg.moe:
        return build_tiny_mixtral(out, seed=cfg.seed, **ids)
    return build_tiny_llama(out, seed=cfg.seed, **{**DEFAULT_MODEL_KWARGS, **ids})


def _trainer_reference(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """The trainer's greedy tokens and float32 prompt log-probabilities of ``prompts``."""
    from weightsync.vllm_tools.models import greedy_tokens

    greedy, lps = [], []
    with torch.no_grad():
        for p in prompts:
            greedy.append(greedy_tokens(model, p, PROBE_TOKENS))
            logits = model(input_ids=torch.tensor([p])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            lps.append([float(lp[i, p[i + 1]]) for i in range(len(p) - 1)])
    return greedy, lps


def run_vllm_demo(cfg: VllmDemoConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the loop (see the module docstring) and return the result: ``engine``, ``model``, ``steps``,
    ``syncs`` (per sync: ``version``, ``greedy_equal``, ``max_logprob_diff``, ``weight_versions``,
    ``in_flight``, ``seconds``), ``lost_requests``, ``max_logprob_diff``, ``greedy_equal``,
    ``weight_versions``, ``rewards``, ``reward_first``, ``reward_last``, ``authenticated`` (the engines were
    admitted by the authenticated rendezvous: ``WEIGHTSYNC_TOKEN_FILE`` set), ``trace``, ``trace_ok``,
    ``ok`` (every check held), ``seconds``.

    Raises:
        ValueError: a bad setting (:meth:`VllmDemoConfig.validate`), before anything starts.
        WeightSyncError: vLLM or the round failed (the message names the step and the call).
    """
    cfg.validate()
    fix = chosen_fix()  # an unknown WEIGHTSYNC_VLLM_FIX fails here, before anything starts
    say = log or (lambda _m: None)
    t0 = time.monotonic()
    from weightsync.vllm_tools import probe
    from weightsync.vllm_tools.trace import to_replay_trace

    trace = Path(cfg.trace or f"traces/vllm-demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl")
    trace.unlink(missing_ok=True)  # CheckedEngine appends: this run's trace is the whole file
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-demo-") as tmp:
        model_dir = Path(tmp) / "policy"
        model = _policy(cfg, model_dir)
        events_dir = Path(tmp) / "events"
        os.environ[probe.ENV_EVENTS] = str(events_dir)
        loop = LoopThread("vllm-demo-loop")
        try:
            result = _run(cfg, trace, model, model_dir, loop, say)
        finally:
            os.environ.pop(probe.ENV_EVENTS, None)
            loop.close()
        events = probe.read_events(events_dir)
        engine_trace = trace.with_name(trace.stem + "-engines.jsonl")
        if events:  # lockstep DP engines (MoE): the engines' own protocol events
            to_replay_trace(events, engine_trace, variant=VARIANT[fix])
    from weightsync.impl.trace_replay import replay_trace
    from weightsync.model.replay import TraceChecker

    result["trace"] = str(trace)
    result["engine_trace"] = str(engine_trace) if events else None
    result["vllm_fix"] = fix  # the plugin's resume-epoch fix in the engines: "epoch" or "none"
    oks = []
    for key, path, variant in (
        ("trace", trace, None),
        ("engine_trace", engine_trace if events else None, VARIANT[fix]),
    ):
        if path is None:
            continue
        rp = replay_trace(path, TraceChecker(), variant=variant)
        oks.append(rp.ok)
        result[f"{key}_steps"] = rp.steps
        if rp.divergence is not None:
            result[f"{key}_divergence"] = rp.divergence.describe()
    result["trace_ok"] = all(oks)
    result["seconds"] = round(time.monotonic() - t0, 3)
    result["ok"] = bool(
        result["greedy_equal"]
        and result["max_logprob_diff"] <= MAX_LOGPROB_DIFF
        and result["lost_requests"] == 0
        and result["versions_ok"]
        and result["trace_ok"]
    )
    return result


def _run(
    cfg: VllmDemoConfig,
    checked_trace: Path,
    model: Any,
    model_dir: Path,
    loop: LoopThread,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from vllm import SamplingParams

    from weightsync.demo.trainer import Trainer, TrainerConfig, probe_prompt_tokens
    from weightsync.impl.engine.controller import update_round
    from weightsync.vllm_tools.checked import checked_async_llm
    from weightsync.vllm_tools.models import checkpoint_state
    from weightsync.vllm_tools.serving import connect_trainer, start_async_llm

    llm, start_s = start_async_llm(
        loop, model_dir, dp=2, max_num_seqs=max(16, cfg.prompts_per_step * cfg.group_size), seed=cfg.seed
    )
    say(f"AsyncLLM(data_parallel_size=2) of the {'MoE' if cfg.moe else 'dense'} policy up in {start_s:.1f} s")
    task = DigitPatternTask(seed=cfg.seed)
    trainer = Trainer(model, task, TrainerConfig(lr=cfg.lr))
    probes = probe_prompt_tokens()
    outcomes: dict[str, str] = {}
    n_req = [0]

    async def sample(prompt: Prompt, rank: int) -> Sample:
        n_req[0] += 1
        rid = f"rollout-{n_req[0]}"
        sp = SamplingParams(
            temperature=1.0,
            max_tokens=task.max_new_tokens,
            logprobs=0,
            seed=cfg.seed * 100_003 + n_req[0],
            ignore_eos=True,
            stop_token_ids=[EOS_ID],
            detokenize=False,
        )
        last = None
        async for out in llm.generate(
            {"prompt_token_ids": list(prompt.tokens)}, sp, rid, data_parallel_rank=rank
        ):
            last = out
        assert last is not None
        o = last.outputs[0]
        outcomes[rid] = str(o.finish_reason)
        toks = list(o.token_ids)
        lps = [float(d[t].logprob) for d, t in zip(o.logprobs or [], toks, strict=True)]
        return Sample(prompt, toks, lps)

    def submit(prompts: list[Prompt]) -> list[Any]:
        return [
            loop.spawn(sample(p, (i * cfg.group_size + g) % 2))
            for i, p in enumerate(prompts)
            for g in range(cfg.group_size)
        ]

    async def greedy_and_lp(prompt: list[int], rank: int) -> tuple[list[int], list[float]]:
        n_req[0] += 1
        g = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
        pl = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs: list[Any] = []
        for k, sp in enumerate((g, pl)):
            last = None
            async for o in llm.generate(
                {"prompt_token_ids": prompt}, sp, f"probe-{n_req[0]}-{k}", data_parallel_rank=rank
            ):
                last = o
            outs.append(last)
        tokens = list(outs[0].outputs[0].token_ids)
        lps = [float(d[t].logprob) for d, t in zip(outs[1].prompt_logprobs[1:], prompt[1:], strict=True)]
        return tokens, lps

    def check(version: str) -> dict[str, Any]:
        want_g, want_lp = _trainer_reference(model, probes)

        async def every() -> list[Any]:
            return list(await asyncio.gather(*[greedy_and_lp(p, r) for r in (0, 1) for p in probes]))

        got = loop.run(every(), cfg.timeout_s)
        equal, worst = True, 0.0
        for k, (tokens, lps) in enumerate(got):
            j = k % len(probes)
            equal = equal and tokens == want_g[j]
            worst = max(worst, *(abs(a - b) for a, b in zip(lps, want_lp[j], strict=True)))
        versions = [
            str(v) for v in loop.run(llm.engine_core.call_utility_all_async("get_weight_version"), 60)
        ]
        return {
            "version": version,
            "greedy_equal": equal,
            "max_logprob_diff": worst,
            "weight_versions": versions,
        }

    syncs: list[dict[str, Any]] = []
    rewards: list[float] = []
    trainer_tr: Any = None
    authenticated = False
    try:
        # every controller and trainer call goes through CheckedEngine: weightsync's table (the default
        # variant) refuses an illegal call before vLLM sees it
        checked = checked_async_llm(llm, loop.loop, trace_path=checked_trace, timeout_s=cfg.timeout_s)
        trainer_tr = connect_trainer(
            llm,
            model,
            client=checked,
            timeout_s=cfg.timeout_s,
            moe_reload_fix=cfg.moe_reload_fix,
        )
        authenticated = bool(trainer_tr.authenticated)
        first = check(str(loop.run(llm.get_weight_version(), 60)))
        say(f"initial: greedy_equal={first['greedy_equal']} max_logprob_diff={first['max_logprob_diff']:.2e}")
        pending = submit(task.batch(cfg.prompts_per_step))
        for step in range(1, cfg.steps + 1):
            samples = [f.result(cfg.timeout_s) for f in pending]
            metrics = trainer.trainer_step(samples)
            rewards.append(float(metrics["reward_mean"]))
            pending = submit(task.batch(cfg.prompts_per_step))  # in flight across the sync
            ts = time.monotonic()
            in_flight = sum(1 for f in pending if not f.done())
            version = f"step-{step}"
            # the round is the spec's controller cycle (update_round: pause -> start -> the trainer's
            # update_weights -> finish(version) -> resume, and its failure policy), through CheckedEngine
            update_round(checked, trainer_tr, checkpoint_state(model), mode=cfg.mode, weight_version=version)
            rec = check(version)
            rec["in_flight"] = in_flight
            rec["seconds"] = round(time.monotonic() - ts, 3)
            syncs.append(rec)
            say(
                f"step {step}: reward {rewards[-1]:.3f}; sync {version} with {in_flight} requests in flight: "
                f"greedy_equal={rec['greedy_equal']} max_logprob_diff={rec['max_logprob_diff']:.2e} "
                f"versions={rec['weight_versions']}"
            )
        for f in pending:
            f.result(cfg.timeout_s)
    except Exception as exc:
        raise WeightSyncError(
            f"the vLLM demo failed at sync {len(syncs) + 1}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if trainer_tr is not None:
            trainer_tr.shutdown()
        shutdown_async_llm(llm, loop)
    lost = sum(1 for r in outcomes.values() if r not in IN_FLIGHT_FINISH[PauseMode(cfg.mode)])
    every = [first, *syncs]
    return {
        "engine": "vllm",
        "model": "tiny Mixtral (MoE)" if cfg.moe else "Llama (demo policy)",
        "mode": cfg.mode,
        "steps": cfg.steps,
        "syncs": syncs,
        "initial": first,
        "requests": len(outcomes),
        "lost_requests": lost,
        "max_logprob_diff": max(r["max_logprob_diff"] for r in every),
        "greedy_equal": all(r["greedy_equal"] for r in every),
        "weight_versions": [r["weight_versions"] for r in syncs],
        "versions_ok": all(r["weight_versions"] == [r["version"]] * 2 for r in syncs),
        "rewards": rewards,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "authenticated": authenticated,
    }


__all__ = ["MAX_LOGPROB_DIFF", "VllmDemoConfig", "run_vllm_demo"]
