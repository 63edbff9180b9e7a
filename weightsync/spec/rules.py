"""The protocol's rules in numbered prose (trio-design-doc style), rendered into ``spec/PROTOCOL.md``.

Each rule names where it comes from. The tables in :mod:`weightsync.spec.rank` implement them; the
model checker (:mod:`weightsync.model`) checks the properties they promise, and ``tests/test_rules.py`` checks
each rule's claims against the rows (one check per rule, keyed by its title).
"""

from __future__ import annotations

from typing import NamedTuple


class Rule(NamedTuple):
    """One numbered rule: a title, the rule in prose, and its source."""

    title: str
    text: str
    source: str


RULES: tuple[Rule, ...] = (
    Rule(
        "One table",
        "Every protocol decision of a DP engine rank is a row of its variant's table, keyed by "
        "(state, event). A row names a guard, a target state, the local-variable updates and the effects. "
        "The first row whose guard holds fires; an event with no such row is illegal.",
        "weightsync; h11 _state.py",
    ),
    Rule(
        "Fail closed and stay failed",
        "An illegal message or collective outcome (no row takes it) raises RemoteProtocolError and moves the "
        "rank machine to the sticky error state before any effect runs; no row leaves error and no further "
        "weights move. An illegal local call is refused instead (policy non-sticky, spec/refusal.py): the "
        "engine asks the table before it fires a call, the caller gets the table's LocalProtocolError and the "
        "rank is unchanged. An engine whose loop failed (a DP collective timed out) halts: it fires nothing "
        "more and answers every protocol call with that failure.",
        "weightsync; h2 stream.py",
    ),
    Rule(
        "Utility calls run between steps",
        "pause, resume and the four weight-transfer calls are inputs of the busy loop. A rank handles one "
        "input, or runs one step, at a time; a rank blocked in a collective handles nothing until the "
        "collective completes.",
        "vLLM 0.32 v1/engine/core.py:1547-1558, 1674-1706 (utility calls are busy-loop inputs)",
    ),
    Rule(
        "Lockstep while any rank has work",
        "A rank steps when it has schedulable work or engines_running is set; every step joins the DP "
        "group's forward collective (a dummy batch when nothing is scheduled). Every K steps the step also "
        "joins the DP sync SUM all-reduce of [has_unfinished, pending_pause]; the wave ends when it reports "
        "no unfinished work and no partial pause, rank 0 then emits wave_complete and every rank advances "
        "current_wave.",
        "vLLM 0.32 v1/engine/core.py:2328-2427; vLLM PR #21617",
    ),
    Rule(
        "Waves start from the coordinator",
        "START_DP_WAVE(wave, exclude) re-arms a rank unless it is excluded or the wave is older than its "
        "current wave. An ADD stamped with a newer wave is adopted; an ADD stamped with an older wave on an "
        "idle UNPAUSED rank re-arms it and sends start_wave to the coordinator, which wakes every peer.",
        "vLLM 0.32 v1/engine/core.py:2234-2248, 2281-2299; vLLM PR #37024",
    ),
    Rule(
        "Phase 1: pause locally, keep honouring waves",
        "pause(mode) sets the scheduler's PauseState (abort and wait: PAUSED_NEW; keep: PAUSED_ALL), aborts "
        "in-flight requests under abort, sets pending_pause and engines_running, and does not return yet. "
        "The rank keeps stepping and keeps honouring START_DP_WAVE, so a peer that still has work is never "
        "stranded.",
        "vLLM PR #39366; rejected PR #36608",
    ),
    Rule(
        "Phase 2: stop together",
        "At a DP sync whose SUM of pending_pause equals dp_size, every rank sets ignore_start_dp_wave and "
        "clears pending_pause at the same step; when the SUM of unfinished work is zero they stop together, "
        "the pause call returns (verified) and caches are cleared if asked. A partial pause keeps everyone "
        "stepping.",
        "vLLM PR #39366",
    ),
    Rule(
        "Weights move only when verified",
        "start_weight_update is legal only in verified (or failed, see the next rule); update_weights only "
        "between start and finish (each joins the weight-transfer broadcast with the trainer); "
        "finish_weight_update runs the workers' finish (every layer arrived, reload finalised) and only its "
        "success (FINISH_DONE) returns the rank to verified and sets weight_version to the caller's version "
        "(none given: the version stays, as vLLM's; update_weight_version relabels it in any state, no "
        "transition). While verified or updating a rank never steps and drops "
        "START_DP_WAVE.",
        "vLLM 0.32 v1/worker/gpu_worker.py:1507-1604; PR #39366; issue #36594",
    ),
    Rule(
        "Failure is a state",
        "A weight-transfer failure (a transfer collective that timed out or was aborted, a start or finish "
        "that raised, a version refused by the opt-in monotonic guard) fires TRANSFER_FAILED and the rank "
        "enters failed: its weights may be partial, so it never steps, queues new requests, drops "
        "START_DP_WAVE and refuses pause, resume, update and finish with an error; weight_version does not "
        "move. A new round (start -> update -> finish) recovers it without a restart; a failed init is "
        "retried by init. A transfer collective that a failed rank will never join times out on each member.",
        "weightsync; AReaL #1160; slime #1420",
    ),
    Rule(
        "Resume is a barrier",
        "resume in verified clears the pause and joins a MAX all-reduce of has-unfinished whose result "
        "becomes engines_running on every rank. resume while a pause is in flight is illegal. In "
        "two-phase-epoch a resume that reaches a running rank is a local no-op (stray, repeated and racing "
        "resumes are safe: proofs row stray-repeat-resume); in vLLM's two-phase it is a no-op only if "
        "engines_running, else the idle rank enters the barrier alone while a busy peer steps (a one-sided "
        "collective: proofs row two-phase stray-resume).",
        "vLLM PR #39366; weightsync",
    ),
    Rule(
        "Resume agrees on the wave (two-phase-epoch)",
        "The resume all-reduce also carries current_wave (MAX) and every rank adopts MAX + 1. Any "
        "START_DP_WAVE or ADD stamped before the resume is then stale: the START_DP_WAVE is ignored on every "
        "rank alike, and a stale ADD on an idle rank takes the start_wave path, so the coordinator wakes "
        "every peer. This closes the resume-time race of two-phase under per-socket channels, where an "
        "in-flight wake-up is dropped by one rank and taken by another, and the coordinator latch of issue "
        "#51476. The coordinator does not latch on FIRST_REQ (vLLM 0.32): its engines_running moves only on "
        "the engines' reports: rank 0's start_wave after the first step of a wave, its wave_complete when a "
        "wave ends, and, after an idle resume barrier, wave_complete(MAX), so an idle coordinator's belief "
        "equals the ranks' (property coordinator_belief).",
        "weightsync",
    ),
    Rule(
        "A pause is resumed only on a complete set of weights",
        "The controller (policy one_round) resumes after a round that finished and after a start that failed "
        "before any weight moved (then raises the start's error). Once update_weights began, a failed round "
        "is not resumed, since a resume would serve a mix of old and new weights: the ranks stay failed, "
        "serve nothing, and a new round recovers them (the model's policy recover runs it). A failed pause "
        "is raised without a resume (the ranks may stand in different states). An engine never serves on a "
        "partial update.",
        "AReaL #1160; slime #1420",
    ),
    Rule(
        "Wire agreement before payload",
        "At the start of every update all ranks agree on names, dtypes, shapes, packing and byte counts; a "
        "mismatch raises WireMismatchError on every rank before any payload moves.",
        "huggingface/trl PR #7104; SkyRL PR #2114; vLLM PR #31943 review",
    ),
    Rule(
        "vLLM 0.32 as shipped (variant vllm-0.32)",
        "A model of vLLM, not a weightsync rule: it breaks rules 2, 8, 9 and 11 on purpose. The DP sync runs "
        "at the wave's first step and every K steps; the coordinator never latches; rank 0 sends start_wave "
        "after a step whose iteration began with engines_running False (was_running) unless a pause is "
        "pending; the START_DP_WAVE of a FIRST_REQ reaches the target rank too (its exclusion never matches); "
        "resume is an error reply while a pause is in flight, a no-op while engines_running, else a MAX "
        "barrier of has_unfinished that keeps current_wave; a pause is accepted in any state, also during an "
        "update, and re-enters phase 1; weight-transfer calls run in any state, refused only by the worker's "
        "own flags; every refusal is an error reply that leaves the rank unchanged. Each row cites its "
        "vLLM 0.32 file and line.",
        "vLLM 0.32.0 v1/engine/core.py, coordinator.py, core_client.py, config/parallel.py",
    ),
    Rule(
        "The fix on vLLM 0.32 (variant vllm-0.32-epoch)",
        "vLLM 0.32's environment and loop unchanged, plus: the resume all-reduce carries [has_unfinished, "
        "current_wave] with MAX, every rank adopts MAX + 1 and resets its step counter, and rank 0 reports an "
        "idle resume as wave_complete(MAX); a resume on a running rank is a no-op; the round is the state "
        "updating (start only when verified, update and finish only while updating); a pause on a verified "
        "rank returns at once; a pause or resume during an update is refused; weight calls outside a pause "
        "are refused; failures as in rule 9. Refusals are error replies that leave the rank unchanged.",
        "weightsync",
    ),
)
