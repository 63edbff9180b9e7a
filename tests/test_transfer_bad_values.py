"""Bad values through the real transports, in real processes (gloo on 127.0.0.1 / CPU shared memory).

1. Tied embeddings: a trainer sending a tied Hugging Face model's ``state_dict()`` (which lists
   ``lm_head.weight`` besides ``model.embed_tokens.weight``) is accepted when the two are bit-equal, and the
   engine then produces the HF model's logits and greedy tokens exactly; an ``lm_head.weight`` that differs
   is refused with TiedWeightMismatchError on the engine (PeerFailedError on the trainer) and leaves every
   engine parameter as it was, although the update spans several buckets.
2. Non-finite weights: with ``update_info['check_finite']=True`` a NaN/Inf is refused before it is loaded,
   naming the weight and the count; with the check off (the default) it is accepted and served.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transfer_procs import (
    DictModel,
    bytes_equal,
    free_port,
    init_info,
    make_tensors,
    model_spec,
    run_roles,
    update_info_for,
)
from transfer_procs import ok as ok_result

from weightsync.impl.models.causal_lm import CausalLM
from weightsync.impl.models.config import LMConfig
from weightsync.impl.models.generate import generate
from weightsync.impl.models.sampling import SamplingParams
from weightsync.impl.transfer.base import ParallelInfo
from weightsync.impl.transfer.broadcast import BroadcastTrainer
from weightsync.impl.transfer.ipc import IPCTrainer
from weightsync.impl.transfer.worker import WeightTransferWorker

pytestmark = pytest.mark.timeout(180)
#: the trainer's transport endpoint of each backend (the data plane of ``send_weights``)
TRAINERS: dict[str, Any] = {"nccl": BroadcastTrainer, "ipc": IPCTrainer}
# 8 KiB buckets: the tied model's 2 x 8 KiB embedding travels alone, the rest in several packed buckets
PACKING = {"packed": True, "packed_buffer_size_bytes": 8192, "packed_num_buffers": 2}
IDS = [[1, 5, 9, 2, 33, 7, 12, 60]]
BAD_ROW, BAD_COL, BAD_DELTA = 3, 7, 0.25
NAN_NAME = "model.layers.1.mlp.down_proj.weight"


def _hf(seed: int) -> Any:
    """A tied Qwen2 (vocab 64, hidden 32, 2 layers) with N(0, 0.1) weights from ``seed``, float32."""
    cfg = transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM._from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _state_dict(
    seed: int, bad_lm_head: bool = False, nan: bool = False, lm_head: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """``_hf(seed).state_dict()`` in its order (``lm_head.weight`` last; left out unless ``lm_head``);
    ``bad_lm_head`` replaces ``lm_head.weight`` by the embedding plus ``BAD_DELTA`` at one element; ``nan``
    puts two NaN and one +Inf into ``NAN_NAME``."""
    sd = [
        (n, t.detach().clone()) for n, t in _hf(seed).state_dict().items() if lm_head or n != "lm_head.weight"
    ]
    out = []
    for name, t in sd:
        if bad_lm_head and name == "lm_head.weight":
            t[BAD_ROW, BAD_COL] += BAD_DELTA
        if nan and name == NAN_NAME:
            t[0, 0] = float("nan")
            t[5, 1] = float("nan")
            t[7, 3] = float("inf")
        out.append((name, t))
    return out


def _lm_config() -> dict[str, Any]:
    return dict(_hf(0).config.to_dict())


def _hf_outputs(seed: int) -> dict[str, Any]:
    """The trainer model's logits on ``IDS`` and its 6 greedy tokens (full forwards, no cache)."""
    hf = _hf(seed)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = hf(ids).logits[0]
        toks = list(IDS[0])
        for _ in range(6):
            toks.append(int(hf(torch.tensor([toks])).logits[0, -1].argmax()))
    return {"logits": logits, "tokens": toks[len(IDS[0]) :]}


def _engine_outputs(lm: CausalLM) -> dict[str, Any]:
    logits = lm.forward_full(torch.tensor(IDS))[0]
    out = generate(lm, [(IDS[0], SamplingParams(temperature=0.0, max_new_tokens=6))])[0]
    return {"logits": logits, "tokens": out.tokens}


def _parts(pairs: list[tuple[str, torch.Tensor]], split: bool) -> list[list[tuple[str, torch.Tensor]]]:
    """The round's ``update_weights`` calls: one, or (``split``) ``lm_head.weight`` alone, then the rest."""
    if not split:
        return [pairs]
    return [[p for p in pairs if p[0] == "lm_head.weight"], [p for p in pairs if p[0] != "lm_head.weight"]]


def _err(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


# ---------------------------------------------------------------------------------------------- roles


def trainer_rounds(port: int, backend: str, rounds: list[dict[str, Any]]) -> list[Any]:
    """Send each round's state dict; one entry per round: "sent" or [error type, message]."""
    tr = TRAINERS[backend](init_info(port, 2, **PACKING))
    out: list[Any] = []
    try:
        for r in rounds:
            try:
                for part in _parts(_state_dict(**r["weights"]), r.get("split", False)):
                    tr.send(iter(part))
                out.append("sent")
            except Exception as exc:
                out.append(_err(exc))
                break
    finally:
        tr.close()
    return out


def engine_rounds(port: int, backend: str, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tied CausalLM engine worker; per round: error (or None), outputs, parameters, version."""
    lm = CausalLM(LMConfig.from_hf_dict(_lm_config()))
    kw: dict[str, Any] = {"device": "cpu"} if backend == "ipc" else {}
    w = WeightTransferWorker(lm, backend, ParallelInfo(dp_index=0), **kw)
    w.init_weight_transfer_engine(init_info(port, 2, **PACKING))
    out: list[dict[str, Any]] = []
    for r in rounds:
        pairs = _state_dict(**r["weights"])
        res: dict[str, Any] = {"error": None, "finish_error": None}
        w.start_weight_update()
        try:
            for part in _parts(pairs, r.get("split", False)):
                w.update_weights(update_info_for(part, **r.get("extra", {})))
        except Exception as exc:
            res["error"] = _err(exc)
        try:
            w.finish_weight_update()
        except Exception as exc:
            res["finish_error"] = _err(exc)
            res["missing"] = list(getattr(exc, "missing", ()))
        res["version"] = w.weight_version
        res["params"] = {n: p.detach().clone() for n, p in lm.named_parameters()}
        res.update(_engine_outputs(lm))
        out.append(res)
        if res["error"] is not None:
            break
    return out


def _run(backend: str, rounds: list[dict[str, Any]]) -> tuple[list[Any], list[dict[str, Any]]]:
    port = free_port()
    res = run_roles([(trainer_rounds, (port, backend, rounds)), (engine_rounds, (port, backend, rounds))])
    return ok_result(res[0]), ok_result(res[1])


# ---------------------------------------------------------------------------------------- tied embeddings


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_tied_lm_head_equal_is_accepted_and_serves_the_trainers_outputs(backend: str) -> None:
    sent, rounds = _run(backend, [{"weights": {"seed": 1}}, {"weights": {"seed": 2}}])
    assert sent == ["sent", "sent"]
    for seed, r in zip((1, 2), rounds, strict=True):
        assert r["error"] is None and r["finish_error"] is None
        ref = _hf_outputs(seed)
        assert torch.equal(r["logits"], ref["logits"]), (r["logits"] - ref["logits"]).abs().max()
        assert r["tokens"] == ref["tokens"]
    assert rounds[-1]["version"] == 2


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_tied_lm_head_differing_is_refused_and_changes_no_parameter(backend: str) -> None:
    sent, rounds = _run(backend, [{"weights": {"seed": 1}}, {"weights": {"seed": 2, "bad_lm_head": True}}])
    good, bad = rounds
    assert good["error"] is None and good["version"] == 1
    embed = dict(_state_dict(2))["model.embed_tokens.weight"]
    lm_head = dict(_state_dict(2, bad_lm_head=True))["lm_head.weight"]
    want = float((lm_head.double() - embed.double()).abs().max())
    assert abs(want - BAD_DELTA) < 1e-6
    msg = (
        "load_weights: lm_head.weight refused: tied embeddings: lm_head.weight must equal "
        "model.embed_tokens.weight (tie_word_embeddings=True; the model keeps one tensor for both), but 1 of "
        f"2048 element(s) differ bitwise, max abs difference {want:.6g} (compared with the "
        "model.embed_tokens.weight received in the same call); nothing of this load_weights call was loaded"
    )
    assert bad["error"] == ["TiedWeightMismatchError", msg]
    # the trainer learns it in the same round: the engine's status failed the update everywhere
    assert sent[0] == "sent" and sent[1][0] == "PeerFailedError"
    assert "rank(s) 1 failed" in sent[1][1] and "TiedWeightMismatchError" in sent[1][1]
    # nothing of the refused round reached a parameter (it spanned several buckets), version unchanged,
    # and the round cannot finish
    assert bad["params"].keys() == good["params"].keys()
    assert all(torch.equal(bad["params"][n], good["params"][n]) for n in good["params"])
    assert bad["version"] == 1 and bad["finish_error"][0] == "IncompleteUpdateError"
    assert torch.equal(bad["logits"], _hf_outputs(1)["logits"])


def test_tied_lm_head_sent_before_its_embedding_in_an_earlier_call_is_held_then_checked() -> None:
    """Worker rule 3a across ``update_weights`` calls: ``lm_head.weight`` alone in the round's first call is
    held (nothing to compare with yet); the second call, carrying the embedding, is checked with it."""
    split = {"split": True}
    sent, rounds = _run(
        "nccl",
        [{"weights": {"seed": 1}, **split}, {"weights": {"seed": 2, "bad_lm_head": True}, **split}],
    )
    good, bad = rounds
    assert sent[0] == "sent" and good["error"] is None and good["finish_error"] is None
    ref = _hf_outputs(1)
    assert torch.equal(good["logits"], ref["logits"]) and good["tokens"] == ref["tokens"]
    assert bad["error"][0] == "TiedWeightMismatchError"
    assert "(compared with the model.embed_tokens.weight received in the same call)" in bad["error"][1]
    assert all(torch.equal(bad["params"][n], good["params"][n]) for n in good["params"])
    assert bad["version"] == 1 and sent[1][0] == "PeerFailedError"


# ----------------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_non_finite_weight_refused_with_check_on_and_served_with_check_off(backend: str) -> None:
    # without the tied alias (as iter_checkpoint_weights sends), so batches load as they arrive
    rounds = [
        {"weights": {"seed": 1, "lm_head": False}, "extra": {"check_finite": True}},  # finite: passes
        {"weights": {"seed": 2, "nan": True, "lm_head": False}},  # check off (default): accepted, served
        {"weights": {"seed": 3, "nan": True, "lm_head": False}, "extra": {"check_finite": True}},  # refused
    ]
    sent, res = _run(backend, rounds)
    clean, served, refused = res
    assert clean["error"] is None and clean["version"] == 1
    assert torch.equal(clean["logits"], _hf_outputs(1)["logits"])
    # documented behaviour with the check off: the NaN/Inf weight is loaded and served
    assert served["error"] is None and served["finish_error"] is None and served["version"] == 2
    down = served["params"][NAN_NAME]
    assert int((~torch.isfinite(down)).sum()) == 3
    assert bool(torch.isnan(served["logits"]).any())
    # check on: refused before loading, naming the weight, the count and the rule
    msg = (
        "update_weights: check_finite=True: every floating-point weight must be finite (no NaN, +Inf or "
        f"-Inf) before it is loaded, but 1 weight(s) are not: '{NAN_NAME}' has 3 non-finite element(s) of "
        "2048; nothing of this batch was loaded, and this round cannot finish"
    )
    assert refused["error"] == ["NonFiniteWeightError", msg]
    assert sent[:2] == ["sent", "sent"] and sent[2][0] == "PeerFailedError" and msg in sent[2][1]
    assert refused["version"] == 2 and refused["finish_error"][0] == "IncompleteUpdateError"
    # buckets before the refused one were loaded (finite round-3 values), the refused one and later not
    assert NAN_NAME in refused["missing"] and "model.embed_tokens.weight" not in refused["missing"]
    embed3 = dict(_state_dict(3))["model.embed_tokens.weight"]
    assert torch.equal(refused["params"]["model.embed_tokens.weight"], embed3)
    # the refused round's NaN/Inf never reached the parameter: it still holds round 2's bytes
    assert bytes_equal(refused["params"][NAN_NAME], down)


# -------------------------------------------------- kernel format: in-place receive is off under the check


def trainer_kernel(port: int, pairs_nan: bool) -> list[Any]:
    tr = BroadcastTrainer(init_info(port, 2))
    try:
        tr.send(iter(_kernel(pairs_nan)))
        return ["sent"]
    except Exception as exc:
        return _err(exc)
    finally:
        tr.close()


def _kernel(nan: bool) -> list[tuple[str, torch.Tensor]]:
    pairs = [(n.replace(".", "__"), t.contiguous()) for n, t in make_tensors(1)]
    if nan:
        big = dict(pairs)["model__big__weight"]
        big[10, 10] = float("nan")
    return pairs


def engine_kernel(port: int) -> dict[str, Any]:
    model = DictModel(model_spec())
    w = WeightTransferWorker(model, "nccl")
    w.init_weight_transfer_engine(init_info(port, 2, is_checkpoint_format=False))
    w.start_weight_update()
    try:
        w.update_weights(update_info_for(_kernel(True), check_finite=True))
        error = None
    except Exception as exc:
        error = _err(exc)
    return {"error": error, "weights": model.weights()}


def test_kernel_format_with_check_finite_never_receives_non_finite_into_a_parameter() -> None:
    """Unpacked kernel-format broadcast normally lands each tensor straight in its parameter (broadcast
    rule 5); with ``check_finite`` the worker turns that off, so the refused NaN is not in the model."""
    port = free_port()
    res = run_roles([(trainer_kernel, (port, True)), (engine_kernel, (port,))])
    sent, eng = ok_result(res[0]), ok_result(res[1])
    assert sent[0] == "PeerFailedError"
    assert eng["error"][0] == "NonFiniteWeightError"
    assert "'model__big__weight' has 1 non-finite element(s) of 32000" in eng["error"][1]
    big = eng["weights"]["model.big.weight"]
    assert bool(torch.isfinite(big).all()) and not big.any()  # still the zero init
