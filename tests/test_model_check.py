"""The weightsync model: the fix verifies, every historical variant yields its counterexample."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

from weightsync.cli import main
from weightsync.model.check import check, check_mode
from weightsync.model.engines import explore_model
from weightsync.model.explorer import explore
from weightsync.model.export import counterexample_mermaid, state_graph
from weightsync.model.labels import replay_labels
from weightsync.model.mutation import mutants, mutation_guards
from weightsync.model.properties import PROGRESS, PROPERTIES
from weightsync.model.system import Bounds, Config, Model
from weightsync.spec.rank import get_variant
from weightsync.spec.states import PauseMode


def _all_hold(out: dict[str, object]) -> bool:
    props = out["properties"]
    assert isinstance(props, dict)
    return all(v == "holds" for v in props.values())


def test_two_phase_epoch_n2_verifies_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--variant", "two-phase-epoch", "--ranks", "2", "--mode", "all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["verdict"] == "verified"
    assert _all_hold(out)
    assert set(out["properties"]) == set(PROPERTIES)
    assert out["symmetry"] is False
    for key in (
        "variant",
        "ranks",
        "states",
        "transitions",
        "depth",
        "seconds",
        "bounds",
        "channels",
        "mode",
    ):
        assert key in out


def test_two_phase_ordered_channels_n2_violates_only_wait_drains() -> None:
    """Ordered channels close PR #39366's resume-time race; what is left is its wait-mode pause, which leaves
    a request queued before it queued (issue 24), and only under wait."""
    for mode in (PauseMode.KEEP, PauseMode.ABORT):
        out = check("two-phase", 2, mode=mode, channels="ordered", bounds=Bounds(requests=1))
        assert out["verdict"] == "verified" and _all_hold(out), mode
    out = check("two-phase", 2, mode=PauseMode.WAIT, channels="ordered", bounds=Bounds(requests=1))
    props = out["properties"]
    assert isinstance(props, dict)
    assert {k for k, v in props.items() if v == "violated"} == {"wait_drains"}


def _steps(variant: str) -> tuple[dict[str, object], str]:
    out = check(variant, 2)
    assert out["verdict"] == "counterexample"
    cx = out["counterexample"]
    assert isinstance(cx, dict)
    return cx, "\n".join(cx["steps"])


def test_front_end_pause_blog_deadlock() -> None:
    cx, text = _steps("front-end-pause")
    assert cx["property"] == "collectives_match"
    assert "applies pause" in text and "enters weight_broadcast" in text
    assert "rank 0 in dp_step, rank 1 in weight_broadcast" in text


def test_idle_fast_path_late_wave_rearms_paused_rank() -> None:
    cx, text = _steps("idle-fast-path")
    assert cx["property"] == "collectives_match"
    assert "pause_abort_idle" in text or "pause_idle_fast_path" in text
    assert "receives START_DP_WAVE(wave=0, exclude=0) (wave_for_me_not_ignoring: verified->verified" in text
    assert "weight_broadcast" in text and "dp_step" in text


def test_ignore_wave_working_rank_waits_forever() -> None:
    cx, text = _steps("ignore-wave")
    assert cx["property"] == "no_one_sided_collective"
    assert "blocked: rank 0 in dp_step" in text


def test_two_phase_resume_time_race_per_socket() -> None:
    cx, text = _steps("two-phase")
    assert cx["property"] == "no_one_sided_collective"
    assert "(wave_dropped: verified->verified)" in text
    assert "complete resume_barrier(max_unfinished=0" in text
    assert text.splitlines()[-1].endswith("rank 0 running, rank 1 running")


def test_counterexample_replays_and_renders(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--variant", "two-phase", "--ranks", "2", "--mode", "keep", "--json"])
    assert code == 1
    cx = json.loads(capsys.readouterr().out)["counterexample"]
    model = Model(Config("two-phase", 2, PauseMode.KEEP))
    states, bad = replay_labels(model, cx["labels"])
    assert bad is None and len(states) == len(cx["labels"]) + 1
    assert model.terminal_check(states[-1]) == ["no_one_sided_collective"]
    mmd = counterexample_mermaid(cx, 2, title="two-phase N=2")
    assert mmd.splitlines()[1] == "sequenceDiagram"
    for lane in ("controller", "frontend", "coordinator", "trainer", "rank0", "rank1"):
        assert f"participant {lane} as" in mmd
    assert "Note over rank0" in mmd


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--variant", "nope", "--json"]) == 2
    assert main(["check", "--ranks", "0", "--json"]) == 2
    assert main(["check", "--mode", "bogus"]) == 2
    capsys.readouterr()


def test_variants_lists_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["variants", "--json"]) == 0
    names = {v["name"] for v in json.loads(capsys.readouterr().out)["variants"]}
    assert names == {
        "two-phase-epoch",
        "two-phase",
        "front-end-pause",
        "idle-fast-path",
        "ignore-wave",
        "vllm-0.32",
        "vllm-0.32-epoch",
    }


def test_symmetry_canon_is_sound_and_reduces() -> None:
    m = Model(Config("two-phase-epoch", 3, PauseMode.KEEP, bounds=Bounds(requests=1)))
    ex = explore([m.initial()], m.successors, max_states=4000)
    for s in ex.states[::7]:
        c = m.canon(s)
        assert m.canon(c) == c  # idempotent
        assert sorted(map(repr, (r.vars for r in c.ranks))) == sorted(map(repr, (r.vars for r in s.ranks)))
        assert c.ranks[0] == s.ranks[0] or c.ranks[0].vars == s.ranks[0].vars  # rank 0 stays fixed
        assert m.invariant(c) == m.invariant(s)
    # It reduces: a request sent to rank 1 and one sent to rank 2 are one orbit (rank 0, which reports the
    # wave, stays apart), and the states the plain search finds fall into fewer orbits. The former check
    # (``sym.depth >= plain.depth``) also held for a canon that reduced nothing.
    succ = dict(m.successors(m.initial()))
    to1, to2, to0 = succ[("send", 1)], succ[("send", 2)], succ[("send", 0)]
    assert to1 != to2 and m.canon(to1) == m.canon(to2) != m.canon(to0)
    plain = explore([m.initial()], m.successors, max_states=3000)
    orbits = {m.canon(s) for s in plain.states}
    assert len(orbits) < 0.6 * len(plain.states)  # measured: 3000 states, 1615 orbits
    sym = explore([m.initial()], m.successors, canon=m.canon, max_states=3000)
    assert all(m.canon(s) == s for s in sym.states[::50])  # the reduced search keeps representatives


def test_symmetry_finds_the_same_bug() -> None:
    m = Model(Config("two-phase", 3, PauseMode.KEEP, bounds=Bounds(requests=1)))
    r = check_mode(m, symmetry=True, stop_at_first=True)
    assert r.counterexample is not None
    assert r.properties["progress_pause"] == "not checked"
    assert "one-sided collective" in r.counterexample["steps"][-1]
    # the concretized path replays on the unreduced model
    states, bad = replay_labels(m, r.counterexample["labels"])
    assert bad is None and m.terminal_check(states[-1]) == ["no_one_sided_collective"]


def test_state_graph_graphml(tmp_path: Path) -> None:
    import networkx as nx

    g = state_graph("two-phase-epoch", 2, "keep", bounds=Bounds(requests=0))
    assert g.number_of_nodes() > 10 and g.number_of_edges() >= g.number_of_nodes() - 1
    nx.write_graphml(g, tmp_path / "g.graphml")
    assert (tmp_path / "g.graphml").stat().st_size > 0


def test_vllm_032_resume_time_race_n2(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.32 as shipped: the resume-time race is still there (``v1/engine/core.py:2250-2273``: no rank
    re-bases ``current_wave``)."""
    code = main(["check", "--variant", "vllm-0.32", "--ranks", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["verdict"] == "counterexample"
    assert out["seconds"] < 60
    cx = out["counterexample"]
    assert cx["property"] == "no_one_sided_collective"
    text = "\n".join(cx["steps"])
    assert "(wave_dropped: verified->verified)" in text  # the wake-up one rank drops while verified ...
    assert "complete resume_barrier(max_unfinished=0, max_wave=1)" in text  # ... the resume does not re-base
    assert "(wave_for_me_not_ignoring: running->running" in text  # ... and its peer takes after the resume
    assert "k1_step_sync" in text  # vLLM 0.32 syncs at the wave's first step
    assert cx["steps"][-1].endswith("blocked: rank 0 in dp_sync; rank 0 running, rank 1 running")
    model = Model(Config("vllm-0.32", 2, PauseMode(cx["mode"])))
    states, bad = replay_labels(model, cx["labels"])
    assert bad is None and model.terminal_check(states[-1]) == ["no_one_sided_collective"]


def test_vllm_032_second_pause_during_update_mismatches_collectives() -> None:
    out = check("vllm-0.32", 2, bounds=Bounds(requests=0, pause_during_update=True))
    cx = out["counterexample"]
    assert cx["property"] == "collectives_match"
    text = "\n".join(cx["steps"])
    assert "pause_abort: verified->paused" in text  # a second pause re-enters phase 1 (core.py:2216-2231)
    assert "worker_active: paused->paused; enters weight_broadcast" in text  # no engine gate on the update
    assert "dp_sync, rank 1 in weight_broadcast" in cx["steps"][-1]


def test_vllm_032_resume_during_update_serves_partial_weights() -> None:
    out = check("vllm-0.32", 2, mode="keep", bounds=Bounds(resume_during_update=True))
    assert out["properties"]["no_partial_serving"] == "violated"
    assert out["properties"]["collectives_match"] == "violated"
    assert out["violations"]["keep"]["no_partial_serving"] == 17


@pytest.mark.parametrize("channels", ["per-socket", "one-api-server"])
def test_vllm_032_epoch_n2_verifies(channels: str) -> None:
    out = check("vllm-0.32-epoch", 2, channels=channels)
    assert out["verdict"] == "verified" and _all_hold(out), out["properties"]


def test_vllm_032_epoch_refuses_a_second_pause_during_an_update() -> None:
    out = check("vllm-0.32-epoch", 2, mode="keep", bounds=Bounds(requests=0, pause_during_update=True))
    props = dict(out["properties"])
    assert props.pop("sometimes_update_with_wave_in_flight") == "violated"  # no request, so no wave: vacuous
    assert set(props.values()) == {"holds"}, props


def test_one_api_server_channels_order_requests_and_calls() -> None:
    m = Model(Config("vllm-0.32", 2, PauseMode.KEEP, "one-api-server"))
    s = m.initial()
    assert len(s.ranks[0].inq) == 2  # ADD/ABORT/utility calls, and START_DP_WAVE
    (_, s1), *_ = [(lab, t) for lab, t in m.successors(s) if lab == ("send", 0)]
    (_, s2), *_ = [(lab, t) for lab, t in m.successors(s1) if lab[0] == "fan"]
    assert [msg[0] for msg in s2.ranks[0].inq[0]] == ["ADD", "U"]
    with pytest.raises(ValueError, match="one-api-server"):
        Model(Config("vllm-0.32", 2, PauseMode.KEEP, "bogus"))


def test_stranded_states_tell_hangs_from_stalls() -> None:
    """vLLM 0.32 with one request: the race strands rank 0 in a DP collective with nothing left that could
    free it (a hang, no stall); the fix leaves no state from which a DP collective cannot complete."""
    race = check("vllm-0.32", 2, mode="keep", stalls=True)
    assert race["stranded"]["hang"] > 0 and race["stranded"]["stall"] == 0
    assert race["properties"]["progress_requests"] == "violated"
    fix = check("vllm-0.32-epoch", 2, mode="keep", stalls=True)
    assert fix["verdict"] == "verified"
    assert fix["stranded"]["hang"] == 0 and fix["stranded"]["stall"] == 0
    assert fix["stranded"]["transient"] > 0  # ranks do wait in collectives, briefly
    # the text output says them too (it printed nothing of them before)
    from weightsync.cli.check import print_human

    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_human(race)
    text = " ".join(out.getvalue().split())
    assert f"{race['stranded']['hang']:,} hangs" in text and "0 stalls" in text, text


def test_progress_run_catches_a_call_refused_and_retried_forever() -> None:
    """A table whose init gate refuses every init (the negated guard ``alone_or_never_served``) leaves no
    deadlock and no call outstanding: the controller retries the refused init forever. Only
    ``progress_run`` (the controller's run can always end) sees it; the unmutated table satisfies it."""
    table = get_variant("two-phase-epoch").table
    (gate,) = [t2 for m, t2 in mutants(table) if m.kind == "guard" and m.what == "alone_or_never_served"]
    bounds = Bounds(requests=0, init_transfer=True)
    shipped = check_mode(Model(Config("two-phase-epoch", 2, PauseMode.KEEP, bounds=bounds)))
    assert shipped.properties["progress_run"] == "holds", shipped.properties
    refused = check_mode(
        Model(
            Config("two-phase-epoch", 2, PauseMode.KEEP, bounds=bounds), table=gate, guards=mutation_guards()
        )
    )
    bad = {n for n, v in refused.properties.items() if v == "violated" and not n.startswith("sometimes_")}
    assert bad == {"progress_run"}, refused.properties


def test_a_stopped_exploration_is_complete_to_levels_expanded() -> None:
    """An exploration stopped early (here by ``max_states``) reports ``levels_expanded`` = L: every state of
    the full exploration within L + 1 steps of the initial state is among the stopped one's states, at the
    same BFS level, and every state within L steps was expanded (its edges counted): the bounded verdict
    ``weightsync check --max-seconds`` prints. A complete exploration reports its depth."""
    model = Model(Config("two-phase-epoch", 2, PauseMode.KEEP))
    full = explore_model(model, engine="baseline")
    assert full.complete and full.levels_expanded == full.depth
    part = explore_model(model, engine="baseline", max_states=len(full.states) // 3)
    assert not part.complete
    low = part.levels_expanded
    assert 2 < low < full.depth - 1
    within = [(s, full.level[i]) for i, s in enumerate(full.states) if full.level[i] <= low + 1]
    assert all(part.index.get(s) is not None and part.level[part.index[s]] == lv for s, lv in within)
    expanded_edges = sum(len(model.successors(s)) for s, lv in within if lv <= low)
    assert expanded_edges <= part.transitions < full.transitions
    # the compact engine stops at the same place
    compact = explore_model(model, max_states=len(full.states) // 3)
    assert (compact.levels_expanded, len(compact.states)) == (low, len(part.states))


def test_check_past_its_deadline_gives_a_bounded_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    """``weightsync check --max-seconds``: a run stopped by its deadline is ``incomplete``, with the BFS
    levels every mode explored completely; the text output says what that proves. A run that finishes
    has no top-level ``levels_expanded`` and each mode's equals its depth."""
    out = check("two-phase-epoch", 3, mode="keep", progress=False, deadline=time.time())
    assert out["verdict"] == "incomplete" and not out["complete"]
    assert out["levels_expanded"] == out["per_mode"]["keep"]["levels_expanded"] >= 1
    assert out["levels_expanded"] < out["depth"]
    done = check("two-phase-epoch", 2, mode="keep", progress=False)
    assert "levels_expanded" not in done and done["per_mode"]["keep"]["levels_expanded"] == done["depth"]
    assert main(["check", "--ranks", "3", "--mode", "keep", "--max-seconds", "0.001"]) == 1
    text = capsys.readouterr().out
    assert "incomplete" in text and "steps of the initial state" in text, text
    assert main(["check", "--max-seconds", "0"]) == 2
    assert "--max-seconds" in capsys.readouterr().err


def test_check_no_progress_checks_safety_and_deadlock_only(capsys: pytest.CaptureFixture[str]) -> None:
    """``weightsync check --no-progress``: safety and deadlock are checked (a violation still fails the run),
    the progress properties are 'not checked', and no edge is kept for them."""
    assert main(["check", "--ranks", "2", "--mode", "keep", "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    props = out["properties"]
    assert out["verdict"] == "verified" and props["no_deadlock"] == "holds"
    assert {props[p] for p in PROGRESS} == {"not checked"}
    assert main(["check", "--variant", "vllm-0.32", "--ranks", "2", "--mode", "keep", "--no-progress"]) == 1
    assert "counterexample" in capsys.readouterr().out
