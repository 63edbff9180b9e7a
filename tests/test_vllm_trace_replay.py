"""A trace recorded from real vLLM 0.32 engines, replayed by the model (no engine is started here).

``tests/data/vllm-0.32-20-cycles/engine-{0,1}.jsonl.gz`` are the probe's logs (:mod:`weightsync.vllm_tools.probe`)
of ``weightsync record --engine vllm --cycles 20 --seed 0``: a real ``AsyncLLM(data_parallel_size=2)`` of a
tiny Mixtral, 20 pause (random mode) / weight round / resume cycles with random requests on both DP ranks.
``tests/test_vllm_race.py`` records a fresh one on real vLLM (slow); this module replays the checked-in one.

- The whole trace is accepted by ``weightsync replay --variant vllm-0.32``: every event an edge of the
  table, vLLM's own variables equal to the table's after (or before) each, every DP collective entered by
  both ranks and its outcome equal to the model's arithmetic from the members' states.
- One recorded engine event corrupted -> rejected at the line that event became (a collective's outcome:
  at its first completion line, where the shared outcome is checked), with the reason: an unpaused engine
  that ignores a START_DP_WAVE; a sync whose pause count is off; a resume barrier that left a rank with
  requests idle; a pause recorded as a resume.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from weightsync.cli import main
from weightsync.impl.trace_replay import replay_trace
from weightsync.model.replay import TraceChecker
from weightsync.vllm_tools.trace import to_replay_trace

DATA = Path(__file__).parent / "data" / "vllm-0.32-20-cycles"


def _events() -> dict[int, list[dict[str, Any]]]:
    out = {}
    for r in (0, 1):
        with gzip.open(DATA / f"engine-{r}.jsonl.gz", "rt", encoding="utf-8") as f:
            out[r] = [json.loads(x) for x in f if x.strip()]
    return out


@pytest.fixture(scope="module")
def events() -> dict[int, list[dict[str, Any]]]:
    return _events()


def _replay(events: dict[int, list[dict[str, Any]]], path: Path) -> tuple[Any, TraceChecker, list[str]]:
    to_replay_trace(events, path)
    checker = TraceChecker()
    return replay_trace(path, checker, variant="vllm-0.32"), checker, path.read_text().splitlines()


def test_the_real_trace_is_accepted(
    events: dict[int, list[dict[str, Any]]], tmp_path: Path, capsys: Any
) -> None:
    res, checker, lines = _replay(events, tmp_path / "t.jsonl")
    assert res.ok, res.divergence
    assert res.steps == len(lines) - 1 > 1000
    assert res.collectives > 100 and checker.outcomes_checked > 40 and checker.has_work_checked > 100
    kinds = {json.loads(x).get("event") for x in lines[1:]}
    assert {"pause", "resume", "START_DP_WAVE", "ADD", "dp_sync_done", "resume_barrier_done"} <= kinds
    assert {"start_weight_update", "update_weights", "finish_done"} <= kinds
    modes = {json.loads(x)["args"]["mode"] for x in lines[1:] if json.loads(x).get("event") == "pause"}
    assert modes == {"keep", "wait", "abort"}
    assert main(["replay", "--variant", "vllm-0.32", str(tmp_path / "t.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def _first(events: dict[int, list[dict[str, Any]]], pred: Any) -> tuple[int, int]:
    for r in (0, 1):
        for i, rec in enumerate(events[r]):
            if pred(rec):
                return r, i
    raise AssertionError("no such record")


CORRUPTIONS = [
    (
        "an engine that ignores a START_DP_WAVE it must take",
        lambda rec: (
            rec["ev"] == "START_DP_WAVE" and rec["vllm"]["engines_running"] and not rec["vllm"]["pause_state"]
        ),
        lambda rec: rec["vllm"].update(engines_running=False),
        "START_DP_WAVE",
        "engines_running: engine False, table True",
    ),
    (
        "a sync whose pause count is off",
        lambda rec: rec["ev"] == "step_done" and rec["synced"] and rec["pending_pause"],
        lambda rec: rec.update(pending_pause=False),
        "dp_sync_done",
        "sum_pending_pause",
    ),
    (
        "a resume barrier that left a rank with requests idle",
        lambda rec: rec["ev"] == "resume_done" and rec["barrier"] and rec["vllm"]["engines_running"],
        lambda rec: rec["vllm"].update(engines_running=False),
        "resume_barrier_done",
        "engines_running: engine False, table True",
    ),
    (
        "a pause recorded as a resume",
        lambda rec: rec["ev"] == "pause",
        lambda rec: rec.update(ev="resume"),
        "resume",
        "",
    ),
]


@pytest.mark.parametrize(
    ("name", "pick", "corrupt", "event", "reason"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS]
)
def test_one_corrupted_engine_event_is_rejected_at_its_line(
    events: dict[int, list[dict[str, Any]]],
    tmp_path: Path,
    name: str,
    pick: Any,
    corrupt: Any,
    event: str,
    reason: str,
) -> None:
    bad = copy.deepcopy(events)
    r, i = _first(bad, pick)
    corrupt(bad[r][i])
    res, _, lines = _replay(bad, tmp_path / "bad.jsonl")
    assert not res.ok, name
    d = res.divergence
    assert d is not None
    t = float(bad[r][i]["t"])
    recs = [json.loads(x) for x in lines]
    want = [k + 1 for k, x in enumerate(recs) if k > 0 and (x["rank"], x["event"], x["t"]) == (r, event, t)]
    assert len(want) == 1, (name, want)
    line = want[0]
    if event.endswith("_done") and "sum_" in reason:  # the shared outcome: checked at its first completion
        seq = recs[line - 1]["coll_seq"]
        line = min(
            k + 1 for k, x in enumerate(recs) if k > 0 and x["event"] == event and x["coll_seq"] == seq
        )
    assert d.line == line, (name, line, d.describe())
    assert reason in d.reason, d.describe()
