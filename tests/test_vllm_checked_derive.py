"""The transitions :mod:`weightsync.vllm_tools.checked` derives from returned vLLM calls, on a scripted front-end
(no vLLM needed): every derived trace must replay on the tables and the model's composition, for one and
two DP ranks, every pause mode, refusals and failed rounds; refused calls never reach the front-end.
The same adapter runs against a real ``AsyncLLM`` in ``test_vllm_checked.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from weightsync.cli import main
from weightsync.impl.checked import CheckedEngine
from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError
from weightsync.spec.states import RankEvent
from weightsync.vllm_tools.checked import VLLMAdapter, VLLMCallError


class ScriptedFrontEnd(VLLMAdapter):
    """A front-end whose calls are recorded; ``unfinished`` per rank is what it reports; ``fail`` names the
    next call to raise."""

    def __init__(self, dp: int, unfinished: list[int] | None = None, lockstep: bool = True) -> None:
        super().__init__(dp, "default", lockstep=lockstep)
        self.sent: list[str] = []
        self.unfinished = unfinished or [0] * dp
        self.after_pause: list[int] | None = None
        self.fail: str | None = None
        self.paused = False
        self.version = "default"

    def _maybe_fail(self, name: str) -> None:
        self.sent.append(name)
        if self.fail == name:
            self.fail = None
            raise VLLMCallError(name, "scripted failure")

    def _vllm_pause(self, mode: str, clear_cache: bool, timeout: float) -> tuple[list[int], list[int]]:
        before = list(self.unfinished)
        self._maybe_fail("pause")
        self.paused = True
        if self.after_pause is not None:
            self.unfinished = list(self.after_pause)
        elif mode == "abort":
            self.unfinished = [0] * self.dp_size
        return before, list(self.unfinished)

    def _vllm_resume(self, timeout: float) -> None:
        self._maybe_fail("resume")
        self.paused = False

    def _vllm_call(self, event: RankEvent, payload: Any, timeout: float) -> None:
        self._maybe_fail(event.value)
        if event is RankEvent.FINISH_UPDATE and payload is not None:
            self.version = str(payload)

    def _unfinished(self, timeout: float) -> list[int]:
        return list(self.unfinished)

    def _is_paused(self, timeout: float) -> bool:
        return self.paused

    def get_weight_version(self) -> str:
        return self.version


def replay_ok(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = main(["replay", str(path), "--json"])
    out: dict[str, Any] = json.loads(capsys.readouterr().out)["traces"][0]
    assert code == 0, out
    return out


def round_(eng: CheckedEngine, mode: str, version: str) -> None:
    eng.pause(mode)
    eng.start_weight_update()
    eng.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    eng.update_weights({"names": ["b"], "dtype_names": ["float32"], "shapes": [[2]]})
    eng.finish_weight_update(weight_version=version)
    eng.resume()


_W = [("update_weights", "updating", {}), ("weight_broadcast_done", "updating", {})]

#: The transitions a keep round on one rank with two requests in flight must derive, written by hand from
#: vLLM 0.32 (not from the tables): pause(keep) freezes the requests (PAUSED_ALL: nothing schedulable, so
#: the step has no work and the DP sync counts no unfinished request, ``v1/core/sched/scheduler.py:2803``)
#: and verifies the pause; start/update/finish move no state but ``updating``; the resume barrier sees the two
#: kept requests again (``max_unfinished`` 1, ``v1/engine/core.py:2250-2273``) and the wave re-based to 1.
KEEP_DP1 = [
    ("pause", "paused", {}),
    ("step", "paused", {"has_work": False}),
    ("dp_sync_done", "verified", {"has_work": False, "sum_pending_pause": 1, "sum_unfinished": 0}),
    ("start_weight_update", "updating", {}),
    *_W,
    *_W,
    ("finish_weight_update", "updating", {}),
    ("finish_done", "verified", {}),
    ("resume", "resuming", {}),
    ("resume_barrier_done", "running", {"max_unfinished": 1, "max_wave": 1}),
]
#: The same for an abort round on two ranks (three requests on rank 0): each rank's transitions in
#: lockstep, the aborted requests gone by the resume barrier (``max_unfinished`` 0), both ranks' pending
#: pauses summed by the DP sync.
ABORT_DP2 = [
    (r, ev, st, args)
    for ev, st, args in [
        ("pause", "paused", {}),
        ("step", "paused", {"has_work": False}),
        ("dp_sync_done", "verified", {"has_work": False, "sum_pending_pause": 2, "sum_unfinished": 0}),
        ("start_weight_update", "updating", {}),
        *_W,
        *_W,
        ("finish_weight_update", "updating", {}),
        ("finish_done", "verified", {}),
        ("resume", "resuming", {}),
        ("resume_barrier_done", "running", {"max_unfinished": 0, "max_wave": 1}),
    ]
    for r in (0, 1)
]
_OUTCOME = ("has_work", "sum_unfinished", "sum_pending_pause", "max_unfinished", "max_wave")


def _derived(trace: Path) -> list[tuple[int, str, str, dict[str, Any]]]:
    recs = [json.loads(x) for x in trace.read_text().splitlines()[1:]]
    return [
        (
            r["rank"],
            r["event"],
            r["vars_after"]["state"],
            {k: v for k, v in r["args"].items() if k in _OUTCOME},
        )
        for r in recs
    ]


def test_derived_rounds_equal_hand_written_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The adapter's derived transitions against traces written by hand (above): replaying them on the
    tables alone could not fail on a wrong count or outcome the adapter derived, since the replay checks the
    adapter's own records against the same tables."""
    fe = ScriptedFrontEnd(1, unfinished=[2])
    fe.after_pause = [2]  # keep: the frozen requests stay
    eng = CheckedEngine(fe, trace_path=tmp_path / "keep.jsonl")
    round_(eng, "keep", "step-1")
    assert _derived(tmp_path / "keep.jsonl") == [(0, *x) for x in KEEP_DP1]
    fe = ScriptedFrontEnd(2, unfinished=[3, 0])  # abort: the front-end reports them gone
    eng = CheckedEngine(fe, trace_path=tmp_path / "abort.jsonl")
    round_(eng, "abort", "step-1")
    assert _derived(tmp_path / "abort.jsonl") == ABORT_DP2  # in lockstep: each event on rank 0, then 1
    assert eng.violations == []
    replay_ok(tmp_path / "abort.jsonl", capsys)  # and the model's composition accepts it


def test_illegal_calls_never_reach_the_front_end(tmp_path: Path) -> None:
    fe = ScriptedFrontEnd(2)
    eng = CheckedEngine(fe, trace_path=tmp_path / "t.jsonl")
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    with pytest.raises(LocalProtocolError, match="update_weights is illegal in state running"):
        eng.update_weights(info)
    with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state running"):
        eng.start_weight_update()
    eng.pause("keep")
    eng.start_weight_update()
    with pytest.raises(LocalProtocolError, match="start_weight_update is illegal in state updating"):
        eng.start_weight_update()
    with pytest.raises(LocalProtocolError, match="resume is illegal in state updating"):
        eng.resume()
    assert fe.sent == ["pause", "start_weight_update"]
    # the adapter checks on its own too (safe without CheckedEngine)
    with pytest.raises(LocalProtocolError, match="not sent to vLLM"):
        fe.start_weight_update()
    assert fe.sent == ["pause", "start_weight_update"]


def test_failed_round_is_a_table_event_and_refusals_stay_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fe = ScriptedFrontEnd(2)
    trace = tmp_path / "t.jsonl"
    eng = CheckedEngine(fe, trace_path=trace)
    eng.pause("abort")
    eng.start_weight_update()
    fe.fail = "update_weights"
    with pytest.raises(VLLMCallError):
        eng.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    assert {s["vars"]["state"] for s in fe.snapshot()} == {"failed"}
    sent = list(fe.sent)
    with pytest.raises(LocalProtocolError, match="refused in state failed"):
        eng.resume()  # a failed rank never serves partial weights
    with pytest.raises(LocalProtocolError, match="refused in state failed"):
        eng.finish_weight_update(weight_version="step-1")
    assert fe.sent == sent
    round_tail = [
        lambda: eng.start_weight_update(),
        lambda: eng.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}),
        lambda: eng.finish_weight_update(weight_version="step-1"),
        lambda: eng.resume(),
    ]
    for call in round_tail:  # a new round recovers the ranks
        call()
    assert fe.version == "step-1" and eng.violations == []
    out = replay_ok(trace, capsys)
    assert out["steps"] == len(fe.transitions)


def test_a_pause_that_raises_leaves_the_adapter_lost() -> None:
    fe = ScriptedFrontEnd(1)
    eng = CheckedEngine(fe)
    fe.fail = "pause"
    with pytest.raises(RemoteProtocolError, match="pause_generation raised"):
        eng.pause("keep")
    with pytest.raises(RemoteProtocolError, match="state is unknown"):
        eng.resume()
    assert fe.sent == ["pause"]


def test_a_version_vllm_does_not_report_is_a_divergence() -> None:
    fe = ScriptedFrontEnd(1)
    eng = CheckedEngine(fe)
    eng.pause("keep")
    eng.start_weight_update()
    eng.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    fe.get_weight_version = lambda: "stale"  # type: ignore[method-assign]
    with pytest.raises(RemoteProtocolError, match="reports version 'stale'"):
        eng.finish_weight_update(weight_version="step-1")
    with pytest.raises(ValueError, match="monotonic"):
        fe.finish_weight_update(weight_version="step-2", monotonic=True)


def test_dense_engines_are_worlds_of_one_and_take_an_init_after_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dense DP=2 (``lockstep=False``: vLLM 0.32 runs each engine of a dense model as an independent
    ``EngineCoreProc`` of DP size 1, ``v1/engine/core.py:1473-1482``): a keep round with two requests on
    engine 1 only derives each engine's own DP sync (its own pending pause, sum 1) and resume barrier (its
    own unfinished requests), and an ``init_weight_transfer_engine`` after the engines served reaches
    vLLM, as vLLM takes it (a lone engine has no init gate). The same calls on lockstep (MoE) engines:
    one sync of both pauses, and the init refused before vLLM sees it (guard ``alone_or_never_served``,
    patch 0008). Both traces replay on the tables and the model's composition."""
    dense = ScriptedFrontEnd(2, [0, 2], lockstep=False)
    eng = CheckedEngine(dense, trace_path=tmp_path / "dense.jsonl")
    assert [(m.rank, m.dp_size) for m in eng.machines] == [(0, 1), (0, 1)]
    round_(eng, "keep", "v1")
    syncs = [(r.rank, r.args["sum_pending_pause"]) for r in dense.transitions if r.event == "dp_sync_done"]
    assert syncs == [(0, 1), (1, 1)], syncs
    barriers = {
        r.rank: r.args["max_unfinished"] for r in dense.transitions if r.event == "resume_barrier_done"
    }
    assert barriers == {0: 0, 1: 1}, barriers
    eng.init_weight_transfer_engine({"master_port": 1})
    assert dense.sent[-1] == "init_weight_transfer_engine" and eng.violations == []
    out = replay_ok(tmp_path / "dense.jsonl", capsys)
    assert out["ranks"] == 2 and out["outcomes_checked"] == 4, out

    moe = ScriptedFrontEnd(2, [0, 2])
    eng = CheckedEngine(moe, trace_path=tmp_path / "moe.jsonl")
    round_(eng, "keep", "v1")
    syncs = [(r.rank, r.args["sum_pending_pause"]) for r in moe.transitions if r.event == "dp_sync_done"]
    assert syncs == [(0, 2), (1, 2)], syncs
    with pytest.raises(LocalProtocolError, match="init_weight_transfer_engine"):
        eng.init_weight_transfer_engine({"master_port": 1})
    assert "init_weight_transfer_engine" not in moe.sent
    replay_ok(tmp_path / "moe.jsonl", capsys)


def test_an_illegal_call_on_a_dense_engine_names_the_engine() -> None:
    """Each dense engine is rank 0 of its own world; an illegal call names the engine, not "rank 0"."""
    eng = CheckedEngine(ScriptedFrontEnd(2, lockstep=False))
    with pytest.raises(LocalProtocolError, match=r"engine 0 \(a DP world of one\)"):
        eng.start_weight_update()
