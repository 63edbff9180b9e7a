"""The engine-worker weight-transfer API with vLLM's names, driven by the spec's ``WorkerMachine``.

Rules:

1. **Order.** Every call first asks the spec's :class:`~weightsync.spec.worker.WorkerMachine` whether it is
   legal in the current state; an illegal call fires the machine, which raises ``LocalProtocolError`` and
   moves to its sticky ``error`` state, before any side effect (vLLM 0.32
   ``v1/worker/gpu_worker.py:1477-1604`` raises ``RuntimeError`` instead).
2. **Bad input** (a malformed ``init_info`` / ``update_info``, a list ``update_info`` without an entry for
   this worker) raises ``ValueError`` before the machine or the transport changes. In ``update_weights``
   the bad request is also vetoed in the round's wire agreement, so the trainer and the other workers fail
   at once instead of timing out. The request shapes are vLLM 0.32's (:mod:`weightsync.impl.transfer.base`):
   packing in ``init_info``, ``update_info`` a dict or a list indexed by global worker rank
   (``v1/worker/gpu_worker.py:1570-1578``).
3. **Names.** The format is ``init_info['is_checkpoint_format']`` (vLLM 0.32's ``start_weight_update()``
   takes no argument). In checkpoint format (True, the default) the expected names are
   ``model.checkpoint_weight_names()`` and loading goes through ``model.load_weights``; in kernel format
   they are ``named_parameters()`` names and loading copies by exact name (the transport may receive
   straight into the parameter instead: broadcast rule 5). Buffers (e.g. rotary
   ``inv_freq``) never count (vLLM PR #37334, scenario B4). An unknown name, or a name already loaded in
   this round, is rejected at ``update_weights`` time, before the collective.
3a. **Tied aliases** (checkpoint format only). Names of ``model.tied_checkpoint_weights()`` (a tied
   model's ``lm_head.weight``, which Hugging Face's ``state_dict()`` includes) are accepted although not
   expected, at most once per round. An ``update_weights`` call that carries an alias, or the source of an
   alias held from an earlier call of the round, is *staged*: its tensors are copied aside as they arrive
   (one extra copy of that call's bytes) and handed to ``model.load_weights`` in one call when the call's
   last tensor has arrived, still inside the transport's round, so a refusal reaches every rank. An alias
   whose source has not arrived yet in this round is held until it does. ``load_weights`` compares the
   alias with its source bit for bit before copying anything (``TiedWeightMismatchError`` otherwise), so a
   refused call changes no parameter; the calls before it in the round stay loaded (rule 6). Trainers that
   omit the alias (``iter_checkpoint_weights``) pay nothing.
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
7. **Finite values** (opt-in, ``update_info['check_finite']=True``; default False, when NaN and Inf are
   loaded and served like any other value). Every batch the transport hands over is scanned before
   ``load_weights`` sees it; any NaN / +Inf / -Inf in a floating-point tensor raises
   :class:`~weightsync.impl.transfer.base.NonFiniteWeightError` naming each such weight and its count of
   non-finite elements, and the transport fails the round on every rank (peers raise PeerFailedError
   naming this rank). The transport never receives in place under this flag (as with ``verify``), so no
   non-finite value reaches a parameter. State afterwards: parameters hold the values of the batches loaded
   before the refused one (earlier calls of the round, and earlier batches of this call unless the call was
   staged under rule 3a, which then loaded nothing), the refused batch and every later one are not loaded,
   ``weight_version`` is unchanged, the machine stays ``active`` and
   ``finish_weight_update`` raises IncompleteUpdateError naming the refused weights (the round cannot
   finish on this transport, rule 6); an engine rank stops stepping when ``update_weights`` fails, so it
   never serves these weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.impl.transfer.base import (
    DTYPES,
    InitInfo,
    LoadableModel,
    NonFiniteWeightError,
    ParallelInfo,
    TensorMeta,
    UpdateInfo,
    WeightTransferEngine,
    non_finite_counts,
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
        self._tied: dict[str, str] = {}  # alias -> source (rule 3a), this round
        self._tied_seen: set[str] = set()  # aliases accepted or held in this round
        self._held: list[tuple[str, torch.Tensor]] = []  # aliases waiting for their source
        self._stage: list[tuple[str, torch.Tensor]] | None = None  # this call's tensors when staged
        self._stage_left: set[str] = set()  # names of the staged call not arrived yet
        self._check_finite = False  # this call's update_info['check_finite'] (rule 7)
        self.init_info: InitInfo | None = None  # the last successful init (its is_checkpoint_format: rule 3)
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
        self.init_info = info

    def start_weight_update(self) -> None:
        """Open a round in ``init_info``'s format: reset the per-round bookkeeping (rule 3).

        Raises:
            LocalProtocolError: before init, during a round, after an error or shutdown.
        """
        is_checkpoint_format = self.init_info.is_checkpoint_format if self.init_info is not None else True
        self._legal(WorkerEvent.START, is_checkpoint_format=is_checkpoint_format)
        if is_checkpoint_format:
            expected = frozenset(self.model.checkpoint_weight_names())
            params: dict[str, torch.nn.Parameter] = {}
            dtypes_fn: Callable[[], Mapping[str, torch.dtype]] | None = getattr(
                self.model, "checkpoint_weight_dtypes", None
            )
            dtypes = dict(dtypes_fn()) if dtypes_fn is not None else {}
            tied_fn: Callable[[], Mapping[str, str]] | None = getattr(
                self.model, "tied_checkpoint_weights", None
            )
            tied = {
                a: src for a, src in (tied_fn() if tied_fn is not None else {}).items() if a not in expected
            }
            for alias, src in tied.items():
                if src in dtypes and alias not in dtypes:
                    dtypes[alias] = dtypes[src]
        else:
            params = dict(self.model.named_parameters())
            expected = frozenset(params)
            dtypes = {n: p.dtype for n, p in params.items()}
            tied = {}
        floats = {p.dtype for _, p in self.model.named_parameters() if p.dtype.is_floating_point}
        self.machine.fire(WorkerEvent.START, is_checkpoint_format=is_checkpoint_format)
        self._expected, self._params, self._dtypes = expected, params, dtypes
        self._uniform_float = next(iter(floats)) if len(floats) == 1 else None
        self._loaded = set()
        self._tied, self._tied_seen, self._held = tied, set(), []
        self._stage, self._stage_left = None, set()
        self.bytes_loaded = 0
        self.expected_bytes = sum(p.numel() * p.element_size() for p in params.values())

    def _check(self, info: UpdateInfo) -> None:
        """Rules 3 and 4 on a parsed update; raises ValueError naming the first offence."""
        kernel = not self.machine.vars.is_checkpoint_format
        for m in info.metas():
            if m.name in self._loaded or m.name in self._tied_seen:
                raise ValueError(
                    f"update_weights: {m.name!r} was already loaded in this round; every weight arrives exactly "
                    "once between start_weight_update and finish_weight_update"
                )
            if m.name not in self._expected and m.name not in self._tied:
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
        if self._check_finite:  # rule 7: before any byte of the batch is copied into the model
            bad = non_finite_counts(batch)
            if bad:
                raise NonFiniteWeightError(bad, {n: t.numel() for n, t in batch if n in bad})
        if self._stage is not None:  # rule 3a: copy aside until the call's last tensor arrived
            self._stage.extend((n, t.detach().clone()) for n, t in batch)
            self._stage_left.difference_update(n for n, _ in batch)
            if self._stage_left:
                return
            batch, self._stage = self._stage, None
            batch = self._pair_tied(batch)
        if self.machine.vars.is_checkpoint_format:
            if batch:
                loaded = self.model.load_weights(batch)
                self._loaded |= set(loaded)
            self._tied_seen.update(n for n, _ in batch if n in self._tied)
            self._tied_seen.update(n for n, _ in self._held)
        else:
            with torch.no_grad():
                for name, t in batch:
                    self._params[name].data.copy_(t)
                    self._loaded.add(name)
        for _, t in batch:
            self.bytes_loaded += t.numel() * t.element_size()

    def _pair_tied(self, batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Rule 3a on a staged call: hold the aliases whose source has not arrived in this round, and add
        the held aliases whose source is in ``batch``; returns what ``load_weights`` gets."""
        names = {n for n, _ in batch}
        out: list[tuple[str, torch.Tensor]] = []
        newly_held: list[tuple[str, torch.Tensor]] = []
        for name, t in batch:
            src = self._tied.get(name)
            if src is not None and src not in names and src not in self._loaded:
                newly_held.append((name, t))
            else:
                out.append((name, t))
        keep: list[tuple[str, torch.Tensor]] = []
        for name, t in self._held:
            (out if self._tied[name] in names else keep).append((name, t))
        self._held = keep + newly_held
        return out

    def _destination(self) -> Callable[[TensorMeta], torch.Tensor | None] | None:
        # kernel format copies by exact name, unchanged: the transport may receive into the parameter
        # (broadcast rule 5); checkpoint format transforms (fuses, shards), so no destination; with
        # check_finite the bytes must be scanned before they become weights (rule 7)
        if self.machine.vars.is_checkpoint_format or self._check_finite:
            return None
        params = self._params
        return lambda m: params[m.name].data if m.name in params else None

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one batch of weights from the trainer (callable many times per round). ``update_info``
        is this worker's dict, or a list of one dict per worker of every replica, indexed by
        ``dp_index * tp * pp + local_rank`` (vLLM's worker, ``v1/worker/gpu_worker.py:1570-1578``).

        Raises:
            LocalProtocolError: outside a round (before start, after finish), after an error or shutdown.
            ValueError: malformed ``update_info``, a list without this worker's entry, an unknown or
                repeated name, or a dtype/shape mismatch (rules 2-4); raised on this worker, while peers
                raise WireMismatchError naming it.
            WireMismatchError: the trainer or a peer disagrees on the wire description or vetoed.
            TiedWeightMismatchError: (a WireMismatchError, from ``load_weights``) a tied alias differs
                from its source (rule 3a); nothing of this call was loaded; peers raise PeerFailedError.
            NonFiniteWeightError: ``check_finite`` and a received weight holds NaN/Inf (rule 7); peers
                raise PeerFailedError.
            PeerFailedError / TransferTimeoutError / ChecksumMismatchError: transport failures (rule 6).
        """
        self._legal(WorkerEvent.UPDATE)
        engine = self._engine()
        try:
            info = engine.parse_update_info(self.parallel.local_update_info(update_info))
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
        self._check_finite = info.check_finite
        sources = {self._tied[a] for a, _ in self._held}
        staged = any(n in self._tied or n in sources for n in info.names)
        self._stage = [] if staged else None
        self._stage_left = set(info.names) if staged else set()
        engine.receive_weights(info, self._load, destination=self._destination())
        if torch.cuda.is_available():  # pragma: no cover - needs CUDA
            torch.cuda.synchronize()

    def finish_weight_update(self) -> None:
        """Close the round (rule 5).

        Raises:
            LocalProtocolError: not in a round.
            IncompleteUpdateError: some expected names did not arrive (listing them), including the source
                of a tied alias still held (rule 3a); the round stays open.
        """
        self._legal(WorkerEvent.FINISH)
        missing = (self._expected - self._loaded) | {self._tied[a] for a, _ in self._held}
        if missing:
            raise IncompleteUpdateError(sorted(missing))
        self.machine.fire(WorkerEvent.FINISH)
        self.model.process_weights_after_loading()

    def fail_round(self) -> None:
        """The round failed (an update or finish raised, or the rank refused its version): abandon it. The
        worker is ready for a new round; its weights are marked partial (``machine.vars.partial``) until a
        round completes. A no-op where the machine has no such row (after shutdown or an error)."""
        if self.machine.select(WorkerEvent.FAIL, {}) is not None:
            self.machine.fire(WorkerEvent.FAIL)
            self._loaded = set()

    def fail_init(self) -> None:
        """``init_weight_transfer_engine`` failed: the worker must be initialised again before a round."""
        if self.machine.select(WorkerEvent.FAIL_INIT, {}) is not None:
            self.machine.fire(WorkerEvent.FAIL_INIT)

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
