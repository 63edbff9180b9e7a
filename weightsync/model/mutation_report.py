"""The mutation report (``weightsync mutate``, ``proofs/MUTATION.md``): the full run of
:mod:`weightsync.model.mutation` under :data:`~weightsync.model.mutation.MUTATION_BOUNDS`, the survivors'
classification and their one-line explanations (:data:`SURVIVOR_NOTES`), the report files and their
freshness (``weightsync prove --check``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from weightsync.model.mutation import (
    CHECKPOINT_FILE,
    MUTATION_BOUNDS,
    classify_survivors,
    mutants,
    mutation_digest,
    reachable_firings,
    run_mutation,
)
from weightsync.spec.rank import get_variant

#: Why each non-equivalent survivor of the full run (:data:`MUTATION_BOUNDS`, N=2) survives: the
#: mutant behaves differently somewhere reachable, and no property is violated. One line each; the slow
#: test fails on a non-equivalent survivor missing here, so a new survivor cannot go unexplained.
_WAVE_COMPLETE = (
    "the coordinator is not told at the pause consensus that the wave ended and believes the engines "
    "running while they are paused; nothing acts on that belief while they are paused (the front-end then "
    "sends no FIRST_REQ, and an ADD waits on its paused rank), and before the ranks serve again the next "
    "wave_complete corrects it: the resume barrier's barrier_idle row sends one, and a barrier with work "
    "left starts a wave whose end rank 0 reports (the coordinator takes any report not older than its "
    "wave); coordinator_belief is checked only once the ranks run idle, and holds"
)
_IGNORE_FLAG = (
    "the flag keeps START_DP_WAVE from re-arming a verified rank; in the table a verified or updating rank "
    "never steps (its STEP row is a no-op) and the epoch barrier overwrites current_wave and "
    "engines_running at resume, so honouring a wave there changes nothing observable; the flag is "
    "load-bearing after a wait-mode consensus with work left (dropping it in paused/dp_sync_done#1 is killed)"
)
_PENDING_AFTER_CONSENSUS = (
    "after a consensus the ignore flag, not pending_pause, carries the decision (sync_paused_and_idle reads "
    "`consensus or ignore_start_dp_wave`) and the verify row that follows clears pending_pause; the stale "
    "True only changes later sums whose outcome the flag already fixes"
)
_DUMMY_STEP = (
    "a paused rank has no schedulable request (abort aborted them, keep froze them, wait reaches paused only "
    "drained, and new ADDs wait behind PAUSED_NEW), so every step there is a dummy batch and execute_step "
    "changes no request; the rank still joins the collective (enter_dp_step / enter_dp_sync are kept): "
    "the lookups differ in the effect list only"
)
_OLDER_WAVE = (
    "no ADD is ever newer than its rank (one front-end stamps the coordinator's wave, which never runs ahead "
    "of the ranks), so the mutant makes a stale or current ADD adopt its older wave while the rank is "
    "pausing, paused, verified or updating; there the wave only decides whether a START_DP_WAVE is honoured "
    "and which wave a later wave_complete reports (an older one the coordinator ignores), and the epoch "
    "barrier sets every rank to MAX(current_wave) + 1 at resume, before the rank serves again (under "
    "two-phase, without the epoch, the same mutant in verified/updating is killed with a one-sided "
    "collective); the pausing row is reached only in the bounded requests2-wait-bounded configuration"
)
_MIRROR = (
    "rank 0's start_wave after the first step of a wave (vLLM 0.32 core.py:2394-2406) only keeps the "
    "coordinator's belief current during the wave; without it (dropped effect) the coordinator believes the "
    "engines idle until rank 0's wave_complete ends the wave, and with the flag not set (dropped update) rank "
    "0 reports after every step, which the coordinator takes once and then ignores (not a newer wave, or "
    "older than its own after wave_complete: spec/coordinator.py); a FIRST_REQ meanwhile only rebroadcasts "
    "START_DP_WAVE(current_wave), which ranks running that wave take as a no-op; coordinator_belief is "
    "checked once the ranks are idle, after the wave's wave_complete. (The DP sync's twin mirror row is "
    "never reached with sync_interval 2: the wave's first step is no sync.)"
)
_FAIL_STOP = (
    "fail_stop sets pause_state PAUSED_ALL, engines_running False, pending_pause False and the ignore flag; "
    "none of the failed state's rows reads them (its step and START_DP_WAVE rows are no-ops, ADD only "
    "queues, every call but a new round is refused), leave_collective already clears the collective, a "
    "transfer failure fails every member of the collective at once (so no peer keeps stepping with the "
    "failed rank), and the only way out of failed is a full round and a resume whose rows (unpause, the "
    "epoch barrier's running_from_barrier and adopt_wave_after_barrier) overwrite them before the rank "
    "serves; checked again with a request in flight (Bounds(init_transfer=True, failures=1), every mode, "
    "1.8M states): still no property fails"
)
_FAIL_INIT = (
    "fail_init clears the worker's initialized flag after a failed init_weight_transfer_engine, so a later "
    "start_weight_update without a new init is refused; the model's controller always initialises again "
    "after a failed init before it starts a round (the INIT phase repeats on failure), so the flag never "
    "decides a call; the worker machine refuses that start (LocalProtocolError: "
    "tests/test_spec.py::test_worker_start_after_a_failed_reinit_is_refused); checked again with a request in flight (Bounds(init_transfer=True, failures=1)): "
    "still no property fails"
)

#: Why each non-equivalent survivor of the full run (:data:`MUTATION_BOUNDS`, N=2) survives: the
#: mutant behaves differently somewhere reachable, and no property is violated. One line each; the slow
#: test fails on a non-equivalent survivor missing here, so a new survivor cannot go unexplained.
_JOIN_NOT_NEEDED = (
    "two-phase-epoch stops a drain past the consensus by sync_paused_and_idle (consensus OR "
    "ignore_start_dp_wave, and no unfinished work), so a retry taken by its mode's row instead of the join "
    "(pending_pause set again) still ends with the others; the join is what vLLM 0.32 needs (patch 0007: "
    "its sync_dp_state stops only when every rank is pending), kept here to say what the patched engine does"
)
_REPAUSE_STATE = (
    "a retry at a paused rank: under the per-mode bounds its mode is the first pause's, so the PauseState it "
    "would set is already set; under --mode any the properties judge a retry in another mode by whether the "
    "rank took it up (its variables changed), so with the update dropped the rank keeps the first pause's "
    "PauseState and is judged by that mode, which is what it then does; not killed in the bounded any-mode search"
)


SURVIVOR_NOTES: dict[str, str] = {
    "pausing/pause#0: negate guard pause_joins_consensus": _JOIN_NOT_NEEDED,
    "paused/pause#0: negate guard pause_joins_consensus": _JOIN_NOT_NEEDED,
    "paused/pause#1: drop update set_pause_state": _REPAUSE_STATE,
    "paused/pause#2: drop update set_pause_state": _REPAUSE_STATE,
    "paused/pause#3: drop update set_pause_state": _REPAUSE_STATE,
    "paused/pause#4: drop update set_pause_state": _REPAUSE_STATE,
    "pausing/pause#2: negate guard pause_drains_queued_entering_paused_new": (
        "negated, the row fires for a retry at a pausing rank with nothing queued (admit_waiting admits "
        "nothing, the target is pausing as the next row's); the case the row exists for, a wait after a keep "
        "in flight with a request queued, needs --mode any, checked here only by a bounded search (the "
        "exhaustive any-mode-repeat-pause proof row verifies the unmutated table); not yet killed"
    ),
    "pausing/dp_sync_done#0: drop effect emit_wave_complete": _WAVE_COMPLETE,
    "paused/dp_sync_done#0: drop effect emit_wave_complete": _WAVE_COMPLETE,
    "pausing/dp_sync_done#0: drop update set_ignore_start_dp_wave": _IGNORE_FLAG,
    "paused/dp_sync_done#0: drop update set_ignore_start_dp_wave": _IGNORE_FLAG,
    "paused/dp_sync_done#1: drop update clear_pending_pause": _PENDING_AFTER_CONSENSUS,
    "pausing/dp_sync_done#2: drop update clear_pending_pause": _PENDING_AFTER_CONSENSUS,
    "pausing/dp_sync_done#1: drop update clear_pending_pause": _PENDING_AFTER_CONSENSUS,
    "pausing/dp_sync_done#1: drop update set_ignore_start_dp_wave": (
        "a survivor of the bounded search only: the same configuration explored exhaustively (two "
        "requests, wait mode, N=2: mutation.kills with an exhaustive MutationConfig) kills it in 21 s with "
        "no_one_sided_collective: past the consensus the drained rank clears its pending pause, so without "
        "the flag its next sync sees neither, takes the partial row and steps on alone"
    ),
    "running/pause#1: drop update set_engines_running": (
        "the row (pause_drains_queued) admits the queued requests, so the rank has work and its loop steps "
        "without the kick that engines_running gives an idle rank; its peers take the kick from their own "
        "pause rows"
    ),
    "paused/step#0: drop effect execute_step": _DUMMY_STEP,
    "paused/step#1: drop effect execute_step": _DUMMY_STEP,
    "pausing/dp_sync_done#0: drop effect clear_cache": (
        "this is the wait-mode verify from pausing: every request has finished (sum_unfinished = 0), so no "
        "request holds KV blocks, and the model tracks KV per request (no prefix cache), so clearing has "
        "nothing to act on; the keep-mode twin in paused/dp_sync_done#0 is killed by no_stale_kv"
    ),
    "paused/ADD#0: negate guard add_newer_wave": _OLDER_WAVE,
    "verified/ADD#0: negate guard add_newer_wave": _OLDER_WAVE,
    "updating/ADD#0: negate guard add_newer_wave": _OLDER_WAVE,
    "pausing/ADD#0: negate guard add_newer_wave": _OLDER_WAVE,
    "running/dp_step_done#0: drop update mark_wave_started": _MIRROR,
    "running/dp_step_done#0: drop effect emit_start_wave": _MIRROR,
    "updating/transfer_failed#0: drop update fail_stop": _FAIL_STOP,
    "running/transfer_failed#0: drop update fail_stop": _FAIL_STOP,
    "verified/transfer_failed#0: drop update fail_stop": _FAIL_STOP,
    "running/transfer_failed#0: drop effect fail_init": _FAIL_INIT,
    "verified/transfer_failed#0: drop effect fail_init": _FAIL_INIT,
    "failed/transfer_failed#0: drop effect fail_init": _FAIL_INIT,
    "resuming/resume_barrier_done#1: drop update adopt_wave_after_barrier": (
        "with work left the barrier leaves every rank running (running_from_barrier), so no rank waits for a "
        "START_DP_WAVE to start the wave; each keeps its own wave number, which then only decides whether a "
        "late START_DP_WAVE or ADD counts as stale, and with every rank running that changes nothing "
        "observable; the wave's end is reported by rank 0's wave_complete and adopted by the coordinator "
        "(coordinator_belief holds once the ranks are idle); the idle barrier's twin (row #0), where the "
        "new wave number is what keeps a late START_DP_WAVE from re-arming one rank, is killed with a "
        "one-sided collective"
    ),
}

MUTATION_FILE = "mutation.json"
MUTATION_MD = "MUTATION.md"


def mutation_report(
    variant: str = "two-phase-epoch",
    *,
    workers: int = 1,
    on_result: Callable[[str, str | None], None] | None = None,
    decided: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """The full mutation run under :data:`MUTATION_BOUNDS` plus the survivors' classification
    (``decided``: verdicts of an interrupted run of the same table, see :func:`run_mutation`).

    Returns :func:`run_mutation`'s fields plus ``equivalent`` (survivor names proved equivalent by
    :func:`first_difference`), ``classes`` (per survivor: equivalent, row_fires, first_difference, note),
    ``unexplained`` (non-equivalent survivors without a :data:`SURVIVOR_NOTES` entry), ``score`` (killed /
    non-equivalent mutants), ``configs`` and ``spec_digest``.
    """
    from weightsync.spec.rank import spec_digest

    firings = reachable_firings(variant, MUTATION_BOUNDS, workers=workers)
    out = run_mutation(
        variant,
        workers=workers,
        on_result=on_result,
        firings=firings,
        decided=decided,
        configs=MUTATION_BOUNDS,
    )
    t0 = time.perf_counter()
    classes = classify_survivors(variant, out["survivors"], firings=firings)
    equivalent = [n for n, c in classes.items() if c["equivalent"]]
    assert set(equivalent) == set(out["equivalent"]), "classification disagrees with the run"
    out.update(
        variant=variant,
        ranks=2,
        classes=classes,
        equivalent=equivalent,
        score=round(out["killed"] / max(1, out["mutants"] - len(equivalent)), 4),
        classify_seconds=round(time.perf_counter() - t0, 1),
        configs=[
            {
                "name": c.name,
                "bounds": c.bounds._asdict(),
                "max_states": c.max_states,
                "exhaustive": c.exhaustive,
                "modes": None if c.modes is None else [m.value for m in c.modes],
            }
            for c in MUTATION_BOUNDS
        ],
        spec_digest=spec_digest(),
        table_digest=mutation_digest(variant),
    )
    return annotate(out)


def annotate(rep: dict[str, Any]) -> dict[str, Any]:
    """Attach the current :data:`SURVIVOR_NOTES` to a report's non-equivalent survivors and recompute
    ``unexplained`` (in place; returns ``rep``). Lets the notes change without re-running the mutants."""
    for name, c in rep["classes"].items():
        c["note"] = None if c["equivalent"] else SURVIVOR_NOTES.get(name)
    rep["unexplained"] = [n for n, c in rep["classes"].items() if not c["equivalent"] and c["note"] is None]
    return rep


def report_markdown(rep: dict[str, Any]) -> str:
    """``proofs/MUTATION.md`` for a :func:`mutation_report`."""
    n, k, e = rep["mutants"], rep["killed"], len(rep["equivalent"])
    order = {m.name: i for i, (m, _) in enumerate(mutants(get_variant(rep["variant"]).table))}
    classes = sorted(rep["classes"].items(), key=lambda kv: order.get(kv[0], len(order)))
    killed = sorted(rep["killed_by"].items(), key=lambda kv: order.get(kv[0], len(order)))
    lines = [
        f"# Mutation check of `{rep['variant']}`",
        "",
        "GENERATED by `weightsync mutate --write`; `weightsync prove --check` fails when the table changed since.",
        "",
        f"Table digest `{rep.get('table_digest', rep['spec_digest'])}` (the mutated variant and the worker table). N={rep['ranks']}, per-socket channels, every pause mode, under "
        f"{len(rep['configs'])} configurations ({', '.join(c['name'] for c in rep['configs'])}; see "
        "`weightsync.model.mutation.MUTATION_BOUNDS`). Each mutant negates one row's guard or drops one of its "
        "updates or effects.",
        "",
        f"- mutants: {n}; killed: {k} ({k / max(1, n):.1%}); survivors: {n - k}",
        f"- equivalent survivors (no reachable table lookup fires differently, so no checker can tell them "
        f"apart under these bounds): {e}",
        f"- mutation score, killed / non-equivalent: {k}/{n - e} = {rep['score']:.1%}",
        (
            f"- run {rep['seconds']} s, classification {rep['classify_seconds']} s"
            if rep["seconds"] >= 1
            else f"- run: every verdict resumed from `proofs/{CHECKPOINT_FILE}` (its time is not recorded), "
            f"classification {rep['classify_seconds']} s"
        ),
        "",
        "## Survivors that behave differently (explained)",
        "",
        "| mutant | reachable firings of the row | first difference | why no property fails |",
        "|---|---|---|---|",
    ]
    for name, c in classes:
        if not c["equivalent"]:
            lines.append(
                f"| `{name}` | {c['row_fires']} | {c['first_difference']} | {c['note'] or '**unexplained**'} |"
            )
    lines += ["", "## Equivalent survivors", "", "| mutant | reachable firings of the row |", "|---|---|"]
    for name, c in classes:
        if c["equivalent"]:
            lines.append(f"| `{name}` | {c['row_fires']} |")
    lines += ["", "## Killed", "", "| mutant | first violation (config:mode:property) |", "|---|---|"]
    for name, why in killed:
        lines.append(f"| `{name}` | {why} |")
    return "\n".join(lines) + "\n"


def write_report(root: Path, rep: dict[str, Any]) -> None:
    """Write ``root/proofs/mutation.json`` and ``root/proofs/MUTATION.md``."""
    pdir = root / "proofs"
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / MUTATION_FILE).write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    (pdir / MUTATION_MD).write_text(report_markdown(rep))


def mutation_stale(data: dict[str, Any]) -> bool:
    """Whether a loaded mutation report was computed against another table than the current one."""
    return bool(data.get("table_digest") != mutation_digest(str(data.get("variant", "two-phase-epoch"))))


def mutation_problems(root: Path, allow_stale: bool = False) -> list[str]:
    """Why ``root/proofs/mutation.json`` is stale or unacceptable (empty: fresh and every survivor explained).

    ``allow_stale``: a report computed against another table is not a problem (its staleness is then only
    reported by :func:`mutation_stale`); a missing report, and unexplained survivors of a fresh one, still
    are. For a checkout whose table changed while the full run (an hour on 2 cores) could not be redone.
    """
    p = root / "proofs" / MUTATION_FILE
    if not p.is_file():
        return [f"proofs/{MUTATION_FILE} is missing (run `weightsync mutate --write`)"]
    data = json.loads(p.read_text())
    problems: list[str] = []
    if mutation_stale(data):
        if allow_stale:
            return problems
        problems.append(
            f"proofs/{MUTATION_FILE} was computed against another table (run `weightsync mutate --write`)"
        )
        return problems  # its survivors' notes concern another table
    annotate(data)
    if data["unexplained"]:
        problems.append(
            f"proofs/{MUTATION_FILE}: survivors without a note in SURVIVOR_NOTES: {data['unexplained']}"
        )
    md = root / "proofs" / MUTATION_MD
    if not md.is_file() or md.read_text() != report_markdown(data):
        problems.append(f"proofs/{MUTATION_MD} is stale (run `weightsync mutate --write --reuse`)")
    return problems
