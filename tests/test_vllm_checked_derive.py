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

    def __init__(self, dp: int, unfinished: list[int] | None = None) -> None:
        super().__init__(dp, "default")
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


@pytest.mark.parametrize("dp", [1, 2])
def test_rounds_in_every_mode_replay(dp: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fe = ScriptedFrontEnd(dp, unfinished=[2, 1][:dp])
    trace = tmp_path / "t.jsonl"
    eng = CheckedEngine(fe, trace_path=trace)
    fe.after_pause = [2, 1][:dp]  # keep: frozen requests stay
    round_(eng, "keep", "step-1")
    fe.after_pause = [0] * dp  # wait: drained
    round_(eng, "wait", "step-2")
    fe.after_pause = None
    fe.unfinished = [3, 0][:dp]
    round_(eng, "abort", "step-3")
    assert eng.violations == []
    assert {s["vars"]["state"] for s in fe.snapshot()} == {"running"}
    out = replay_ok(trace, capsys)
    assert out["steps"] == len(fe.transitions) and out["outcomes_checked"] == 6  # 3 pauses, 3 resumes
    assert out["has_work_checked"] > 0 and out["notes"] == []
    recs = [json.loads(x) for x in trace.read_text().splitlines()[1:]]
    barrier = [r for r in recs if r["event"] == "resume_barrier_done"]
    assert [r["args"]["max_unfinished"] for r in barrier[::dp]] == [1, 0, 0]  # the kept requests resume
    assert {r["vars_after"]["weight_version"] for r in recs if r["event"] == "finish_done"} == {
        "step-1",
        "step-2",
        "step-3",
    }


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
