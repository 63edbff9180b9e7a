"""The demo's checks: probe logits against the trainer's, kept requests, the run's verdicts, failure reports.

Each sync is checked (:mod:`weightsync.demo.loop` step 5): every rank reports the sync's
``weight_version``, and on the fixed probe prompts every engine's logits equal the trainer's
(:func:`probe_diff`: ``torch.equal`` in float32; otherwise the max abs difference is reported). In keep mode
every request frozen by a pause finishes with all its tokens under monotone versions (:func:`kept_violations`).
:func:`demo_checks` turns the run's figures into the named checks of the result; :func:`describe_failure`
names a dead rank, the trainer's error and the surviving engines' errors in one message.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from safetensors.torch import load_file

from weightsync.demo.config import DemoConfig, EngineDiedError, SyncRecord
from weightsync.demo.guard import ClientGuard
from weightsync.demo.rl_task import EOS_ID
from weightsync.spec.errors import WeightSyncError
from weightsync.spec.rank import version_order
from weightsync.spec.states import IN_FLIGHT_FINISH, PauseMode, RankState

__all__ = ["demo_checks", "describe_failure", "kept_violations", "probe_diff", "torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (then restore the previous count)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def probe_diff(
    model: Any, probe_dir: pathlib.Path, version: int, ranks: int, timeout_s: float
) -> tuple[float, bool]:
    """The trainer's probe logits against those every engine rank wrote for ``version`` (waiting at most
    ``timeout_s`` for each file): ``(max abs difference, torch.equal on every rank and prompt)``."""
    from weightsync.demo.trainer import trainer_probe_logits

    with torch_threads(1):  # the engines run one intra-op thread: same kernels, same reduction order
        ref = trainer_probe_logits(model)
    worst = 0.0
    equal = True
    deadline = time.monotonic() + timeout_s
    for r in range(ranks):
        path = probe_dir / f"rank{r}-round{version}.safetensors"
        while not path.exists():
            if time.monotonic() > deadline:
                raise WeightSyncError(f"engine rank {r} wrote no probe logits for version {version}")
            time.sleep(0.01)
        saved = load_file(str(path))
        got = [saved[str(i)] for i in range(len(saved))]
        for a, b in zip(ref, got, strict=True):
            equal = equal and a.shape == b.shape and torch.equal(a, b)
            worst = max(worst, float((a.float() - b.float()).abs().max().item()))
    return worst, equal


def aborts_in_flight(mode: str) -> bool:
    """Whether pause mode ``mode`` may finish a request in flight as aborted (spec ``IN_FLIGHT_FINISH``:
    ``abort``); under the others (``wait``, ``keep``) every request in flight runs to its own end.

    Raises:
        ValueError: ``mode`` is no pause mode.
    """
    return "abort" in IN_FLIGHT_FINISH[PauseMode(mode)]


def kept_violations(streams: Sequence[Any], max_new_tokens: int) -> int:
    """A mode that keeps requests in flight (:func:`aborts_in_flight` False): the finished requests of
    ``streams`` that did not end with their full length (or EOS), were aborted, or whose tokens' versions
    are not monotone (old version before the sync, new one after)."""
    bad = 0
    for s in streams:
        if not s.done.is_set():
            continue  # counted as lost by the rollout wait
        full = len(s.tokens) == max_new_tokens or (s.tokens and s.tokens[-1] == EOS_ID)
        order = [version_order(v) for v in s.versions]
        monotone = all(x <= y for x, y in itertools.pairwise(order))
        if s.finish_reason == "abort" or not full or not monotone:
            bad += 1
    return bad


def demo_checks(
    cfg: DemoConfig,
    records: Sequence[SyncRecord],
    *,
    error: str | None,
    lost: int,
    aborted: int,
    kept_bad: int,
    exact: bool,
    violations: Sequence[str],
) -> dict[str, bool]:
    """The run's named checks (the result's ``checks``; ``ok`` is their conjunction)."""
    rs = records
    versions_ok = all(r.weight_version == f"step-{i}" for i, r in enumerate(rs)) and len(rs) == cfg.steps + 1
    return {
        "completed": error is None and len(rs) == cfg.steps + 1,
        "no_lost_requests": lost == 0,
        "weight_versions_agree": versions_ok,
        "logits_match": bool(rs) and (all(r.logits_equal for r in rs) if exact else True),
        "kept_requests_finished": kept_bad == 0 and (aborts_in_flight(cfg.mode) or aborted == 0),
        "checker_clean": not violations,
    }


def _round_failed(guard: ClientGuard, rank: int) -> bool:
    """Whether engine ``rank`` is in the table's ``failed`` state (False if it cannot answer)."""
    try:
        return RankState(guard.client.call_rank(rank, "get_state").result(10.0)["state"]) is RankState.FAILED
    except Exception:
        return False


#: how long a failure waits for an engine process's death to become visible, seconds. A SIGKILLed rank's
#: sockets close while the kernel tears the process down, so its peers' gloo calls fail (connection closed
#: by peer) before ``waitpid`` can reap it; on a loaded machine the teardown takes a while.
DEATH_GRACE_S = 3.0


def _dead_after_grace(guard: ClientGuard) -> dict[int, int | None]:
    """``guard.dead()``, polled for up to :data:`DEATH_GRACE_S` while it is empty."""
    deadline = time.monotonic() + DEATH_GRACE_S
    dead = guard.dead()
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = guard.dead()
    return dead


def describe_failure(
    exc: BaseException, guard: ClientGuard | None, trainer: Any, ranks: int, timeout_s: float
) -> tuple[str, list[int]]:
    """One message naming the dead rank (if any), the trainer's error and the surviving engines' errors,
    and the dead DP ranks."""
    parts: list[str] = []
    dead: dict[int, int | None] = _dead_after_grace(guard) if guard is not None else {}
    dead_ranks: list[int] = []
    if dead and guard is not None:
        dead_ranks = sorted(dead)
        parts.append(str(EngineDiedError(dead_ranks, _phase_of(exc), dead, guard.pids())))
        parts.append("(transfer rank r + 1 is engine DP rank r; rank 0 is the trainer)")
    else:
        parts.append(f"{type(exc).__name__}: {exc}")
    if guard is not None:
        alive = [r for r in range(ranks) if r not in dead]
        if dead:  # the surviving ranks fail their round within the timeout too (state `failed`)
            deadline = time.monotonic() + timeout_s + 5.0
            # ... and so does the trainer's send (its own deadline): wait for both
            while time.monotonic() < deadline and not (
                all(_round_failed(guard, r) for r in alive)
                and (trainer is None or getattr(trainer, "send_error", None) is not None)
            ):
                time.sleep(0.05)
        for r, f in sorted(guard.client.failures.items()):
            parts.append(f"engine rank {r} failed in {f.phase}: {f.error}")
        for r in alive:
            if r not in guard.client.failures and _round_failed(guard, r):
                err = guard.client.call_rank(r, "round_error").result(10.0)
                parts.append(f"engine rank {r} failed its round (state failed): {err}")
    e = getattr(trainer, "send_error", None)
    if e is not None:
        parts.append(f"trainer send failed: {type(e).__name__}: {e}")
    return "; ".join(parts), dead_ranks


def _phase_of(exc: BaseException) -> str:
    if isinstance(exc, EngineDiedError):
        return exc.phase
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EngineDiedError):
        return cause.phase
    return str(getattr(exc, "phase", "the run"))
