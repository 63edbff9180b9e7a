"""The end of a ``front_end_belief`` counterexample on vLLM: the front-end believes the engines running while
its coordinator believes them idle and no rank steps (the coordinator's next periodic publish corrects it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from weightsync.model.labels import replay_labels
from weightsync.model.system import Model
from weightsync.repro.vllm.driver import _blocked, _Driver, _line, _until

#: the properties whose counterexample ends in a wrong belief, not a hang: the driver observes the end state
#: (:func:`_finish_belief`)
BELIEF_PROPERTIES = ("front_end_belief",)
#: how long the front-end's belief is watched after the last step, seconds (longer than the coordinator's
#: 5 s poll timeout, ``v1/engine/coordinator.py:264-290``, so the publish that corrects it is seen)
BELIEF_WATCH_S = 8.0


def _after_a_publish(d: _Driver, step_s: float) -> str:
    """Wait for one of the coordinator's periodic publishes (it replaces the front-end's ``lb_engines``,
    ``v1/engine/core_client.py:1566-1575``), so the next is about 5 s away and cannot correct the belief
    while the counterexample's last steps run. Returns why not ("" when it came)."""
    marker: list[Any] = []
    d.client.lb_engines = marker
    ok = _until(lambda: d.client.lb_engines is not marker, step_s)
    return "" if ok else f"no stats from the coordinator within {step_s:.0f} s"


def _finish_belief(
    served: Any, events: Path, res: Any, buggy: Model, labels: list[Any], step_s: float
) -> None:
    """The end state of a ``front_end_belief`` counterexample: the model's front-end believes the engines
    running while its coordinator believes them idle and no rank steps. Reproduced when every step was
    followed, vLLM's front-end reports ``engines_running`` True right after the last step while both ranks'
    last records show them idle outside any collective (the schedule's ADD was sent right after a periodic
    publish, :func:`_after_a_publish`); the time until a publish of the coordinator corrects it is reported
    (``belief_stale_s``)."""
    from weightsync.vllm_tools.probe import read_events

    d = served.driver
    states, _ = replay_labels(buggy, labels)
    final = states[-1]
    if res.diverged_at is not None:
        res.result = "diverged"
        return
    t0 = time.monotonic()
    first = bool(d.client.engines_running)
    _until(lambda: not d.client.engines_running, BELIEF_WATCH_S)
    stale_s = time.monotonic() - t0
    recs = read_events(events)
    res.ranks = {str(r): _blocked(rr)[0] for r, rr in recs.items()}
    res.events = {str(r): [_line(x) for x in rr[-8:]] for r, rr in recs.items()}
    res.belief_stale_s = round(stale_s, 3)
    model_says = (final.front.believed_running, final.coord.engines_running)
    idle = all(not w for w in res.ranks.values()) and len(res.ranks) == buggy.n
    if model_says == (True, False) and first and idle:
        res.result = "reproduced"
        res.reason = (
            f"the front-end believed the engines running for {stale_s:.1f} s after the last step, both "
            "ranks paused and idle, until a publish of the coordinator"
            + ("" if stale_s < BELIEF_WATCH_S else f" (none within {BELIEF_WATCH_S:.0f} s)")
        )
    else:
        res.reason = (
            f"model (front running, coordinator running) = {model_says}; vLLM front-end running right after "
            f"the last step: {first}, for {stale_s:.1f} s; ranks {res.ranks}"
        )


__all__ = ["BELIEF_PROPERTIES", "BELIEF_WATCH_S"]
