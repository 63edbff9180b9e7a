"""The end of a ``wait_drains`` counterexample on vLLM (issue 24): the wait-mode pause returned while a
request that reached the rank before it is still queued. The driver's gate makes the schedule's rank take
its ADD and the pause with no step between (:data:`weightsync.vllm_tools.probe.ENV_ADD_WAITS`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync.repro.vllm.driver import _state, _until, record_end

#: properties whose end state is a pause that returned over a request it should have drained (the driver
#: gates the ADD's rank so the pause reaches it before a step, and observes the request's progress)
QUEUED_PROPERTIES = ("wait_drains",)


def finish_queued(served: Any, events: Path, res: Any, step_s: float) -> None:
    """Judge the end of a ``wait_drains`` schedule on vLLM as shipped: every step followed (the probe's
    variables equal to the model's at each), ``pause_generation(mode="wait")`` returned, and no request the
    schedule added has produced a token; then, with every held message released, still none for ``step_s``
    (the paused ranks hold it queued under PAUSED_NEW, ``v1/core/sched/scheduler.py:900-917``); after
    ``resume_generation`` each finishes. ``served``: the run's ``_Served``; ``res``: its ``ReproResult``,
    filled in here."""
    d = served.driver
    calls = served.__dict__.get("calls", [])
    if res.diverged_at is not None:
        res.result = "diverged"
        return
    pause = calls[-1] if calls else None
    bad: list[str] = []
    if pause is None or not _until(pause.done, step_s) or _state(pause) != "returned":
        bad.append(f"the pause did not return: {_state(pause) if pause is not None else 'no call'}")
    moved = {rid: len(outs) for rid, outs in served.outputs.items() if outs}
    if moved:
        bad.append(f"requests produced output before the pause returned: {moved}")
    for r in range(2):  # the engines first: a START_DP_WAVE sent from now on is not held
        d.utility(r, "weightsync_release_all", timeout=step_s)
    d.release_everything()
    _until(lambda: any(served.outputs.values()), step_s)
    moved = {rid: len(outs) for rid, outs in served.outputs.items() if outs}
    if moved and not bad:
        bad.append(f"requests produced output while paused: {moved}")
    d.run(served.llm.resume_generation(), step_s * 3)
    for fut in calls[:-1]:  # the requests
        try:
            fut.result(step_s * 3)
        except Exception as exc:
            res.errors["driver"] = f"{type(exc).__name__}: {exc}"
    fin = record_end(served, events, res)
    if any(v < 0 for v in fin.values()) or res.errors:
        bad.append(f"after the resume: requests {fin}, errors {res.errors}")
    if bad:
        res.reason = "; ".join(bad)
        return
    res.result = "reproduced"
    res.reason = (
        f"pause_generation(mode={res.mode!r}) returned with {', '.join(fin)} (added before it) queued: no "
        f"output in {step_s:.0f} s with every message flowing; each finished after the resume"
    )


__all__ = ["QUEUED_PROPERTIES", "finish_queued"]
