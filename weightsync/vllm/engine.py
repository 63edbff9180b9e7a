"""weightsync's engine-worker backends for vLLM 0.32: subclasses of vLLM's ``WeightTransferEngine``.

``WeightsyncBroadcastEngine`` (backend ``weightsync``) wraps weightsync's packed broadcast
(:mod:`weightsync.impl.transfer.broadcast`: gloo for CPU tensors, NCCL for CUDA);
``WeightsyncIPCEngine`` (backend ``weightsync_ipc``) its same-host transport
(:mod:`weightsync.impl.transfer.ipc`: shared memory on CPU, CUDA IPC on GPU). vLLM's worker builds one
per worker with ``(config, vllm_config, device, model)`` (``v1/worker/gpu_worker.py:599-605``) and drives
it: ``init_transfer_engine`` / ``start_weight_update`` / ``update_weights`` (callable many times) /
``finish_weight_update`` / ``shutdown``.

Rules:

1. **vLLM's request shapes, weightsync's definitions.** ``init_info`` and ``update_info`` are weightsync's
   :class:`~weightsync.impl.transfer.base.InitInfo` / :class:`~weightsync.impl.transfer.base.UpdateInfo`
   (the reference engine parses the same classes), as vLLM dataclasses: vLLM's NCCL fields
   (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``packed``,
   ``packed_buffer_size_bytes``, ``packed_num_buffers``; ``nccl_unique_id_b64`` is accepted and refused:
   weightsync's wire agreement runs over the TCPStore) plus optional weightsync fields (``timeout_s``,
   ``verify``, ``layout``, ``group_backend``, ``is_checkpoint_format`` (True only here) and
   ``moe_reload_fix``). ``update_info`` takes ``names``, ``dtype_names``, ``shapes`` (vLLM's worker picks
   this rank's entry when it is a list indexed by worker rank, ``gpu_worker.py:1570-1578``) plus the
   optional ``verify`` and ``check_finite``. As in vLLM, the packing parameters are fixed at init, from the
   trainer's.
2. **Layout.** ``weightsync`` packs in vLLM's own layout by default (``layout="vllm"``: exceed-then-flush,
   no alignment, ``packed_tensor.py``); ``layout="aligned"`` selects weightsync's.
   ``weightsync_ipc`` defaults to ``"aligned"`` (its peer can only be weightsync's IPC producer, and
   aligned chunks never exceed the shared buffers).
3. **Guarantees kept.** Every update starts with weightsync's wire agreement; a request this worker
   cannot accept (malformed, a name already received this round, a floating dtype other than the
   model's) is vetoed there, so the trainer and every peer fail at once instead of hanging. Every wait
   has a deadline: ``timeout_s``, or without it 300 s for the rendezvous and a round's sized to its bytes
   (``InitInfo.round_deadline``). A trainer whose weight stream raises aborts every rank at
   the bucket being pulled; a worker whose load fails makes every rank fail (broadcast: at the round's
   end status, ``weightsync.impl.transfer.broadcast`` rules 3 and 7; IPC: at that bucket's
   acknowledgement).
4. **Checkpoint format through vLLM's layerwise reload**, as the built-in ``nccl`` engine does
   (``nccl_engine.py:159-173``): ``initialize_layerwise_reload`` at start, ``model.load_weights`` per
   bucket, ``finalize_layerwise_reload`` at finish. ``load_weights`` gets views of the transport's
   buffers, which the transport reuses for later buckets; the reload keeps references to the tensors of
   a layer until it is complete (``reload/layerwise.py:185``), so after each call exactly those are
   copied (:func:`weightsync.vllm.reload.own_retained`), nothing else. ``finish_weight_update`` raises
   ``IncompleteUpdateError`` naming the parameters still missing (vLLM would silently keep old weights,
   or process uninitialised memory). A round that failed inside ``update_weights`` or
   ``finish_weight_update`` is abandoned: the pending layers get their previous weights back
   (``weightsync.vllm.reload``), and a new round recovers.
5. **CPU.** vLLM's ``update_weights`` ends with ``torch.accelerator.synchronize()``
   (``distributed/weight_transfer/base.py:502``), which raises on a CPU-only torch; these engines
   synchronise only a CUDA device.
6. **Call order from the worker table.** Each call first asks the spec's
   :class:`~weightsync.spec.worker.WorkerMachine` (``NoEngine -> Ready <-> Active``) whether it is legal
   now; an illegal one raises :class:`~weightsync.spec.errors.LocalProtocolError` with the table's
   explanation and changes nothing (:data:`weightsync.spec.refusal.ILLEGAL_CALL`, non-sticky). So
   ``init_weight_transfer_engine`` during a round is refused, as the ``vllm-0.32`` variants' rank table
   assumes of the worker (``worker_not_active``; vLLM 0.32 itself replaces the communicator mid-round,
   ``v1/worker/gpu_worker.py:1484-1496``), and a round that failed in ``update_weights`` or
   ``finish_weight_update`` fires ``fail_round`` (Active -> Ready: a new round may start).
7. **Fused-MoE experts restored after every round.** vLLM 0.32 leaves the fused-MoE expert weights in
   checkpoint layout after any layerwise reload on CPU (it skips the CPU prepack on a weight update:
   ``fused_moe/unquantized_fused_moe_method.py:187-203``), which silently changes every MoE output.
   ``finish_weight_update`` re-runs the skipped step on each fused-MoE layer the round reloaded, right
   after ``finalize_layerwise_reload`` (:func:`weightsync.vllm.reload.reprocess_fused_moe`). The
   ``init_info`` option ``moe_reload_fix`` (default None: on where needed, vLLM 0.32.x on CPU;
   ``False`` leaves vLLM's behaviour, to show the corruption; ``True`` forces it) selects it (rule 7).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.impl.transfer.base import (
    DTYPES,
    InitInfo,
    NonFiniteWeightError,
    ParallelInfo,
    UpdateInfo,
    WireArgs,
    non_finite_counts,
)
from weightsync.impl.transfer.base import WeightTransferEngine as Transport
from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine
from weightsync.spec.errors import IncompleteUpdateError, LocalProtocolError
from weightsync.spec.worker import WorkerEvent, WorkerMachine
from weightsync.vllm.reload import (
    abandon_layerwise_reload,
    fused_moe_layers,
    incomplete_parameters,
    moe_layers_reprocessable,
    moe_reload_fix_applies,
    own_retained,
    reload_pending,
    reprocess_fused_moe,
)


@dataclass(kw_only=True)
class MoeReloadOption:
    """The plugin's own optional ``init_info`` field (rule 7), on the workers' and the trainer's info.

    Attributes:
        moe_reload_fix: re-run the fused-MoE experts' processing after each round. None (the default):
            where vLLM needs it (0.32.x on CPU); False: never (vLLM's own result, corrupted experts on
            CPU); True: always.
    """

    moe_reload_fix: bool | None = None

    def _check_moe(self) -> None:
        if self.moe_reload_fix is not None and not isinstance(self.moe_reload_fix, bool):
            raise ValueError(
                f"init_info['moe_reload_fix'] must be a bool or None, not {self.moe_reload_fix!r}"
            )


@dataclass(kw_only=True)
class WeightsyncInitInfo(InitInfo, MoeReloadOption, WeightTransferInitInfo):
    """``init_info`` of the ``weightsync`` / ``weightsync_ipc`` backends (rule 1): weightsync's
    :class:`~weightsync.impl.transfer.base.InitInfo` (vLLM's NCCL fields and weightsync's optional ones,
    one definition for the reference engine and the plugin) plus ``moe_reload_fix``, as a vLLM
    ``WeightTransferInitInfo`` (vLLM builds it with ``cls(**init_info)``).

    Raises:
        ValueError: any rule of ``InitInfo``; a ``moe_reload_fix`` that is not a bool or None; kernel format
            (``is_checkpoint_format=False``: vLLM 0.32 loads checkpoint names through its layerwise reload,
            ``model_loader/reload/inplace.py``; the kernel format is the reference engine's).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_moe()
        if not self.is_checkpoint_format:
            raise ValueError(
                "init_info['is_checkpoint_format']=False: weightsync's vLLM backends load checkpoint names "
                "through vLLM 0.32's layerwise reload (model_loader/reload/inplace.py); the kernel format is "
                "available on weightsync's reference engine only"
            )


@dataclass
class WeightsyncUpdateInfo(UpdateInfo, WeightTransferUpdateInfo):
    """``update_info`` of one ``update_weights`` call (rule 1): weightsync's
    :class:`~weightsync.impl.transfer.base.UpdateInfo` (vLLM's NCCL fields plus the optional ``verify`` and
    ``check_finite``) as a vLLM ``WeightTransferUpdateInfo``.

    Raises:
        ValueError: as ``UpdateInfo``.
    """


class _WeightsyncEngine(WeightTransferEngine):
    """Common part of the two backends: vLLM's lifecycle around a weightsync transport."""

    init_info_cls: ClassVar[type[Any]] = WeightsyncInitInfo
    update_info_cls: ClassVar[type[Any]] = WeightsyncUpdateInfo
    #: layout when ``init_info`` names none (rule 2)
    default_layout: ClassVar[str] = "vllm"

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pc = vllm_config.parallel_config
        # vLLM's own rank formula (distributed/weight_transfer/nccl_common.py:656-662): the DP *index*
        self.parallel = ParallelInfo(
            dp_index=int(pc.data_parallel_index),
            tp_size=int(pc.world_size),
            pp_size=1,
            local_rank=int(pc.rank),
        )
        self.transport: Transport | None = None
        self.rank: int | None = None
        #: the worker table's machine (rule 6): vLLM built this engine, so it starts in ``ready``
        self.machine = WorkerMachine(f"weightsync worker (dp {self.parallel.dp_index}, rank {pc.rank})")
        self._received: set[str] = set()  # names received in the open round
        self._float_dtype: torch.dtype | None = None
        self.moe_reload_fix: bool | None = None  # the init option (rule 7)
        self._moe_layers: list[torch.nn.Module] = []  # fused-MoE layers to reprocess this round
        #: fused-MoE layers reprocessed after the last finished round (rule 7)
        self.moe_layers_reprocessed = 0

    @property
    def rounds_finished(self) -> int:
        """Rounds finished on this worker (the worker table's ``weight_version``)."""
        return int(self.machine.vars.weight_version)

    def _legal(self, event: WorkerEvent) -> None:
        """Raise LocalProtocolError (the table's explanation) when no row takes ``event`` now; nothing
        fires and nothing changes (rule 6)."""
        if self.machine.select(event, {}) is None:
            raise LocalProtocolError(self.machine.explain_illegal(event, {}))

    def _fail_round(self) -> None:
        """A round failed inside ``update_weights`` or ``finish_weight_update``: give the pending layers their
        weights back and fire ``fail_round`` (Active -> Ready, weights marked partial)."""
        abandon_layerwise_reload(self.model)
        self._moe_layers = []
        self.machine.fire(WorkerEvent.FAIL)

    # ---------------------------------------------------------------------------------------- hooks
    def _make_transport(self) -> Transport:
        raise NotImplementedError

    def _group_backend(self, requested: str) -> str:
        return requested

    # ------------------------------------------------------------------------------------ parsing
    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightsyncInitInfo:
        """vLLM's ``cls(**init_info)`` with weightsync's messages (``InitInfo.parse``).

        Raises:
            ValueError: naming the field and the rule.
        """
        return WeightsyncInitInfo.parse(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightsyncUpdateInfo:
        """vLLM's ``cls(**update_info)`` with weightsync's messages (``UpdateInfo.parse``).

        Raises:
            ValueError: naming the field and the rule.
        """
        return WeightsyncUpdateInfo.parse(update_dict)

    @property
    def args(self) -> WireArgs | None:
        """The wire arguments fixed at init (None before)."""
        return None if self.transport is None else self.transport.wire

    # ------------------------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        """Join the trainer's group (blocks until every rank joined, or ``timeout_s``). The current group is
        replaced only once the new one is formed: an init that is refused (a trainer without the
        deployment's secret calling ``/init_weight_transfer_engine``) or fails leaves it working.

        Raises:
            ValueError: the rank is outside the group or the mapping is not a bijection; the policy
                refused ``master_address`` (no secret, not loopback).
            AuthenticationError: the authenticated rendezvous refused this worker or the trainer.
            TransferTimeoutError / PortInUseError: from the rendezvous.
            LocalProtocolError: a round is open (the worker table takes no init while ``active``), before
                any socket opens; the round and the group are unchanged.
        """
        self._legal(WorkerEvent.INIT)
        info = replace(init_info, group_backend=self._group_backend(init_info.group_backend))
        transport = self._make_transport()
        transport.init_transfer_engine(info)
        if self.transport is not None:
            self.transport.shutdown()
        self.transport, self.rank = transport, transport.rank
        self.moe_reload_fix = init_info.moe_reload_fix
        self.machine.fire(WorkerEvent.INIT)

    def start_weight_update(self) -> None:
        """Open a round: vLLM's layerwise reload (rule 4). A reload left pending is abandoned first.

        Raises:
            LocalProtocolError: before init, or while a round is open (rule 6); nothing changes.
        """
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._legal(WorkerEvent.START)
        self._require_transport()
        if reload_pending(self.model):
            abandon_layerwise_reload(self.model)
        floats = {p.dtype for p in self.model.parameters() if p.dtype.is_floating_point}
        self._float_dtype = next(iter(floats)) if len(floats) == 1 else None
        fix = moe_reload_fix_applies(self.device, self.moe_reload_fix)
        self._moe_layers = fused_moe_layers(self.model) if fix else []  # before the layers go to meta
        initialize_layerwise_reload(self.model)
        self._received = set()
        self.machine.fire(WorkerEvent.START)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, check, receive and load one update (rules 1, 3, 4, 5); vLLM's base version minus the
        accelerator synchronize on CPU, plus the veto of a request this worker rejects.

        Raises:
            ValueError: this worker rejected the request (its peers raise WireMismatchError).
            LocalProtocolError: no round is open (rule 6); vetoed as a rejected request, nothing changes.
            WireMismatchError / PeerFailedError / TransferTimeoutError / ChecksumMismatchError.
        """
        transport = self._require_transport()
        in_round = self.machine.select(WorkerEvent.UPDATE, {}) is not None
        try:
            try:
                if not in_round:  # the table takes no update now (rule 6)
                    raise LocalProtocolError(self.machine.explain_illegal(WorkerEvent.UPDATE, {}))
                typed = self.parse_update_info(update_info)
                self._check(typed)
            except (ValueError, LocalProtocolError) as exc:
                try:
                    transport.reject_update(exc)  # the veto: every rank fails before any payload
                except (ValueError, LocalProtocolError):
                    raise
                except Exception as other:  # the veto itself failed (a peer is gone): the input error
                    raise exc from other
                raise
            self.receive_weights(typed)
        except BaseException:
            # vLLM's worker ends the round on any error here (v1/worker/gpu_worker.py:1583), with the
            # layers still on the meta device: the next forward would kill the EngineCore
            # (NotImplementedError in a CPU GEMM on meta tensors). Give the model its weights back.
            if in_round:
                self._fail_round()
            raise
        self.machine.fire(WorkerEvent.UPDATE)
        self._synchronize()

    def _check(self, typed: WeightsyncUpdateInfo) -> None:
        seen = self._received
        for name, dt in zip(typed.names, typed.dtype_names, strict=True):
            if name in seen:
                raise ValueError(
                    f"update_weights: {name!r} was already received in this round; every weight arrives "
                    "exactly once between start_weight_update and finish_weight_update"
                )
            declared = DTYPES[dt]
            want = self._float_dtype
            if want is not None and declared.is_floating_point and declared != want:
                raise ValueError(
                    f"update_weights: {name!r} declared as {dt} but the model holds "
                    f"{str(want).removeprefix('torch.')}; no implicit cast (OpenRLHF #1349): send the "
                    "model's dtype"
                )

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        """Receive one update through the transport and load it with ``model.load_weights``; with
        ``check_finite`` a batch holding NaN / +-Inf fails the round on every rank before it is loaded."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        transport = self._require_transport()
        model = self.model
        check_finite = update_info.check_finite

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            if check_finite:
                bad = non_finite_counts(batch)
                if bad:
                    raise NonFiniteWeightError(bad, {n: t.numel() for n, t in batch if n in bad})
            with disable_mtp_completeness_check():
                model.load_weights(batch)
            # the transport reuses the memory behind ``batch``: copy what the reload still holds (rule 4)
            t0 = time.perf_counter()
            own_retained(model, batch)
            transport.timings.copy_s += time.perf_counter() - t0

        transport.receive_weights(update_info, load)
        self._received.update(update_info.names)

    def finish_weight_update(self) -> None:
        """Close the round: completeness, then vLLM's ``finalize_layerwise_reload`` (rule 4).

        A finish that raises abandons the round, as a failed ``update_weights`` does: the pending layers get
        their previous weights back, and only a new round (``start_weight_update`` ... ``finish``) moves the
        weights (the worker table's ``active --fail_round--> ready``, :mod:`weightsync.spec.worker`). vLLM
        0.32's worker keeps its session open after a failed finish (``v1/worker/gpu_worker.py:1592-1600``,
        unlike ``update_weights`` at ``:1580-1584``); the plugin's patch ``0003`` ends it
        (:mod:`weightsync.vllm_tools.fix`), so the new round's ``start_weight_update`` is accepted.

        Raises:
            LocalProtocolError: no round is open (rule 6); nothing changes.
            IncompleteUpdateError: naming the parameters still missing; the round is abandoned.
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._legal(WorkerEvent.FINISH)
        try:
            missing = incomplete_parameters(self.model)
            if missing:
                raise IncompleteUpdateError(missing)
            moe = moe_layers_reprocessable(self.model, self._moe_layers)
            finalize_layerwise_reload(self.model, self.model_config)
            self.moe_layers_reprocessed = reprocess_fused_moe(moe)  # rule 7, after vLLM's finalize
        except BaseException:
            self._fail_round()
            raise
        self._moe_layers = []
        self.machine.fire(WorkerEvent.FINISH)

    def shutdown(self) -> None:
        """Release the transport (idempotent). vLLM calls it for ``shutdown_weight_transfer_engine`` too, which
        releases the trainer's connection and keeps this engine for a later init
        (``v1/worker/gpu_worker.py:1498-1505``), so it fires no worker-table event (the table's ``shutdown``
        is final); a start without a transport is :meth:`_require_transport`'s error."""
        if self.transport is not None:
            self.transport.shutdown()
            self.transport = None

    # ---------------------------------------------------------------------------------------- helpers
    def _require_transport(self) -> Transport:
        if self.transport is None:
            raise RuntimeError(
                f"{type(self).__name__} is not initialised: call init_weight_transfer_engine first"
            )
        return self.transport

    def _synchronize(self) -> None:
        """Rule 5: vLLM's base class calls ``torch.accelerator.synchronize()``, which raises on CPU."""
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.device)


class WeightsyncBroadcastEngine(_WeightsyncEngine):
    """Backend ``weightsync``: weightsync's packed broadcast (gloo for CPU tensors, NCCL for CUDA)."""

    default_layout: ClassVar[str] = "vllm"

    def _make_transport(self) -> Transport:
        return BroadcastWeightTransferEngine(self.parallel, self.default_layout)

    def _group_backend(self, requested: str) -> str:
        if requested == "auto":
            return "nccl" if self.device.type == "cuda" else "gloo"
        return requested


class WeightsyncIPCEngine(_WeightsyncEngine):
    """Backend ``weightsync_ipc``: weightsync's same-host transport (shared memory on CPU, CUDA IPC)."""

    default_layout: ClassVar[str] = "aligned"

    def _make_transport(self) -> Transport:
        return IPCWeightTransferEngine(self.parallel, device=self.device, default_layout=self.default_layout)


__all__ = [
    "MoeReloadOption",
    "WeightsyncBroadcastEngine",
    "WeightsyncIPCEngine",
    "WeightsyncInitInfo",
    "WeightsyncUpdateInfo",
]
