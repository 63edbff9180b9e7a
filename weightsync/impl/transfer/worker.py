"""The engine-worker weight-transfer API with vLLM's names, driven by the spec's ``WorkerMachine``.

Rules:

1. **Order.** Every call first asks the spec's :class:`~weightsync.spec.worker.WorkerMachine` whether it is
   legal in the current state; an illegal call fires the machine, which raises ``LocalProtocolError`` and
   moves to its sticky ``error`` state, before any side effect (reference section 2's table; vLLM raises
   ``RuntimeError`` instead).
2. **Bad input** (a malformed ``init_info`` / ``update_info``, a non-bool ``is_checkpoint_format``) raises
   ``ValueError`` before the machine or the transport changes. In ``update_weights`` the bad request is
   also vetoed in the round's wire agreement, so the trainer and the other workers fail at once instead of
   timing out.
3. **Names.** In checkpoint format (``is_checkpoint_format=True``) the expected names are
   ``model.checkpoint_weight_names()`` and loading goes through ``model.load_weights``; in kernel format
   they are ``named_parameters()`` names and loading copies by exact name (the transport may receive
   straight into the parameter instead: broadcast rule 5). Buffers (e.g. rotary
   ``inv_freq``) never count (vLLM PR #37334, scenario B4). An unknown name, or a name already loaded in
   this round, is rejected at ``update_weights`` time, before the collective.
4. **Dtypes.** A declared dtype that differs from the destination's is rejected before the collective
   (OpenRLHF #1349 / SkyRL #1852 / vLLM #34186, scenario B17): exactly per name in kernel format, or with
   ``model.checkpoint_weight_dtypes()`` if the model has it; otherwise, when all floating-point parameters
   share one dtype, a floating-point update of another dtype is rejected.
5. **Finish.** ``finish_weight_update`` raises ``IncompleteUpdateError`` listing the expected names that did
   not arrive (the machine stays ``active``, so the round can still be completed); otherwise it runs
   ``process_weights_after_loading`` once and bumps ``weight_version`` (weightsync; RFC #31848).
6. **Transport failures** after payload started moving (timeouts, a failed peer, a checksum mismatch)
   leave the transport unusable until ``init_weight_transfer_engine`` is run again or the worker is shut
   down; the machine's call order is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.impl.transfer.base import (
    DTYPES,
    LoadableModel,
    ParallelInfo,
    TensorMeta,
    UpdateInfo,
    WeightTransferEngine,
)
from weightsync.impl.transfer.registry import WeightTransferEngineFactory
from weightsync.spec.errors import IncompleteUpdateError
from weightsync.spec.worker import WorkerEvent, WorkerMachine, WorkerState


class WeightTransferWorker:
    """One engine worker's weight-transfer endpoint.

    Args:
        model: the model to load into (:class:`~weightsync.impl.transfer.base.LoadableModel`).
        backend: a registered backend name (``"nccl"``, ``"ipc"``), or None for "weight transfer not
            configured" (every call then raises LocalProtocolError, like vLLM's RuntimeError).
        parallel: this worker's DP index, TP/PP sizes and local rank (transfer-rank formula).
        name: shown in protocol errors.
        engine_kwargs: passed to the backend's constructor (e.g. ``device`` for ``ipc``).

    Raises:
        ValueError: unknown backend (listing the known ones), before anything is created.
    """

    def __init__(
        self,
        model: LoadableModel,
        backend: str | None = "nccl",
        parallel: ParallelInfo | None = None,
        name: str = "worker",
        **engine_kwargs: Any,
    ) -> None:
        self.model = model
        self.parallel = parallel if parallel is not None else ParallelInfo()
        self.machine = WorkerMachine(name, configured=False)
        self.engine: WeightTransferEngine | None = None
        if backend is not None:
            engine = WeightTransferEngineFactory.create_engine(backend, self.parallel, **engine_kwargs)
            self.machine.fire(WorkerEvent.CONFIGURE)
            self.engine = engine
        self._expected: frozenset[str] = frozenset()
        self._loaded: set[str] = set()
        self._params: dict[str, torch.nn.Parameter] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._uniform_float: torch.dtype | None = None
        self.bytes_loaded = 0
        self.expected_bytes = 0

    # ------------------------------------------------------------------------------------------ state
    @property
    def state(self) -> WorkerState:
        """The machine's current state."""
        return self.machine.state

    @property
    def weight_version(self) -> int:
        """Number of completed rounds (bumped by :meth:`finish_weight_update`)."""
        return int(self.machine.vars.weight_version)

    @property
    def rank(self) -> int | None:
        """This worker's transfer rank once initialised."""
        return None if self.engine is None else self.engine.rank

    def _legal(self, event: WorkerEvent, **args: Any) -> None:
        if self.machine.select(event, args) is None:
            self.machine.fire(event, **args)  # raises LocalProtocolError, machine -> error (rule 1)

    def _engine(self) -> WeightTransferEngine:
        assert self.engine is not None  # the machine only allows these calls once configured
        return self.engine

    # ------------------------------------------------------------------------------------------ calls
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the transfer group (blocks until the trainer and every worker joined).

        The machine records initialisation only after the join succeeded, so a failed join leaves the
        worker as it was (its ``initialized`` guard still false on a first init).

        Raises:
            LocalProtocolError: not configured, in a round (weightsync rejects re-init while active), after
                an error or shutdown.
            ValueError: malformed ``init_info``, a rank outside the group, or a non-bijective mapping (B1).
            WireMismatchError: the trainer and the workers disagree on ``world_size`` (every rank raises,
                naming each rank's value; ``control`` rule 3).
            PortInUseError / TransferTimeoutError: from the rendezvous.
        """
        self._legal(WorkerEvent.INIT)
        engine = self._engine()
        info = engine.parse_init_info(init_info)
        self.parallel.transfer_rank(info.rank_offset, info.world_size)
        engine.init_transfer_engine(info)
        self.machine.fire(WorkerEvent.INIT)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open a round: reset the per-round bookkeeping (rule 3).

        Raises:
            ValueError: ``is_checkpoint_format`` is not a bool.
            LocalProtocolError: before init, during a round, after an error or shutdown.
        """
        if not isinstance(is_checkpoint_format, bool):
            raise ValueError(f"is_checkpoint_format must be a bool, got {is_checkpoint_format!r}")
        self._legal(WorkerEvent.START, is_checkpoint_format=is_checkpoint_format)
        if is_checkpoint_format:
            expected = frozenset(self.model.checkpoint_weight_names())
            params: dict[str, torch.nn.Parameter] = {}
            dtypes_fn: Callable[[], Mapping[str, torch.dtype]] | None = getattr(
                self.model, "checkpoint_weight_dtypes", None
            )
            dtypes = dict(dtypes_fn()) if dtypes_fn is not None else {}
        else:
            params = dict(self.model.named_parameters())
            expected = frozenset(params)
            dtypes = {n: p.dtype for n, p in params.items()}
        floats = {p.dtype for _, p in self.model.named_parameters() if p.dtype.is_floating_point}
        self.machine.fire(WorkerEvent.START, is_checkpoint_format=is_checkpoint_format)
        self._expected, self._params, self._dtypes = expected, params, dtypes
        self._uniform_float = next(iter(floats)) if len(floats) == 1 else None
        self._loaded = set()
        self.bytes_loaded = 0
        self.expected_bytes = sum(p.numel() * p.element_size() for p in params.values())

    def _check(self, info: UpdateInfo) -> None:
        """Rules 3 and 4 on a parsed update; raises ValueError naming the first offence."""
        kernel = not self.machine.vars.is_checkpoint_format
        for m in info.metas():
            if m.name in self._loaded:
                raise ValueError(
                    f"update_weights: {m.name!r} was already loaded in this round; every weight arrives exactly "
                    "once between start_weight_update and finish_weight_update"
                )
            if m.name not in self._expected:
                what = (
                    "a parameter name (kernel format copies by exact name)" if kernel else "a checkpoint name"
                )
                raise ValueError(f"update_weights: unknown weight {m.name!r}: not {what} of this model")
            declared = DTYPES[m.dtype_name]
            want = self._dtypes.get(m.name)
            if want is None and self._uniform_float is not None and declared.is_floating_point:
                want = self._uniform_float
            if want is not None and declared != want:
                raise ValueError(
                    f"update_weights: {m.name!r} declared as {m.dtype_name} but the model holds "
                    f"{str(want).removeprefix('torch.')}; no implicit cast (OpenRLHF #1349, scenario B17): "
                    "send the model's dtype"
                )
            if kernel:
                shape = tuple(self._params[m.name].shape)
                if m.shape != shape:
                    raise ValueError(
                        f"update_weights: {m.name!r} declared with shape {list(m.shape)}, parameter has {list(shape)}"
                    )

    def _load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if self.machine.vars.is_checkpoint_format:
            loaded = self.model.load_weights(batch)
            self._loaded |= set(loaded)
        else:
            with torch.no_grad():
                for name, t in batch:
                    self._params[name].data.copy_(t)
                    self._loaded.add(name)
        for _, t in batch:
            self.bytes_loaded += t.numel() * t.element_size()

    def _destination(self) -> Callable[[TensorMeta], torch.Tensor | None] | None:
        # kernel format copies by exact name, unchanged: the transport may receive into the parameter
        # (broadcast rule 5); checkpoint format transforms (fuses, shards), so no destination
        if self.machine.vars.is_checkpoint_format:
            return None
        params = self._params
        return lambda m: params[m.name].data if m.name in params else None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one batch of weights from the trainer (callable many times per round).

        Raises:
            LocalProtocolError: outside a round (before start, after finish), after an error or shutdown.
            ValueError: malformed ``update_info``, an unknown or repeated name, or a dtype/shape mismatch
                (rules 2-4); raised on this worker, while peers raise WireMismatchError naming it.
            WireMismatchError: the trainer or a peer disagrees on the wire description or vetoed.
            PeerFailedError / TransferTimeoutError / ChecksumMismatchError: transport failures (rule 6).
        """
        self._legal(WorkerEvent.UPDATE)
        engine = self._engine()
        try:
            info = engine.parse_update_info(update_info)
            self._check(info)
        except ValueError as exc:
            try:
                engine.reject_update(exc)  # veto in the wire agreement so peers fail fast; raises exc
            except ValueError:
                raise
            except Exception as other:  # the veto itself failed (e.g. a peer is gone): report the input error
                raise exc from other
            raise
        self.machine.fire(WorkerEvent.UPDATE)
        engine.receive_weights(info, self._load, destination=self._destination())
        if torch.cuda.is_available():  # pragma: no cover - needs CUDA
            torch.cuda.synchronize()

    def finish_weight_update(self) -> None:
        """Close the round (rule 5).

        Raises:
            LocalProtocolError: not in a round.
            IncompleteUpdateError: some expected names did not arrive (listing them); the round stays open.
        """
        self._legal(WorkerEvent.FINISH)
        missing = self._expected - self._loaded
        if missing:
            raise IncompleteUpdateError(sorted(missing))
        self.machine.fire(WorkerEvent.FINISH)
        self.model.process_weights_after_loading()

    def shutdown(self) -> None:
        """Release the transport; afterwards every call raises LocalProtocolError."""
        self._legal(WorkerEvent.SHUTDOWN)
        self.machine.fire(WorkerEvent.SHUTDOWN)
        if self.engine is not None:
            self.engine.shutdown()

    def round_stats(self) -> dict[str, int]:
        """Bookkeeping of the current (or last) round: expected/loaded name counts and bytes."""
        return {
            "expected": len(self._expected),
            "loaded": len(self._loaded & self._expected),
            "bytes_loaded": self.bytes_loaded,
            "expected_bytes": self.expected_bytes,
        }


def broadcast_worker(model: LoadableModel, dp_index: int) -> WeightTransferWorker:
    """Factory for the engine's ``transfer="weightsync.impl.transfer.worker:broadcast_worker"`` hook
    (one worker per engine, TP = PP = 1)."""
    return WeightTransferWorker(
        model, "nccl", ParallelInfo(dp_index=dp_index), name=f"engine {dp_index} worker"
    )


def ipc_worker(model: LoadableModel, dp_index: int) -> WeightTransferWorker:
    """Factory for ``transfer="weightsync.impl.transfer.worker:ipc_worker"`` (CPU shared memory or CUDA IPC)."""
    return WeightTransferWorker(
        model, "ipc", ParallelInfo(dp_index=dp_index), name=f"engine {dp_index} worker"
    )


__all__ = ["WeightTransferWorker", "broadcast_worker", "ipc_worker"]
