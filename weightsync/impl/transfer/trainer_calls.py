"""The trainer's calls around one round (:mod:`weightsync.impl.transfer.trainer` rules 2 and 3): the
``update_info`` of a declared round, chunks of a plain iterator of pairs, and the engines' RPC run together
with the trainer's side of the data plane. Engine-agnostic (no vLLM import)."""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from weightsync.impl.transfer.control import RENDEZVOUS_ABANDONED
from weightsync.impl.transfer.rounds import pair_problem
from weightsync.spec.errors import TransferTimeoutError

T = TypeVar("T")
#: ``(name, dtype, shape)`` of every tensor of a round, in order.
Declared = list[tuple[str, torch.dtype, tuple[int, ...]]]


def _wire_dtype(dtype: torch.dtype) -> str:
    # vLLM's trainer convention (nccl_engine.py:334): the torch attribute name
    return str(dtype).removeprefix("torch.")


def update_info_of(declared: Declared) -> dict[str, Any]:
    """The ``update_info`` dict of one round over ``declared`` ``(name, dtype, shape)``: exactly vLLM's
    ``NCCLWeightTransferUpdateInfo`` fields (``names``, ``dtype_names``, ``shapes``). Not validated here: a
    dtype the wire cannot carry is vetoed in the round's wire agreement, so the engines are told too."""
    return {
        "names": [n for n, _, _ in declared],
        "dtype_names": [_wire_dtype(d) for _, d, _ in declared],
        "shapes": [list(s) for _, _, s in declared],
    }


def chunks(pairs: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rule 3: consecutive chunks of ``pairs``, each closed after the tensor that makes it exceed ``limit``
    bytes; a chunk is released by this generator before the next is pulled.

    Raises:
        ValueError: an item that is not a ``(str, Tensor)`` pair, naming its position (before the chunk
            that would hold it is announced to any engine).
    """
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for i, item in enumerate(pairs):
        why = pair_problem(i, item)
        if why is not None:
            raise ValueError(f"send_weights: {why}")
        name, t = item
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size > limit:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def recorded(stream: Iterator[T], errors: list[BaseException]) -> Iterator[T]:
    """``stream``, appending to ``errors`` the exception it raises (not ``GeneratorExit``: the consumer
    stopped pulling, on its own failure)."""
    try:
        yield from stream
    except GeneratorExit:
        raise
    except BaseException as exc:
        errors.append(exc)
        raise


#: seconds a trainer whose source raised waits beyond the round's deadline for the engines' answer (their
#: deadline is the same ``timeout_s``, counted from their last progress, which is a little later than ours)
SETTLE_GRACE_S = 5.0
#: How long the trainer waits for an abandoned rendezvous to give up (it polls every few milliseconds;
#: a store call in flight answers within its own deadline only), seconds.
ABANDON_WAIT_S = 2.0


#: Added to a rendezvous timeout of ``TrainerEngine.trainer_init``: the cause the CI met on vLLM as shipped
#: (``tests/test_vllm_moe_dp.py``, ``test_init_while_a_wave_runs_deadlocks_as_shipped_...``; the model's
#: bound ``init_while_serving``). weightsync's patch 0008 refuses such an init instead.
RENDEZVOUS_HINT = (
    "A MoE data-parallel engine takes init_weight_transfer_engine between two steps of its wave: a rank "
    "inside the rendezvous cannot take its part in its peers' step. Call trainer_init before the engines "
    "serve (requests held) or while they are paused (weightsync's controller table, spec/controller.py)."
)


def hint_rendezvous(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` whose :class:`TransferTimeoutError` of phase ``rendezvous`` carries :data:`RENDEZVOUS_HINT` as a
    note (the trainer's side of ``trainer_init``)."""

    def noted() -> T:
        try:
            return fn()
        except TransferTimeoutError as e:
            if e.phase == "rendezvous":
                e.add_note(RENDEZVOUS_HINT)
            raise

    return noted


def _abandon(abandon: threading.Event, f_loc: concurrent.futures.Future[Any]) -> None:
    """Give up a rendezvous still waiting after the engines' RPC failed: it raises at its next poll
    (:data:`~weightsync.impl.transfer.control.RENDEZVOUS_ABANDONED`), and its traceback's frames are cleared,
    so nothing holds the store it hosts and its port is free for a retry (``torch.distributed.TCPStore`` has
    no close: its server stops when the last reference goes)."""
    abandon.set()
    concurrent.futures.wait({f_loc}, timeout=ABANDON_WAIT_S)
    if f_loc.done() and not f_loc.cancelled():
        exc = f_loc.exception()
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)


def concurrently(
    rpc: Callable[[], object],
    local: Callable[[], T],
    timeout_s: float,
    phase: str,
    basis: str = "",
    engines_told: Callable[[BaseException], bool] = lambda exc: False,
    abandon_local: bool = False,
) -> T:
    """Run the engine-side RPC and the trainer's side of the data plane together (rule 2).

    Returns ``local``'s result once both succeeded. ``local`` bounds its own waits; after it finished, the
    RPC gets ``timeout_s`` (``basis``: how it was sized, quoted in the timeout error). If ``local`` fails
    with an error the engines were told of (``engines_told(exc)``: the trainer's source raised, and every
    rank aborts the same bucket), its error is raised once the RPC answered too, or after ``timeout_s`` +
    :data:`SETTLE_GRACE_S`, so the engines' states have settled when the caller goes on. Any other local
    failure (a peer gone, a cut link, a timeout) is raised at once: the engines learn of it only at their
    own deadline. If the RPC fails
    first, ``local`` gets a few seconds to fail with its own (more precise, rank-naming) error, else the
    RPC's error is raised; with ``abandon_local`` (``local`` is the rendezvous the trainer hosts) a
    rendezvous still waiting then is abandoned (it gives up at its next poll and releases the store it
    hosts, so a retry may reuse ``master_port`` at once). Threads still blocked are left to their own
    deadlines (the endpoint is unusable afterwards).

    Raises:
        the first error of either side; TransferTimeoutError (phase ``<phase>/rpc``) if the RPC does not
        return within ``timeout_s`` after the data plane finished.
    """
    exe = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="weightsync-trainer")
    abandon = threading.Event()
    ctx = contextvars.copy_context()
    ctx.run(RENDEZVOUS_ABANDONED.set, abandon)
    try:
        f_rpc = exe.submit(rpc)
        f_loc = exe.submit(ctx.run, local)
        pending: set[concurrent.futures.Future[Any]] = {f_rpc, f_loc}
        while f_loc in pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            if f_loc in done:
                exc = f_loc.exception()
                if exc is not None:
                    if engines_told(exc):
                        # every rank aborts the same bucket: let their answer land before the caller goes
                        # on (a controller's next call must find every rank failed, not still updating)
                        concurrent.futures.wait({f_rpc}, timeout=timeout_s + SETTLE_GRACE_S)
                    raise exc
            if f_rpc in done and f_rpc.exception() is not None:
                rpc_exc = f_rpc.exception()
                assert rpc_exc is not None
                try:
                    f_loc.result(timeout=min(5.0, timeout_s))
                except concurrent.futures.TimeoutError:
                    if abandon_local:
                        _abandon(abandon, f_loc)
                except BaseException as loc_exc:
                    raise loc_exc from rpc_exc
                raise rpc_exc
        t0 = time.monotonic()
        try:
            f_rpc.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TransferTimeoutError(
                f"{phase}/rpc",
                [],
                time.monotonic() - t0,
                "the engines' RPC did not return after the data plane" + (f" ({basis})" if basis else ""),
            ) from None
        return f_loc.result()
    finally:
        exe.shutdown(wait=False)


__all__ = [
    "RENDEZVOUS_HINT",
    "SETTLE_GRACE_S",
    "Declared",
    "chunks",
    "concurrently",
    "hint_rendezvous",
    "recorded",
    "update_info_of",
]
