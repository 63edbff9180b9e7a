"""The reference repro's oracles for a buggy variant's run (see :mod:`weightsync.repro.engine`):
:func:`end_check`, where each rank ended against the model's final state, and :func:`reproduce_queued`, for a
counterexample that ends in a pause returned over requests it should have drained (property
``wait_drains``, issue 24): not where the ranks block, but what the requests do."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.impl.engine.messages import TransitionRecord
from weightsync.repro.driver import TIMEOUT, ModelEnd, ScheduleDriver, diff_vars

if TYPE_CHECKING:
    from weightsync.repro.engine import ReproResult


def end_check(
    records: Mapping[int, Sequence[TransitionRecord]],
    after_schedule: Mapping[int, int],
    failures: Mapping[int, Any],
    end: ModelEnd,
    start_vars: Mapping[int, Mapping[str, Any]] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Compare where each rank ended with the model's final state (the oracle of a buggy run).

    A rank the model has blocked in collective K must have K as the collective of its last transition in
    the schedule and leave it only by K's timeout: an engine failure that is a ``TransferTimeoutError``
    with no transition before it, or a next transition carrying that timeout as its ``error`` argument
    (a weight-transfer collective's timeout is a table event); what it does after the timeout is past the
    model's run. A rank the model has outside any collective must not fail and must take no further acting
    transition. Every rank's variables at the end of the schedule must be the model's final ones.

    Args:
        records: each rank's acting transitions since the schedule began, in order.
        after_schedule: per rank, how many of them the schedule consumed (the rest came after it).
        failures: rank -> its :class:`~weightsync.impl.engine.messages.EngineFailure`.
        end: the model's final state.
        start_vars: each rank's variables when the schedule began (for a rank with no transition).

    Returns:
        ``(ranks, problems)``: the collective each rank was in at the end of the schedule ("" outside any)
        and every difference from the model, per rank (empty: the run ended where the model says).
    """
    ranks: dict[str, str] = {}
    bad: list[str] = []
    for r in sorted(end.blocked):
        recs = list(records.get(r, ()))
        k = after_schedule.get(r, len(recs))
        sched, post = recs[:k], recs[k:]
        last = sched[-1].after if sched else dict((start_vars or {}).get(r, {}))
        where = str(last.get("collective", ""))
        ranks[str(r)] = where
        want = end.blocked[r]
        f = failures.get(r)
        moved = ", ".join(f"{t.event} [{t.guard}]" for t in post[:3])
        if where != want:
            bad.append(
                f"rank {r} ended in {where or 'no collective'}, the model's final state has {want or 'none'}"
            )
        if want:
            timed_out = str(post[0].args.get("error", "")) if post else ""
            if post:
                if not timed_out.startswith(TIMEOUT):
                    bad.append(f"rank {r} moved on after the schedule: {moved}")
            elif f is None:
                bad.append(f"rank {r} never timed out of {want} (the model has it blocked there for good)")
            elif f.error_type != TIMEOUT:
                bad.append(f"rank {r} failed with {f.error_type}, not a timeout in {want}: {f.error[:200]}")
        else:
            if post:
                bad.append(f"rank {r} moved on after the schedule: {moved}")
            if f is not None:
                bad.append(
                    f"rank {r} failed in {f.phase} ({f.error_type}); the model has it outside any collective"
                )
        diff = diff_vars(last, end.vars.get(r, {}))
        if diff:
            bad.append(f"rank {r}'s variables differ from the model's final state: {diff}")
    return ranks, bad


#: Properties whose end state is a pause that returned over a request it should have drained
#: (``wait_drains``): the oracle is the request's progress, not where the ranks block.
QUEUE_PROPERTIES = frozenset({"wait_drains"})


def reproduce_queued(run: ScheduleDriver, res: ReproResult, end: ModelEnd) -> None:
    """The oracle of ``wait_drains``: the controller's pause returned at the schedule's last step, no rank
    is in a collective, and every request added before it is unfinished; then, with every message flowing
    and every rank stepping freely for ``step_s``, still none of them produces a token (the paused ranks
    hold it queued), and after the controller's update and resume each finishes (the engine stays healthy,
    as vLLM's did in issue 24)."""
    c = run.c
    if run.call is not None:  # the model's last step is the pause's completion: its reply is on the way
        run.call.join(run.left(run.step_s))
    call_done = run.call is not None and not run.call.is_alive() and "controller" not in run.errors
    pending = [s for s in run.streams if not s.done.is_set()]
    bad = [] if call_done else [f"the pause call had not returned {run.step_s:g} s after the schedule's end"]
    if not pending:
        bad.append("every request had finished before the pause returned")
    if any(k for k in end.blocked.values()):
        bad.append(f"the model's final state has ranks blocked: {end.blocked}")
    run.say("every step followed; every message flows and every rank steps freely from here")
    run.flow()
    t0 = time.monotonic()
    time.sleep(run.step_s)
    moved = {s.req_id: len(s.tokens) for s in pending if s.tokens or s.done.is_set()}
    if moved:
        bad.append(f"requests moved while paused: {moved}")
    held_s = time.monotonic() - t0
    run.finish_cycle()
    with contextlib.suppress(TimeoutError):
        c.wait_for(
            lambda: bool(c.failures) or all(s.done.is_set() for s in run.streams),
            run.left(3 * run.timeout_s + 10),
            "the requests after the resume",
        )
    res.requests_finished = {
        s.req_id: len(s.tokens) if s.done.is_set() and s.finish_reason == "length" else -1
        for s in run.streams
    }
    res.ranks = {str(r): "" for r in range(run.n)}
    for r, f in sorted(c.failures.items()):
        res.errors[str(r)] = f"{f.phase}: {f.error.splitlines()[0][:300]}"
    if c.failures or any(v < 0 for v in res.requests_finished.values()):
        bad.append(f"after the resume: failures {sorted(c.failures)}, finished {res.requests_finished}")
    if bad:
        res.reason = "; ".join(bad)
        return
    res.result = "reproduced"
    res.reason = (
        f"the {run.mode} pause returned with {', '.join(s.req_id for s in pending)} (added before it) still "
        f"queued: no token in {held_s:.1f} s while paused; each finished after the resume"
    )


def undrained_at_pause(run: ScheduleDriver) -> str:
    """(A fixed variant's run of a ``wait_drains`` schedule.) Let everything flow until the controller's
    pause returns, then say why not every request added before it had finished by then ("" when each
    had: a rank's outputs precede its pause reply on its one output queue)."""
    run.flow()
    call = run.call
    if call is None:
        return "the schedule made no pause call"
    call.join(run.left(3 * run.timeout_s + 5))
    if call.is_alive() or "controller" in run.errors:
        return f"the pause did not return: {run.errors.get('controller', 'still waiting')}"
    left = [s.req_id for s in run.streams if not s.done.is_set()]
    return f"the pause returned with {left} unfinished" if left else ""


__all__ = ["QUEUE_PROPERTIES", "end_check", "reproduce_queued", "undrained_at_pause"]
