"""Broadcast transport, registered as ``nccl``: packed (or per-tensor) broadcast from the trainer.

Rules:

1. **Own group.** The trainer (rank 0) hosts a TCPStore; every rank joins (``control.ControlPlane.join``)
   and then builds a process group directly on a ``PrefixStore`` of it: ``ProcessGroupNCCL`` for CUDA
   tensors, ``ProcessGroupGloo`` for CPU tensors, bound to the local address on the route to
   ``master_address`` (or ``GLOO_SOCKET_IFNAME``'s interfaces: :func:`gloo_device_choice`), so ranks on
   different hosts (or network namespaces) reach each other. ``torch.distributed``'s default group is
   never initialised or used (vLLM's stateless group, 0.32 ``nccl_common.py:139-159``).
2. **Ranks.** Engine workers use ``rank_offset + dp_index * (tp*pp) + local_rank`` (vLLM PR #36940).
3. **One update.** Wire agreement (``rounds`` rule 1), then per bucket: the bucket's header, broadcast
   on the group itself (:mod:`~weightsync.impl.transfer.bucket_header`: round, number, abort flag, digest
   under ``verify``), then its payload, unpacked into views and loaded; then one end status exchange
   (``rounds`` rule 3). The header replaces a status exchange over the TCPStore per bucket (``rounds``
   rule 2: a ``set``, a ``wait`` and a ``multi_get`` on every rank, with every worker gating the trainer's
   next bucket); a worker posts a payload's receive only after its header said the bucket is not aborted,
   so no collective is ever one-sided. A worker whose load fails keeps receiving (and no longer loads)
   and reports its error in the end status, where every rank raises (the failing rank its own error, the
   others PeerFailedError naming it). Bucket boundaries come from ``packing.plan_buckets`` on both sides.
4. **Pipelining.** With ``packed_num_buffers = n`` slots the trainer packs bucket ``k+1`` (CPU: in a
   background thread) while bucket ``k`` is on the wire, without waiting for the workers, and a worker
   posts bucket ``k``'s receive and the next header before it loads bucket ``k-1``, so bucket ``k``
   arrives while bucket ``k-1`` is loaded; slot ``k mod n`` is reused only after bucket ``k-n`` was
   loaded (and, in vLLM, what its layerwise reload kept of it copied out: ``weightsync.vllm.reload``).
5. **Receive in place.** When the worker names each weight's destination (kernel format: the parameter
   itself) and a bucket's destinations lie in one storage exactly at the bucket's offsets (an engine
   keeping its parameters in one arena in the trainer's order; the same test as the trainer's zero-copy
   runs, packing rule 7), or a one-tensor bucket's destination is contiguous with the same dtype and
   shape, the broadcast lands straight in the parameters and the load's copy is a no-op: no staging
   buffer, no second pass over the bytes. Not with ``verify`` on (the checksum must pass before the
   bytes become weights). A failure mid-round then leaves the same partially updated model as a staged
   load does (earlier buckets were loaded); the engine stays paused until a round completes.
6. **Deadlines.** Every broadcast is waited for with ``Work.wait(timeout)`` and every store exchange with
   the store's timeout; a miss is a :class:`~weightsync.spec.errors.TransferTimeoutError` that says how
   the deadline was sized and names the missing ranks: a store exchange the ranks whose value never came,
   or rank 0 when its store stopped answering (``control`` rule 5: a cut link); a broadcast the
   broadcast's other ranks (:attr:`BroadcastGroup.peers`: exact with one worker, gloo and NCCL do not
   say which of several peers stalled). The deadline is the round's (``rounds`` rule 0):
   ``init_info['timeout_s']``, or without it a floor plus the round's bytes at a conservative bandwidth.
7. **Trainer failure.** A weight iterator that raises is reported to every engine through the wire
   agreement (``rounds`` rule 1), or, for a stream of declared metadata (:meth:`BroadcastTrainer.send_stream`),
   at the bucket being pulled (``rounds`` rule 4): the trainer writes its exception's message to the store
   (``r<seq>/abort``) and broadcasts an abort header in place of that bucket, so every engine fails at
   once naming the trainer's exception; the trainer re-raises it. The group stays usable for the next round.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
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
from weightsync.impl.transfer.broadcast_group import (
    BroadcastGroup,
    drain,
    gloo_device_choice,
    gloo_devices,
    join_group,
    local_address_towards,
)
from weightsync.impl.transfer.bucket_header import (
    PHASE_BROADCAST,
    PHASE_BUCKET,
    abort_round,
    decode_header,
    empty_header,
    encode_header,
    lookahead,
    raise_aborted,
)
from weightsync.impl.transfer.control import ControlPlane
from weightsync.impl.transfer.packing import (
    Bucket,
    Tensors,
    as_bytes,
    bucket_digest,
    check_bucket,
    contiguous_run,
    max_packed_bucket,
    pack_bucket,
    pool_cap,
    unpack_bucket,
)
from weightsync.impl.transfer.rounds import TensorFeed, open_receive_round, status, veto_round
from weightsync.impl.transfer.sender import RoundSender

# ----------------------------------------------------------------------------------------- trainer side


def _broadcast_buckets(
    group: BroadcastGroup, seq: int, feed: TensorFeed, buckets: Sequence[Bucket], args: WireArgs
) -> None:
    """Rules 3, 4 and 7, trainer side: pack (or point at) and broadcast round ``seq``'s ``buckets``,
    ``packed_num_buffers`` in flight, then the end status."""
    n = args.packed_num_buffers
    on_cpu = group.device.type == "cpu"
    if on_cpu and group.packer is None:
        group.packer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-pack")

    def direct(b: Bucket, tensors: Tensors) -> torch.Tensor | None:
        # the bucket's bytes already lie in one storage at the packed offsets (packing rule 7), or the
        # bucket is one whole tensor: send that memory without packing
        if b.nbytes == 0:
            return None
        if b.oversized or not args.packed or len(b.members) == 1:
            t = tensors[b.members[0]]
            if t.device == group.device and t.is_contiguous():
                return as_bytes(t)
            return None
        run = contiguous_run(b, tensors)
        return run if run is not None and run.device == group.device else None

    key = group.session.key if group.session is not None else None

    def payload(b: Bucket) -> tuple[torch.Tensor | None, int | str | None]:
        tensors = feed.take(b.members)  # a stream is pulled here, one bucket at a time (rounds rule 4)
        if b.nbytes == 0:
            return None, bucket_digest(None, args.verify, key)
        buf = direct(b, tensors)
        if buf is None:
            if b.oversized or not args.packed or len(b.members) == 1:
                buf = as_bytes(tensors[b.members[0]].to(group.device).contiguous())
            else:
                buf = pack_bucket(group.pool.slot(b.number % n), b, tensors)
        return buf, bucket_digest(buf, args.verify, key)

    at_hand = feed.at_hand
    if args.packed:
        # only multi-tensor buckets that must be packed need a buffer (a flat trainer needs none); a
        # stream's contiguity is unknown before it is pulled, so each of its multi-tensor buckets counts
        to_pack = [
            b
            for b in buckets
            if not b.oversized and len(b.members) > 1 and (at_hand is None or direct(b, at_hand) is None)
        ]
        group.pool.reserve(n, max_packed_bucket(to_pack), pool_cap(to_pack, args.packed_buffer_size_bytes))

    def submit(b: Bucket) -> concurrent.futures.Future[tuple[torch.Tensor | None, int | str | None]]:
        fut: concurrent.futures.Future[tuple[torch.Tensor | None, int | str | None]]
        if group.packer is not None and b.nbytes > 0 and (at_hand is None or direct(b, at_hand) is None):
            return group.packer.submit(payload, b)
        fut = concurrent.futures.Future()
        try:
            fut.set_result(payload(b))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    # bucket number -> (works, the buffers they read: kept referenced until the broadcasts completed)
    inflight: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
    fut = submit(buckets[0]) if buckets else None
    try:
        for k in range(len(buckets)):
            assert fut is not None
            try:
                buf, crc = fut.result()
            except BaseException as exc:
                # the weight stream's own exception, whatever its class, aborts the round at this bucket
                if not isinstance(exc, Exception) and exc is not feed.source_error:
                    raise
                abort_round(group, seq, buckets, lookahead(n), k, exc, feed.describe(exc), inflight)
            head = encode_header(seq, k, crc, False, group.device)
            works = [group.broadcast(head)]
            if buf is not None:
                works.append(group.broadcast(buf))
            inflight[k] = (works, [head] if buf is None else [head, buf])
            if k + 1 < len(buckets):
                reuse = k + 1 - n
                if reuse in inflight and args.packed:
                    for w in inflight.pop(reuse)[0]:
                        group.wait(w, PHASE_BROADCAST)
                fut = submit(buckets[k + 1])
        for k in sorted(inflight):
            for w in inflight.pop(k)[0]:
                group.wait(w, PHASE_BROADCAST)
    except BaseException:
        drain(group, [w for ws, _ in inflight.values() for w in ws])
        raise
    # a stream that yields more than it declared (or raises) fails the round everywhere; the engines'
    # load failures are heard here too (rounds rule 3)
    end_error = feed.finish_error()
    status(group.cp, seq, "end", end_error, PHASE_BUCKET, None, feed.describe(end_error))
    group.ok_seq = seq


class BroadcastTrainer(RoundSender):
    """The trainer's endpoint of a broadcast group: rank 0, hosting the store (the transport under
    :class:`~weightsync.impl.transfer.trainer.BroadcastTrainerEngine`, which drives the engines' RPCs).
    ``send``, ``send_stream`` and ``reject`` are :class:`~weightsync.impl.transfer.sender.RoundSender`'s.

    Args:
        init_info: the engines' ``init_info`` (a dict or an :class:`InitInfo`); the trainer is rank 0.
        default_layout: the layout when ``init_info`` names none (the engines' backend's default).

    Attributes:
        wire: the wire arguments every round uses unless :meth:`send` is given others.

    Raises:
        ValueError / PortInUseError / TransferTimeoutError: as :func:`join_group`.
    """

    def __init__(self, init_info: Mapping[str, Any] | InitInfo, default_layout: str = "aligned") -> None:
        super().__init__(init_info, default_layout)
        self.group = join_group(self.info, 0)
        self.session = self.group.session

    def _ensure_open(self) -> None:
        if self.group.closed:
            raise RuntimeError("trainer group is closed")

    def _next_round(self) -> tuple[ControlPlane, int]:
        self.group.seq += 1
        return self.group.cp, self.group.seq

    def _send_buckets(self, seq: int, feed: TensorFeed, buckets: Sequence[Bucket], args: WireArgs) -> None:
        _broadcast_buckets(self.group, seq, feed, buckets, args)

    @property
    def pool_bytes(self) -> int:
        """Bytes held by the trainer's packing buffers."""
        return self.group.pool.nbytes

    def close(self) -> None:
        """Release the group and the store (idempotent)."""
        self.group.close()


# ------------------------------------------------------------------------------------------ engine side


def _place(
    b: Bucket, metas: Sequence[TensorMeta], destination: Destination | None, device: torch.device
) -> torch.Tensor | None:
    """Rule 5: bucket ``b``'s bytes as a uint8 view of its members' destinations, or None."""
    if destination is None or b.nbytes == 0:
        return None
    dests: list[torch.Tensor] = []
    for i in b.members:
        m = metas[i]
        d = destination(m)
        if d is None or d.dtype != m.dtype or tuple(d.shape) != tuple(m.shape) or d.device != device:
            return None
        dests.append(d)
    return contiguous_run(b._replace(members=tuple(range(len(dests)))), dests)


class _Pending:
    __slots__ = ("bucket", "buf", "head", "head_work", "tensors", "works")

    def __init__(
        self, bucket: Bucket, buf: torch.Tensor | None, tensors: list[torch.Tensor], works: list[Any]
    ):
        self.bucket = bucket
        self.buf = buf
        self.tensors = tensors
        self.works = works
        self.head: torch.Tensor | None = None
        self.head_work: Any = None


class BroadcastWeightTransferEngine(WeightTransferEngine):
    """Engine-worker side of the broadcast transport (backend name ``nccl``; gloo on CPU).

    Args:
        parallel: this worker's place in its engine (transfer-rank formula, rule 2).
    """

    def __init__(self, parallel: ParallelInfo | None = None, default_layout: str | None = None) -> None:
        super().__init__(parallel, default_layout)
        self.group: BroadcastGroup | None = None

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join the group as ``rank_offset + dp_index*tp*pp + local_rank``; a repeat replaces the group once
        the new one is formed.

        Raises:
            ValueError: the rank is outside ``1..world_size-1``, or the mapping is not a bijection
                (scenario B1). WireMismatchError: the ranks disagree on ``world_size``.
            TransferTimeoutError: the trainer or a peer never joined, naming it.
        """
        rank = self.parallel.transfer_rank(init_info.rank_offset, init_info.world_size)
        wire = init_info.wire(self.layout_default)
        # the current group is replaced only once the new one is formed: a refused init (a trainer
        # without the deployment's secret) or a failed one leaves it working
        group = join_group(init_info, rank)
        if self.group is not None:
            self.group.close()
        self.group, self.rank, self.wire = group, rank, wire

    def _group(self) -> BroadcastGroup:
        if self.group is None or self.group.closed:
            raise RuntimeError(
                "the broadcast transfer engine is not initialised (init_weight_transfer_engine)"
            )
        return self.group

    def reject_update(self, error: BaseException) -> None:
        """Veto this round in the wire agreement, then raise ``error`` (see base class)."""
        g = self._group()
        g.seq += 1
        veto_round(g.cp, g.seq, g.info, error)

    def receive_weights(
        self,
        update_info: UpdateInfo,
        load_weights: LoadFn,
        local_check: LocalCheck | None = None,
        destination: Destination | None = None,
    ) -> None:
        """Receive one update and load it bucket by bucket (rules 3-6); into ``destination`` where it
        can (rule 5).

        Raises:
            ValueError: ``local_check`` vetoed (raised after the agreement, before any payload).
            WireMismatchError: a peer vetoed or disagrees on the wire description.
            ChecksumMismatchError: ``verify`` and a bucket's CRC or HMAC differs from the trainer's.
            PeerFailedError / TransferTimeoutError: a peer failed or missed a deadline.
        """
        g = self._group()
        info = self.round_wire(update_info)
        g.seq += 1
        seq = g.seq
        tm = self.timings
        t_start = time.perf_counter()
        metas, buckets = open_receive_round(g.cp, seq, g.info, update_info, info, local_check)
        tm.agree_s += time.perf_counter() - t_start
        n = info.packed_num_buffers
        ahead = lookahead(n)
        in_place = destination is not None and not info.verify
        placed = [_place(b, metas, destination, g.device) if in_place else None for b in buckets]
        if info.packed:
            # only buckets received through a staging buffer need one (rule 5)
            staged = [b for b, d in zip(buckets, placed, strict=True) if d is None and not b.oversized]
            g.pool.reserve(n, max_packed_bucket(staged), pool_cap(staged, info.packed_buffer_size_bytes))
        pending: collections.deque[_Pending] = collections.deque()
        error: BaseException | None = None
        key = g.session.key if g.session is not None else None

        def finish(p: _Pending) -> None:
            nonlocal error
            t0 = time.perf_counter()
            # the header first (rule 3): an aborted bucket is never loaded
            g.wait(p.head_work, PHASE_BUCKET)
            assert p.head is not None
            h = decode_header(
                p.head, seq, p.bucket.number, f"bucket {p.bucket.number} of round {seq} on rank {g.rank}"
            )
            t1 = time.perf_counter()
            tm.control_s += t1 - t0
            if h.abort:
                raise_aborted(
                    g, seq, p.bucket.number, [w for q in pending for w in [q.head_work, *q.works]] + p.works
                )
            for w in p.works:
                g.wait(w, PHASE_BROADCAST)
            t2 = time.perf_counter()
            tm.transfer_wait_s += t2 - t1
            tm.buckets += 1
            if error is not None:
                return
            try:
                where = f"bucket {p.bucket.number} of round {seq} on rank {g.rank}"
                check_bucket(p.buf, h.digest, info.verify, key, where)
                if p.bucket.oversized or not info.packed:
                    m = metas[p.bucket.members[0]]
                    batch = [(m.name, p.tensors[0])]
                elif p.buf is not None or p.bucket.nbytes == 0:
                    src = p.buf if p.buf is not None else torch.empty(0, dtype=torch.uint8, device=g.device)
                    batch = unpack_bucket(src, p.bucket, metas)
                else:
                    return
                t3 = time.perf_counter()
                tm.unpack_s += t3 - t2
                load_weights(batch)
                tm.load_s += time.perf_counter() - t3
            except Exception as exc:
                error = exc

        try:
            for k, b in enumerate(buckets):
                while pending and pending[0].bucket.number <= k - n:
                    finish(pending.popleft())
                direct = placed[k]
                if b.oversized or not info.packed:
                    m = metas[b.members[0]]
                    if direct is not None:
                        t = direct.view(m.dtype).view(m.shape)
                    else:
                        t = torch.empty(m.shape, dtype=m.dtype, device=g.device)
                    buf = as_bytes(t) if b.nbytes else None
                    p = _Pending(b, buf, [t], [])
                elif direct is not None:
                    p = _Pending(b, direct, [], [])
                else:
                    buf = g.pool.slot(k % n)[: b.nbytes] if b.nbytes else None
                    p = _Pending(b, buf, [], [])
                # header and payload posted together, the payload checked against the header before it is
                # loaded (rule 3); bucket k arrives while bucket k-1 is checked and loaded (rule 4)
                p.head = empty_header(g.device)
                p.head_work = g.broadcast(p.head)
                if p.buf is not None:
                    p.works.append(g.broadcast(p.buf))
                pending.append(p)
                while len(pending) > ahead:
                    finish(pending.popleft())
            while pending:
                finish(pending.popleft())
        except BaseException:
            drain(g, [w for p in pending for w in [p.head_work, *p.works] if w is not None])
            raise
        t0 = time.perf_counter()
        status(g.cp, seq, "end", error, PHASE_BUCKET)
        tm.control_s += time.perf_counter() - t0
        tm.total_s += time.perf_counter() - t_start
        g.cp.mark_seen(seq)

    def shutdown(self) -> None:
        """Drop the group (idempotent)."""
        if self.group is not None:
            self.group.close()
            self.group = None


__all__ = [
    "BroadcastGroup",
    "BroadcastTrainer",
    "BroadcastWeightTransferEngine",
    "gloo_device_choice",
    "gloo_devices",
    "join_group",
    "local_address_towards",
]
