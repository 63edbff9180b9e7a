"""IPC transport, registered as ``ipc``: colocated trainer and engines share memory on one host.

Rules:

1. **Buffers.** The trainer (producer, rank 0) owns ``packed_num_buffers`` packing buffers, allocated once
   and reused across syncs: CUDA tensors exported with ``torch.multiprocessing.reductions.reduce_tensor``
   and keyed by GPU UUID (vLLM's ``ipc_handles``), or, on CPU, files in ``/dev/shm`` mapped with
   ``torch.from_file(shared=True)`` by producer and consumers. A tensor larger than the buffer travels in a
   temporary segment of its own, freed once every consumer acknowledged it.
2. **Control channel.** Handles, chunk announcements and acknowledgements are JSON over the group's
   TCPStore (``control.ControlPlane``); nothing received is unpickled (vLLM refuses pickled handles unless
   ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Tensor data never crosses a socket.
3. **Consumer copies.** A consumer rebuilds (once, cached) the shared buffer, views the chunk's tensors and
   copies them out: CUDA clones each tensor before ``load_weights``; CPU hands views to ``load_weights``,
   which copies them into the model, so exactly one copy lands in the destination. Nothing loaded aliases
   the shared buffer.
4. **Ack implies copy complete.** A consumer acknowledges chunk ``k`` only after ``load_weights`` returned
   and (CUDA) the device synchronised; the producer refills a buffer only after every consumer
   acknowledged the chunk it held (THUDM/slime #929, scenario B7: acking after *enqueuing* copies let the
   producer overwrite data still being read).
5. **Zero-copy producer (CPU).** A trainer that keeps its tensors in a :class:`SharedBuffer` (a
   ``/dev/shm/weightsync-*`` file, e.g. one flat buffer of parameter views laid out by
   :func:`~weightsync.impl.transfer.packing.flat_layout`) needs no packing: a chunk whose tensors lie in
   such a buffer at the packed offsets (packing rule 7) is announced as (buffer handle, byte offset) and
   each consumer copies straight out of the trainer's own memory, one copy per destination, as colocated
   CUDA IPC does with the trainer's GPU tensors. Such chunks use no packing buffer, so the producer does
   not wait between them; it still returns only after every consumer acknowledged every chunk (rule 4),
   so the trainer may modify its tensors as soon as ``send_weights`` returns. Tensors in other
   shared memory (``Tensor.share_memory_()``: a file descriptor that cannot travel over a JSON channel)
   are packed.
6. **Closing.** ``IPCTrainer.close`` waits (at most ``timeout_s``) until every consumer read the verdict
   of the last round before it stops hosting the store, so a consumer still reading ``r{seq}/done`` does
   not lose the store under it.
7. The wire agreement and abort rules are those of :mod:`weightsync.impl.transfer.rounds`; an error ack
   makes the producer publish an abort that every consumer raises as PeerFailedError.

The handles and shared-memory segments themselves are :mod:`weightsync.impl.transfer.ipc_handles`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.impl.transfer.base import (
    Destination,
    InitInfo,
    LoadFn,
    LocalCheck,
    ParallelInfo,
    TensorMeta,
    UpdateInfo,
    WeightTransferEngine,
    WireArgs,
)
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.ipc_handles import (
    Segment,
    SharedBuffer,
    decode_cuda_handle,
    encode_cuda_handle,
    gpu_uuid,
    import_handles,
    shared_chunk,
)
from weightsync.impl.transfer.packing import (
    Bucket,
    as_bytes,
    bucket_digest,
    check_bucket,
    contiguous_run,
    max_packed_bucket,
    pack_bucket,
    pool_cap,
    unpack_bucket,
)
from weightsync.impl.transfer.rendezvous import rendezvous
from weightsync.impl.transfer.rounds import TensorFeed, open_receive_round, veto_round
from weightsync.impl.transfer.sender import RoundSender
from weightsync.spec.errors import PeerFailedError

PHASE_CHUNK = "update_weights/ipc_chunk"
PHASE_ACK = "update_weights/ipc_ack"


def _round_failed(seq: int, failures: Sequence[tuple[int, str]]) -> PeerFailedError:
    """The error every rank raises when ``failures`` (``(rank, error text)`` pairs) ended round ``seq``."""
    return PeerFailedError(
        [r for r, _ in failures],
        f"{PHASE_ACK} (round {seq})",
        "; ".join(f"rank {r}: {e}" for r, e in failures) + "; every rank aborts this update",
    )


# ----------------------------------------------------------------------------------------- producer


class IPCTrainer(RoundSender):
    """The producer (trainer, rank 0) of an IPC group. Hosts the TCPStore; owns the shared buffers.
    ``send`` (rules 1-5), ``send_stream`` and ``reject`` are
    :class:`~weightsync.impl.transfer.sender.RoundSender`'s.

    Args:
        init_info: the consumers' ``init_info`` (a dict or an :class:`InitInfo`).
        device: where the shared buffers live (``cpu`` or a CUDA device).
        default_layout: the layout when ``init_info`` names none (the consumers' backend's default).

    Attributes:
        wire: the wire arguments every round uses unless :meth:`send` is given others.

    Raises:
        ValueError / PortInUseError / TransferTimeoutError: as for the broadcast group.
    """

    def __init__(
        self,
        init_info: Mapping[str, Any] | InitInfo,
        device: torch.device | str = "cpu",
        default_layout: str = "aligned",
    ) -> None:
        super().__init__(init_info, default_layout)
        info = self.info
        self.device = torch.device(device)
        rv = rendezvous(info, 0)
        self.store = rv.store
        self.session = rv.session
        #: the session key of the authenticated rendezvous (``verify="hmac"``), None without a secret
        self.key = rv.session.key if rv.session is not None else None
        self.cp = ControlPlane(
            rv.scoped, 0, info.world_size, info.rendezvous_timeout_s, info.rendezvous_timeout_basis
        )
        self.cp.join()
        self.seq = 0
        self.ok_seq = 0
        self.slots: list[Segment] = []
        self.closed = False

    @property
    def pool_bytes(self) -> int:
        """Bytes held in shared buffers."""
        return sum(s.nbytes for s in self.slots)

    def _reserve(self, n: int, nbytes: int, buffer_size: int) -> None:
        for s in self.slots[n:]:
            s.close()
        del self.slots[n:]
        for i in range(n):
            if i >= len(self.slots):
                self.slots.append(Segment(nbytes, self.device))
            elif not nbytes <= self.slots[i].nbytes <= buffer_size:
                self.slots[i].close()
                self.slots[i] = Segment(nbytes, self.device)

    def _acks(self, seq: int, k: int) -> list[tuple[int, str]]:
        vals = self.cp.collect(f"r{seq}/a{k}", PHASE_ACK, range(1, self.info.world_size))
        return [
            (r, str(v.get("error")))
            for r, v in zip(range(1, self.info.world_size), vals, strict=True)
            if not v["ok"]
        ]

    def _ensure_open(self) -> None:
        if self.closed:
            raise RuntimeError("IPC trainer is closed")

    def _next_round(self) -> tuple[ControlPlane, int]:
        self.seq += 1
        return self.cp, self.seq

    def _send_buckets(self, seq: int, feed: TensorFeed, buckets: Sequence[Bucket], args: WireArgs) -> None:
        n = args.packed_num_buffers
        on_cpu = self.device.type == "cpu"
        at_hand = feed.at_hand
        to_pack = [
            b
            for b in buckets
            if not b.oversized
            and not (at_hand is not None and on_cpu and shared_chunk(contiguous_run(b, at_hand)))
        ]
        self._reserve(n, max_packed_bucket(to_pack), pool_cap(to_pack, args.packed_buffer_size_bytes))
        failures: list[tuple[int, str]] = []
        # the trainer's own failure: its stream disagreed with its metadata, or raised (rounds rule 4)
        own: BaseException | None = None
        waited = -1  # acks collected for every chunk <= waited
        posted = 0  # chunks announced so far
        for b in buckets:
            k = b.number
            msg: dict[str, Any] = {"nbytes": b.nbytes}
            temp: Segment | None = None
            try:
                tensors = feed.take(b.members)  # a stream is pulled one chunk at a time
            except BaseException as exc:
                if not isinstance(exc, ValueError) and exc is not feed.source_error:
                    raise
                own, failures = exc, [(0, feed.describe(exc) or "")]
                break
            shared = shared_chunk(contiguous_run(b, tensors)) if on_cpu and b.nbytes else None
            if shared is None:
                # refill slot k % n only once every consumer acked chunk k - n (rule 4)
                while not failures and waited < k - n:
                    waited += 1
                    failures = self._acks(seq, waited)
            if failures:
                break
            if shared is not None:
                seg, off = shared
                buf = seg.tensor[off:]
                msg["handles"] = seg.handles
                msg["slot"] = -2
                msg["segment"] = seg.id
                msg["offset"] = off
            elif b.oversized:
                temp = Segment(b.nbytes, self.device)
                buf = temp.tensor
                src = tensors[b.members[0]]
                buf[: b.nbytes].copy_(as_bytes(src.contiguous()))
                msg["handles"] = temp.handles
                msg["slot"] = -1
            else:
                slot = self.slots[k % n]
                buf = slot.tensor
                pack_bucket(buf, b, tensors)
                msg["handles"] = slot.handles
                msg["slot"] = k % n
                msg["segment"] = slot.id
            if self.device.type == "cuda":  # pragma: no cover - needs CUDA
                torch.cuda.current_stream(self.device).synchronize()
            msg["crc"] = bucket_digest(buf[: b.nbytes], args.verify, self.key)
            self.cp.post(f"r{seq}/c{k}", msg, seq)
            posted = k + 1
            if temp is not None:
                while not failures and waited < k:
                    waited += 1
                    failures = self._acks(seq, waited)
                temp.close()
        last = len(buckets) - 1
        while not failures and waited < last:
            waited += 1
            failures = self._acks(seq, waited)
        if not failures:
            # a stream that yields more than it declared fails the round everywhere
            own = feed.finish_error()
            if own is not None:
                failures = [(0, feed.describe(own) or "")]
        verdict = {"ok": not failures, "failed": [[r, e] for r, e in failures]}
        if failures:
            # tell consumers still waiting for a chunk, then everyone else through the verdict
            for k in range(posted, len(buckets)):
                self.cp.post(f"r{seq}/c{k}", {"abort": verdict}, seq)
        self.cp.post(f"r{seq}/done", verdict, seq)
        if failures:
            consumers_failed = len([r for r, _ in failures if r != 0])
            self.cp.settle(f"r{seq}/abort", expected=self.info.world_size - 1 - consumers_failed)
            if own is not None:
                raise own
            raise _round_failed(seq, failures)
        self.ok_seq = seq

    def close(self) -> None:
        """Free and unlink the shared buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.cp.wait_seen(self.ok_seq, self.cp.timeout_s)
        for s in self.slots:
            s.close()
        self.slots.clear()
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


# ----------------------------------------------------------------------------------------- consumer


class IPCWeightTransferEngine(WeightTransferEngine):
    """Consumer (engine worker) side of the IPC transport (backend name ``ipc``).

    Args:
        parallel: this worker's place in its engine (transfer rank formula).
        device: where this worker's model lives (``cpu`` or its CUDA device); selects which handle of the
            producer's map to import.
    """

    def __init__(
        self,
        parallel: ParallelInfo | None = None,
        device: torch.device | str | None = None,
        default_layout: str | None = None,
    ) -> None:
        super().__init__(parallel, default_layout)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cp: ControlPlane | None = None
        self.info: InitInfo | None = None
        self.seq = 0
        self._store: Any = None
        self.key: bytes | None = None
        self._mapped: dict[int, tuple[str, torch.Tensor]] = {}
        self._shared: dict[str, torch.Tensor] = {}
        self._shared_used: set[str] = set()

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join the producer's group (vLLM's IPC init is a no-op; weightsync needs the JSON channel).

        Raises:
            ValueError: rank outside ``1..world_size-1`` or a non-bijective mapping; the policy refused
                ``master_address``.
            AuthenticationError: the authenticated rendezvous refused this worker or the producer.
            WireMismatchError: the ranks disagree on ``world_size``.
            TransferTimeoutError: the producer or a peer never joined, naming it.
        """
        rank = self.parallel.transfer_rank(init_info.rank_offset, init_info.world_size)
        wire = init_info.wire(self.layout_default)
        # the current group is replaced only once the new one is formed (as the broadcast engine's)
        rv = rendezvous(init_info, rank)
        cp = ControlPlane(
            rv.scoped,
            rank,
            init_info.world_size,
            init_info.rendezvous_timeout_s,
            init_info.rendezvous_timeout_basis,
        )
        cp.join()
        self.shutdown()
        self._store = rv.store
        self.key = rv.session.key if rv.session is not None else None
        self.cp, self.rank, self.seq, self.info, self.wire = cp, rank, 0, init_info, wire

    def _cp(self) -> ControlPlane:
        if self.cp is None:
            raise RuntimeError("the IPC transfer engine is not initialised (init_weight_transfer_engine)")
        return self.cp

    def _info(self) -> InitInfo:
        assert self.info is not None  # set together with cp
        return self.info

    def reject_update(self, error: BaseException) -> None:
        """Veto this round in the wire agreement, then raise ``error``."""
        cp = self._cp()
        self.seq += 1
        veto_round(cp, self.seq, self._info(), error)

    def _buffer(self, msg: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
        slot = msg.get("slot")
        handles = msg.get("handles")
        if not isinstance(slot, int) or not isinstance(handles, Mapping):
            raise ValueError(f"malformed IPC chunk message (slot={slot!r})")
        if slot == -2:
            seg, off = str(msg.get("segment")), msg.get("offset")
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise ValueError(f"malformed IPC chunk message (offset={off!r})")
            if seg not in self._shared:
                self._shared[seg] = import_handles(handles, self.device)
            self._shared_used.add(seg)
            return self._shared[seg][off:], False
        if slot < 0:
            return import_handles(handles, self.device), True
        seg = str(msg.get("segment"))
        cached = self._mapped.get(slot)
        if cached is None or cached[0] != seg:
            self._mapped[slot] = (seg, import_handles(handles, self.device))
        return self._mapped[slot][1], False

    def receive_weights(
        self,
        update_info: UpdateInfo,
        load_weights: LoadFn,
        local_check: LocalCheck | None = None,
        destination: Destination | None = None,
    ) -> None:
        """Receive one update chunk by chunk from the shared buffers (rules 3-4). ``destination`` is
        unused: the one copy out of the producer's memory is the load itself.

        Raises:
            ValueError: ``local_check`` vetoed; a malformed handle; no handle for this device.
            WireMismatchError: a peer vetoed or disagrees on the wire description.
            ChecksumMismatchError: ``verify`` and a chunk's CRC or HMAC differs from the producer's.
            PeerFailedError / TransferTimeoutError: a peer failed or missed a deadline.
        """
        cp = self._cp()
        wire = self.round_wire(update_info)
        self.seq += 1
        seq = self.seq
        metas, buckets = open_receive_round(cp, seq, self._info(), update_info, wire, local_check)
        for b in buckets:
            msg = cp.get(f"r{seq}/c{b.number}", PHASE_CHUNK, 0)
            if "abort" in msg:
                self._raise_abort(seq, msg["abort"])
            try:
                self._consume(b, msg, metas, load_weights, wire.verify, seq)
            except Exception as exc:
                cp.post(f"r{seq}/a{b.number}", {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, seq)
                raise
            cp.post(f"r{seq}/a{b.number}", {"ok": True}, seq)
        # unmap the trainer's shared buffers this round no longer used (they may have been freed)
        for seg in [s for s in self._shared if s not in self._shared_used]:
            del self._shared[seg]
        self._shared_used.clear()
        verdict = cp.get(f"r{seq}/done", PHASE_ACK, 0)
        if not verdict.get("ok"):
            self._raise_abort(seq, verdict)
        cp.mark_seen(seq)

    def _raise_abort(self, seq: int, verdict: Mapping[str, Any]) -> None:
        failed = [(int(r), str(e)) for r, e in verdict.get("failed", [])]
        self._cp().settle(f"r{seq}/abort")
        raise _round_failed(seq, failed)

    def _consume(
        self,
        b: Bucket,
        msg: Mapping[str, Any],
        metas: Sequence[TensorMeta],
        load: LoadFn,
        verify: bool | str,
        seq: int,
    ) -> None:
        if msg.get("nbytes") != b.nbytes:
            raise ValueError(f"chunk {b.number} announces {msg.get('nbytes')!r} bytes, plan says {b.nbytes}")
        buf, temp = self._buffer(msg)
        try:
            if buf.numel() < b.nbytes:
                raise ValueError(
                    f"shared buffer of {buf.numel()} bytes cannot hold chunk {b.number} ({b.nbytes})"
                )
            view = buf[: b.nbytes]
            check_bucket(
                view, msg.get("crc"), verify, self.key, f"chunk {b.number} of round {seq} on rank {self.rank}"
            )
            pairs = unpack_bucket(view, b, metas)
            if self.device.type == "cuda":  # pragma: no cover - needs CUDA
                pairs = [(name, t.clone()) for name, t in pairs]
            load(pairs)
            if self.device.type == "cuda":  # pragma: no cover - needs CUDA
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            if temp:
                del buf

    def shutdown(self) -> None:
        """Drop mappings and the store connection (idempotent)."""
        self._mapped.clear()
        self._shared.clear()
        if self.cp is not None:
            self.cp.close()
        self.cp = None
        self._store = None


__all__ = [
    "IPCTrainer",
    "IPCWeightTransferEngine",
    "SharedBuffer",
    "decode_cuda_handle",
    "encode_cuda_handle",
    "gpu_uuid",
]
