"""The checked properties: each name with its one-line statement and source, grouped into safety (checked on
the fly), progress (reverse reachability) and non-vacuity ("sometimes") properties, and the order in which
a counterexample reports them (``PRIORITY``)."""

from __future__ import annotations

HOLDS, VIOLATED, NOT_CHECKED = "holds", "violated", "not checked"


#: name -> (one-line statement, source).
PROPERTIES: dict[str, tuple[str, str]] = {
    "collectives_match": (
        "never two ranks blocked in different collectives, and each rank's recorded collective is the one "
        "it is blocked in",
        "blog DP=2 scenario (a deadlock is ranks waiting in different collectives); vLLM PR #39366",
    ),
    "no_one_sided_collective": (
        "no state without successors in which a rank (or the trainer) is blocked in a collective",
        "vLLM issue #36594 (600 s one-sided collective)",
    ),
    "no_deadlock": (
        "every state without successors is a legitimate end (controller done, requests finished, channels "
        "empty, every rank running and unpaused)",
        "weightsync",
    ),
    "quiescence": (
        "no rank steps or enters a DP collective while another rank is inside a weight-transfer collective",
        "vLLM issue #36594; PR #39366 guarantee",
    ),
    "phase_bracketing": (
        "no protocol error: every call the controller makes and every message a rank receives is legal in "
        "its state (no ERROR state), and no reply arrives for a call not made",
        "vLLM 0.32 v1/worker/gpu_worker.py:1507-1604 (four-phase API), h11-style fail-closed tables",
    ),
    "request_conservation": (
        "each admitted request is in exactly one place; requests are aborted only in abort mode (keep and "
        "wait keep every request)",
        "vLLM 0.32 v1/engine/core.py:2061-2103 (pause modes)",
    ),
    "version_agreement": (
        "when a finish_weight_update fan-out has returned without error, every rank's weight_version is the "
        "version it carried; when a resume fan-out has returned, every rank's weight_version equals the "
        "number of rounds that succeeded (a failed round never moves a version)",
        "weightsync (RFC #31848: vLLM has no version counter)",
    ),
    "pause_gating": (
        "from receiving pause until resume a rank starts no waiting request (PAUSED_NEW); under keep "
        "(PAUSED_ALL), and once its pause returned, it advances no request at all",
        "vLLM 0.32 v1/core/sched/interface.py:24-35 (PauseState); PR #39366 guarantee: engines idle and gated "
        "after /pause returns",
    ),
    "mode_semantics": (
        "abort mode: from receiving pause until resume a rank advances no request, and none is running "
        "once its pause returned; keep and wait abort no request the client did not abort",
        "vLLM 0.32 v1/engine/core.py:2061-2103 (pause modes)",
    ),
    "wait_drains": (
        "wait mode: once a rank's pause returned, it runs no request, and no request that was queued on it "
        "when the pause arrived is still queued there",
        "vLLM PR #34125 (mode=wait finishes processing); vLLM 0.32 v1/core/sched/scheduler.py:900-917 and "
        "v1/engine/core.py:1573-1601 (a request queued before the pause stays queued under PAUSED_NEW)",
    ),
    "tokens_exactly_once": (
        "every loop step that runs a forward gives each scheduled request exactly one token and the others "
        "none; a step that runs no forward changes no request (no token doubled or skipped)",
        "vLLM 0.32 v1/engine/core.py:2328-2371 (busy loop); vLLM PR #42117 (first post-resume token dropped)",
    ),
    "no_stale_kv": (
        "with clear_cache=True, no request generates from KV computed under an older weight_version",
        "vLLM 0.32 v1/engine/core.py:898-919, v1/core/sched/scheduler.py:2850-2860 (keep + clear_cache "
        "re-prefills frozen requests); vLLM PR #34382",
    ),
    "no_partial_serving": (
        "no rank advances a request while its worker is mid-round, or after a failed round before a new "
        "round completed (its weights may be partial)",
        "weightsync (failures as table rows); AReaL #1160; slime #1420",
    ),
    "coordinator_belief": (
        "once the engines are idle and nothing is in flight, the DP coordinator's (current_wave, "
        "engines_running) equals the ranks'",
        "vLLM issue #51476; vLLM 0.32 v1/engine/coordinator.py:363-375 (no latch on FIRST_REQ)",
    ),
    "front_end_belief": (
        "once no rank steps or is about to and no message is in flight to the coordinator or on a wave "
        "socket, the front-end does not believe the engines running while the coordinator believes them "
        "idle, unless a publish from the coordinator is on its way (its 5 s poll timeout does not count)",
        "vLLM issue #51481; vLLM 0.32 v1/engine/core_client.py:1540-1549 (latch on FIRST_REQ), "
        "v1/engine/coordinator.py:264-290 (5 s poll timeout), 363-375 (no publish on FIRST_REQ)",
    ),
    "abort_honoured": (
        "a client ABORT that reaches the rank holding the request aborts it",
        "vLLM 0.32 v1/engine/core.py:1685-1686 (ABORT message)",
    ),
    "progress_pause": (
        "every pause can reach all-verified (all pause replies)",
        "PR #39366 liveness: every DP engine receives pause",
    ),
    "progress_resume": (
        "every resume can reach all-running (all resume replies)",
        "PR #39366 liveness: every rank receives resume (the barrier)",
    ),
    "progress_requests": (
        "every admitted request can finish or be aborted",
        "vLLM 0.32 v1/engine/core.py:951-953; AReaL #1160 (every pause followed by resume)",
    ),
    "progress_run": (
        "the controller's run can always end: its cycles started and the last call answered, every request "
        "sent and finished or aborted (a call the table refuses forever, retried forever, is a livelock)",
        "vLLM 0.32 v1/engine/async_llm.py:952-992 (pause and resume return); weightsync (a refused call "
        "must not be retried forever)",
    ),
    "sometimes_all_verified": (
        "non-vacuity: some reachable state has every rank verified",
        "weightsync (non-vacuity)",
    ),
    "sometimes_update_with_wave_in_flight": (
        "non-vacuity: some weight broadcast completes while a START_DP_WAVE is in flight",
        "weightsync (non-vacuity)",
    ),
}


SAFETY = (
    "collectives_match",
    "no_one_sided_collective",
    "no_deadlock",
    "quiescence",
    "phase_bracketing",
    "request_conservation",
    "version_agreement",
    "pause_gating",
    "mode_semantics",
    "wait_drains",
    "tokens_exactly_once",
    "no_stale_kv",
    "no_partial_serving",
    "coordinator_belief",
    "front_end_belief",
    "abort_honoured",
)


PROGRESS = ("progress_pause", "progress_resume", "progress_requests", "progress_run")


SOMETIMES = ("sometimes_all_verified", "sometimes_update_with_wave_in_flight")


#: Tie-break among violations at the same depth.
PRIORITY = {name: k for k, name in enumerate(SAFETY + PROGRESS + SOMETIMES)}


__all__ = ["HOLDS", "NOT_CHECKED", "PRIORITY", "PROGRESS", "PROPERTIES", "SAFETY", "SOMETIMES", "VIOLATED"]
