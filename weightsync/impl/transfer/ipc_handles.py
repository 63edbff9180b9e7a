"""IPC handles and shared memory for the ``ipc`` transport (:mod:`weightsync.impl.transfer.ipc`): CUDA IPC
handles of GPU tensors, and on CPU shared-memory segments under ``/dev/shm`` that the engines map by name."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.impl.transfer.tensors import DTYPES, dtype_name

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^/dev/shm/weightsync-[A-Za-z0-9_.-]+$")


def b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def unb64(s: object, what: str) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise ValueError(f"IPC handle field {what} must be base64 text, got {type(s).__name__}")
    return base64.b64decode(s, validate=True)


def gpu_uuid(device: int | None = None) -> str:  # pragma: no cover - needs CUDA
    """The UUID of a CUDA device (the key of vLLM's ``ipc_handles`` maps)."""
    idx = torch.cuda.current_device() if device is None else device
    return str(torch.cuda.get_device_properties(idx).uuid)


def encode_cuda_handle(t: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - needs CUDA
    """JSON-able form of ``reduce_tensor(t)`` for a CUDA tensor (no pickling)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)  # type: ignore[no-untyped-call]
    (
        _,
        size,
        stride,
        offset,
        _,
        dtype,
        device,
        handle,
        ssize,
        soff,
        _,
        rc_handle,
        rc_off,
        ev_handle,
        ev_sync,
    ) = args
    return {
        "kind": "cuda",
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": b64(handle),
        "storage_size": int(ssize),
        "storage_offset": int(soff),
        "ref_counter_handle": b64(rc_handle),
        "ref_counter_offset": int(rc_off),
        "event_handle": b64(ev_handle),
        "event_sync_required": bool(ev_sync),
    }


def decode_cuda_handle(d: Mapping[str, Any], device: int) -> torch.Tensor:  # pragma: no cover - needs CUDA
    """Rebuild a CUDA tensor from :func:`encode_cuda_handle` output on local device ``device``.

    Raises:
        ValueError: a field is missing or malformed.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        dtype = DTYPES[str(d["dtype"])]
        t: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            torch.Size([int(x) for x in d["size"]]),
            tuple(int(x) for x in d["stride"]),
            int(d["offset"]),
            torch.storage.TypedStorage,
            dtype,
            device,
            unb64(d["handle"], "handle"),
            int(d["storage_size"]),
            int(d["storage_offset"]),
            False,
            unb64(d["ref_counter_handle"], "ref_counter_handle"),
            int(d["ref_counter_offset"]),
            unb64(d["event_handle"], "event_handle"),
            bool(d["event_sync_required"]),
        )
        return t
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed CUDA IPC handle: {exc}") from None


class Segment:
    """One exported buffer on the producer side: a uint8 tensor and its JSON handle map."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.id = secrets.token_hex(8)
        self.path: str | None = None
        if device.type == "cpu":
            self.path = f"{SHM_DIR}/weightsync-{os.getpid()}-{self.id}"
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, max(nbytes, 1))
            finally:
                os.close(fd)
            self._finalizer = weakref.finalize(self, unlink_segment, self.path)
            self.tensor = torch.from_file(self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
            self.handles: dict[str, Any] = {"cpu": {"kind": "shm", "path": self.path, "size": max(nbytes, 1)}}
        else:  # pragma: no cover - needs CUDA
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self.handles = {gpu_uuid(device.index): encode_cuda_handle(self.tensor)}

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.path is not None:
            self._finalizer()


#: Live :class:`SharedBuffer` segments by the data pointer of their storage (weak: a dead buffer is
#: simply no longer recognised, and its tensors are then packed).
_SHARED: weakref.WeakValueDictionary[int, Segment] = weakref.WeakValueDictionary()


class SharedBuffer:
    """A flat uint8 CPU tensor in a ``/dev/shm/weightsync-*`` file that the IPC producer can hand to
    consumers by handle instead of packing (rule 5). Keep it alive while its tensors are sent; the file
    is unlinked when it is closed or collected (views of :attr:`tensor` stay valid in this process).

    Args:
        nbytes: size in bytes (>= 0).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"SharedBuffer size {nbytes} must be >= 0")
        self._seg = Segment(nbytes, torch.device("cpu"))
        self.tensor: torch.Tensor = self._seg.tensor[:nbytes]
        _SHARED[self._seg.tensor.untyped_storage().data_ptr()] = self._seg

    @property
    def path(self) -> str:
        """The shared-memory file."""
        assert self._seg.path is not None
        return self._seg.path

    def close(self) -> None:
        """Unlink the file and stop recognising the buffer (idempotent)."""
        _SHARED.pop(self._seg.tensor.untyped_storage().data_ptr(), None)
        self._seg.close()
        self.tensor = torch.empty(0, dtype=torch.uint8)


def shared_chunk(run: torch.Tensor | None) -> tuple[Segment, int] | None:
    """The SharedBuffer segment holding ``run`` and its byte offset there, if any."""
    if run is None or run.device.type != "cpu":
        return None
    seg = _SHARED.get(run.untyped_storage().data_ptr())
    if seg is None or seg.path is None:
        return None
    off = run.data_ptr() - seg.tensor.data_ptr()
    if off < 0 or off + run.numel() > seg.tensor.numel():  # pragma: no cover - defensive
        return None
    return seg, off


def unlink_segment(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def local_key(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else gpu_uuid(device.index)  # pragma: no cover - cuda branch


def import_handles(handles: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """Map a producer's buffer into this process (rule 1). Validates everything it reads.

    Raises:
        ValueError: no handle for this process's device (vLLM: no handle for the local GPU UUID), or a
            malformed handle (e.g. a shared-memory path outside ``/dev/shm/weightsync-*``).
    """
    key = local_key(device)
    if not isinstance(handles, Mapping) or key not in handles:
        known = ", ".join(sorted(handles)) if isinstance(handles, Mapping) else type(handles).__name__
        raise ValueError(f"no IPC handle for local device {key!r}; handles are for: {known} (vLLM ipc rule)")
    h = handles[key]
    if not isinstance(h, Mapping):
        raise ValueError(f"IPC handle for {key!r} must be an object, got {type(h).__name__}")
    if h.get("kind") == "shm":
        path, size = h.get("path"), h.get("size")
        if not isinstance(path, str) or not _SHM_NAME.match(path) or ".." in path:
            raise ValueError(f"shared-memory handle path {path!r} is not a {SHM_DIR}/weightsync-* file")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"shared-memory handle size {size!r} must be a positive int")
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    if h.get("kind") == "cuda":  # pragma: no cover - needs CUDA
        return decode_cuda_handle(
            h, device.index if device.index is not None else torch.cuda.current_device()
        )
    raise ValueError(f"unknown IPC handle kind {h.get('kind')!r}")


__all__ = [
    "SHM_DIR",
    "Segment",
    "SharedBuffer",
    "decode_cuda_handle",
    "encode_cuda_handle",
    "gpu_uuid",
    "import_handles",
    "shared_chunk",
]
