"""weightsync's engine-worker backends for vLLM 0.32: subclasses of vLLM's ``WeightTransferEngine``.

``WeightsyncBroadcastEngine`` (backend ``weightsync``) wraps weightsync's packed broadcast
(:mod:`weightsync.impl.transfer.broadcast`: gloo for CPU tensors, NCCL for CUDA);
``WeightsyncIPCEngine`` (backend ``weightsync_ipc``) its same-host transport
(:mod:`weightsync.impl.transfer.ipc`: shared memory on CPU, CUDA IPC on GPU). vLLM's worker builds one
per worker with ``(config, vllm_config, device, model)`` (``v1/worker/gpu_worker.py:599-605``) and drives
it: ``init_transfer_engine`` / ``start_weight_update`` / ``update_weights`` (callable many times) /
``finish_weight_update`` / ``shutdown``.

Rules:

1. **vLLM's request shapes.** ``init_info`` takes the fields of vLLM's ``NCCLWeightTransferInitInfo``
   (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``packed``,
   ``packed_buffer_size_bytes``, ``packed_num_buffers``; ``nccl_unique_id_b64`` is accepted and refused:
   weightsync's wire agreement runs over the TCPStore) plus optional weightsync fields (``timeout_s``,
   ``verify``, ``layout``, ``group_backend``). ``update_info`` takes ``names``, ``dtype_names``,
   ``shapes`` (vLLM's worker picks this rank's entry when it is a list indexed by worker rank,
   ``gpu_worker.py:1570-1578``) plus an optional ``verify``. As in vLLM, the packing parameters are fixed at
   init, from the trainer's.
2. **Layout.** ``weightsync`` packs in vLLM's own layout by default (``layout="vllm"``: exceed-then-flush,
   no alignment, ``packed_tensor.py``); ``layout="aligned"`` selects weightsync's.
   ``weightsync_ipc`` defaults to ``"aligned"`` (its peer can only be weightsync's IPC producer, and
   aligned chunks never exceed the shared buffers).
3. **Guarantees kept.** Every update starts with weightsync's wire agreement; a request this worker
   cannot accept (malformed, a name already received this round, a floating dtype other than the
   model's) is vetoed there, so the trainer and every peer fail at once instead of hanging. Every wait
   has a deadline: ``timeout_s``, or without it 300 s for the rendezvous and a round's sized to its bytes
   (``RendezvousInitInfo.round_deadline``). A failure in any bucket aborts that bucket on every rank.
4. **Checkpoint format through vLLM's layerwise reload**, as the built-in ``nccl`` engine does
   (``nccl_engine.py:159-173``): ``initialize_layerwise_reload`` at start, ``model.load_weights`` per
   bucket, ``finalize_layerwise_reload`` at finish. Tensors are copied before ``load_weights``: the
   reload keeps references to them until their layer is complete (``reload/layerwise.py:185``) and the
   transports reuse their buffers. ``finish_weight_update`` raises ``IncompleteUpdateError`` naming the
   parameters still missing (vLLM would silently keep old weights, or process uninitialised memory); the
   round stays open. A round that failed inside ``update_weights`` is abandoned: the pending layers get
   their previous weights back (``weightsync.vllm.reload``).
5. **CPU.** vLLM's ``update_weights`` ends with ``torch.accelerator.synchronize()``
   (``distributed/weight_transfer/base.py:502``), which raises on a CPU-only torch; these engines
   synchronise only a CUDA device.
6. **Fused-MoE experts restored after every round.** vLLM 0.32 leaves the fused-MoE expert weights in
   checkpoint layout after any layerwise reload on CPU (it skips the CPU prepack on a weight update:
   ``fused_moe/unquantized_fused_moe_method.py:187-203``), which silently changes every MoE output.
   ``finish_weight_update`` re-runs the skipped step on each fused-MoE layer the round reloaded, right
   after ``finalize_layerwise_reload`` (:func:`weightsync.vllm.reload.reprocess_fused_moe`). The
   ``init_info`` option ``moe_reload_fix`` (default None: on where needed, vLLM 0.32.x on CPU;
   ``False`` leaves vLLM's behaviour, to show the corruption; ``True`` forces it) selects it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.impl.transfer.base import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DTYPES,
    ParallelInfo,
    RendezvousInitInfo,
    SendArgs,
    UpdateInfo,
)
from weightsync.impl.transfer.base import WeightTransferEngine as Transport
from weightsync.impl.transfer.broadcast import BroadcastWeightTransferEngine
from weightsync.impl.transfer.ipc import IPCWeightTransferEngine
from weightsync.spec.errors import IncompleteUpdateError
from weightsync.vllm.reload import (
    abandon_layerwise_reload,
    fused_moe_layers,
    incomplete_parameters,
    moe_layers_reprocessable,
    moe_reload_fix_applies,
    reload_pending,
    reprocess_fused_moe,
)

#: weightsync's optional ``init_info`` fields, with their defaults (omitted from produced dicts when at
#: the default, so those dicts also parse in vLLM's ``NCCLWeightTransferInitInfo``).
INIT_EXTRAS: dict[str, Any] = {
    "timeout_s": None,
    "verify": False,
    "layout": "vllm",
    "group_backend": "auto",
    "moe_reload_fix": None,
}


@dataclass(kw_only=True)
class WeightsyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of the ``weightsync`` / ``weightsync_ipc`` backends (rule 1).

    Attributes:
        master_address, master_port: the trainer's TCPStore (the trainer is rank 0 and hosts it).
        rank_offset: transfer rank of the first worker (vLLM's trainer always sends 1).
        world_size: trainer + every worker of every DP replica.
        nccl_unique_id_b64: vLLM's torch-free rendezvous; refused (weightsync needs the TCPStore).
        packed, packed_buffer_size_bytes, packed_num_buffers: the wire parameters, as vLLM's (worker
            defaults: unpacked, 1 GiB, 2).
        timeout_s: deadline of every wait (weightsync). None (the default): the rendezvous waits 300 s and
            each round's waits are sized to its bytes (``RendezvousInitInfo.round_deadline``).
        verify: CRC32 per bucket, compared on every rank (weightsync; default off).
        layout: ``"vllm"`` or ``"aligned"`` (weightsync; rule 2); None takes the backend's default.
        group_backend: ``"auto"`` (NCCL for a CUDA device, else gloo), ``"gloo"`` or ``"nccl"``.
        moe_reload_fix: re-run the fused-MoE experts' processing after each round (rule 6; weightsync).
            None (the default): where vLLM needs it (0.32.x on CPU); False: never (vLLM's own result,
            corrupted experts on CPU); True: always.

    Raises:
        ValueError: a missing rendezvous, a unique id, or any field weightsync's parser rejects.
    """

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = field(default=None, repr=False)
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float | None = None
    verify: bool = False
    layout: str | None = None
    group_backend: str = "auto"
    moe_reload_fix: bool | None = None

    def __post_init__(self) -> None:
        if self.moe_reload_fix is not None and not isinstance(self.moe_reload_fix, bool):
            raise ValueError(
                f"init_info['moe_reload_fix'] must be a bool or None, not {self.moe_reload_fix!r}"
            )
        if self.nccl_unique_id_b64:
            raise ValueError(
                "init_info['nccl_unique_id_b64']: weightsync's backends rendezvous on the trainer's TCPStore "
                "(it carries the wire agreement and the per-bucket status); pass master_address and "
                "master_port instead"
            )
        if self.master_address is None or self.master_port is None:
            raise ValueError(
                "init_info needs both master_address and master_port (got "
                f"master_address={self.master_address!r}, master_port={self.master_port!r})"
            )
        self.rendezvous()
        self.send_args("aligned")

    def rendezvous(self, backend: str | None = None) -> RendezvousInitInfo:
        """weightsync's validated rendezvous record (``backend`` overrides ``group_backend``).

        Raises:
            ValueError: as :meth:`RendezvousInitInfo.parse`.
        """
        d: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "backend": backend or self.group_backend,
        }
        if self.timeout_s is not None:  # else weightsync's work-sized deadlines
            d["timeout_s"] = self.timeout_s
        return RendezvousInitInfo.parse(d)

    def send_args(self, default_layout: str) -> SendArgs:
        """The wire parameters as weightsync's :class:`SendArgs`.

        Raises:
            ValueError: as :meth:`SendArgs.parse`.
        """
        return SendArgs.parse(
            {
                "packed": self.packed,
                "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
                "packed_num_buffers": self.packed_num_buffers,
                "verify": self.verify,
                "layout": self.layout if self.layout is not None else default_layout,
            }
        )


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of one ``update_weights`` call (rule 1): vLLM's NCCL fields plus ``verify``.

    Raises:
        ValueError: unequal lengths, an empty or repeated name, an unknown dtype name, a bad shape.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    verify: bool | None = None

    def __post_init__(self) -> None:
        self.parsed()

    def parsed(self) -> UpdateInfo:
        """weightsync's validated record (packing fields at their defaults; the engine sets them)."""
        d: dict[str, Any] = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        if self.verify is not None:
            d["verify"] = self.verify
        return UpdateInfo.parse(d)


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
        self.args: SendArgs | None = None
        self.rank: int | None = None
        self._received: set[str] | None = None  # names received in the open round
        self._float_dtype: torch.dtype | None = None
        self.rounds_finished = 0
        self.moe_reload_fix: bool | None = None  # the init option (rule 6)
        self._moe_layers: list[torch.nn.Module] = []  # fused-MoE layers to reprocess this round
        #: fused-MoE layers reprocessed after the last finished round (rule 6)
        self.moe_layers_reprocessed = 0

    # ---------------------------------------------------------------------------------------- hooks
    def _make_transport(self) -> Transport:
        raise NotImplementedError

    def _group_backend(self, requested: str) -> str:
        return requested

    # ------------------------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        """Join the trainer's group (blocks until every rank joined, or ``timeout_s``).

        Raises:
            ValueError: the rank is outside the group or the mapping is not a bijection.
            TransferTimeoutError / PortInUseError: from the rendezvous.
        """
        rinfo = init_info.rendezvous(self._group_backend(init_info.group_backend))
        args = init_info.send_args(self.default_layout)
        if self.transport is not None:
            self.transport.shutdown()
            self.transport = None
        transport = self._make_transport()
        transport.init_transfer_engine(rinfo)
        self.transport, self.args, self.rank = transport, args, transport.rank
        self.moe_reload_fix = init_info.moe_reload_fix

    def start_weight_update(self) -> None:
        """Open a round: vLLM's layerwise reload (rule 4). A round left unfinished by a failed
        ``update_weights`` is abandoned first."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._require_transport()
        if reload_pending(self.model):
            abandon_layerwise_reload(self.model)
        floats = {p.dtype for p in self.model.parameters() if p.dtype.is_floating_point}
        self._float_dtype = next(iter(floats)) if len(floats) == 1 else None
        fix = moe_reload_fix_applies(self.device, self.moe_reload_fix)
        self._moe_layers = fused_moe_layers(self.model) if fix else []  # before the layers go to meta
        initialize_layerwise_reload(self.model)
        self._received = set()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, check, receive and load one update (rules 1, 3, 4, 5); vLLM's base version minus the
        accelerator synchronize on CPU, plus the veto of a request this worker rejects.

        Raises:
            ValueError: this worker rejected the request (its peers raise WireMismatchError).
            WireMismatchError / PeerFailedError / TransferTimeoutError / ChecksumMismatchError.
        """
        transport = self._require_transport()
        try:
            try:
                typed = self.parse_update_info(update_info)
                self._check(typed)
            except ValueError as exc:
                try:
                    transport.reject_update(exc)  # the veto: every rank fails before any payload
                except ValueError:
                    raise
                except Exception as other:  # the veto itself failed (a peer is gone): the input error
                    raise exc from other
                raise
            self.receive_weights(typed)
        except BaseException:
            # vLLM's worker ends the round on any error here (v1/worker/gpu_worker.py:1583), with the
            # layers still on the meta device: the next forward would kill the EngineCore
            # (NotImplementedError in a CPU GEMM on meta tensors). Give the model its weights back.
            abandon_layerwise_reload(self.model)
            self._received = None
            raise
        self._synchronize()

    def _check(self, typed: WeightsyncUpdateInfo) -> None:
        if self._received is None:
            raise ValueError("update_weights outside a round: call start_weight_update first")
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
        """Receive one update through the transport and load it with ``model.load_weights``."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        transport = self._require_transport()
        assert self.args is not None and self._received is not None
        base = update_info.parsed()
        info = UpdateInfo(
            names=base.names,
            dtype_names=base.dtype_names,
            shapes=base.shapes,
            packed=self.args.packed,
            packed_buffer_size_bytes=self.args.packed_buffer_size_bytes,
            packed_num_buffers=self.args.packed_num_buffers,
            verify=self.args.verify if update_info.verify is None else update_info.verify,
            layout=self.args.layout,
        )
        model = self.model

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            # copies: the layerwise reload keeps references until a layer is complete (rule 4)
            owned = [(n, t.clone()) for n, t in batch]
            with disable_mtp_completeness_check():
                model.load_weights(owned)

        transport.receive_weights(info, load)
        self._received.update(base.names)

    def finish_weight_update(self) -> None:
        """Close the round: completeness, then vLLM's ``finalize_layerwise_reload`` (rule 4).

        Raises:
            IncompleteUpdateError: naming the parameters still missing; the round stays open.
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._received is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        missing = incomplete_parameters(self.model)
        if missing:
            raise IncompleteUpdateError(missing)
        moe = moe_layers_reprocessable(self.model, self._moe_layers)
        finalize_layerwise_reload(self.model, self.model_config)
        self.moe_layers_reprocessed = reprocess_fused_moe(moe)  # rule 6, after vLLM's finalize
        self._moe_layers = []
        self._received = None
        self.rounds_finished += 1

    def shutdown(self) -> None:
        """Release the transport (idempotent)."""
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
        return BroadcastWeightTransferEngine(self.parallel)

    def _group_backend(self, requested: str) -> str:
        if requested == "auto":
            return "nccl" if self.device.type == "cuda" else "gloo"
        return requested


class WeightsyncIPCEngine(_WeightsyncEngine):
    """Backend ``weightsync_ipc``: weightsync's same-host transport (shared memory on CPU, CUDA IPC)."""

    default_layout: ClassVar[str] = "aligned"

    def _make_transport(self) -> Transport:
        return IPCWeightTransferEngine(self.parallel, device=self.device)


__all__ = [
    "INIT_EXTRAS",
    "WeightsyncBroadcastEngine",
    "WeightsyncIPCEngine",
    "WeightsyncInitInfo",
    "WeightsyncUpdateInfo",
]
