"""Mapping and IPC: CUDA IPC handles exported here, a peer's regions opened here, the export.

Export
------
A region inside memory from torch's caching allocator is a slice of a larger ``cudaMalloc``
segment, and an IPC handle names a whole allocation. :func:`export_region` therefore finds
the allocation's base (``cuMemGetAddressRange``), takes the handle of that base
(``cudaIpcGetMemHandle``) and returns it with the region's offset inside the allocation::

    IpcExport(handle=<64 bytes>, offset=ptr - base, alloc_size=<bytes of the allocation>)

The transport's export (:func:`parse_descriptor` reads it) is :func:`transport.base.pack_descriptor`
of the backend ``nvlink`` with, besides the region table: ``name``, ``host``
(:func:`transport.nvlink.mailbox.host_id`), ``pid``, ``mailbox`` (the notification socket's
name), ``ipc`` (``[region id, 64-byte CUDA IPC handle, offset in the allocation, allocation
bytes]`` per region) and, optionally, ``gpu_uuid``: the UUID of the GPU holding the regions, by
which the peer finds that GPU among its own ordinals (the staged engine launches kernels there;
without it, or when the peer does not see that GPU, it stays off).

Import
------
:func:`open_handle` maps the allocation while the LOCAL GPU (the one that will run the copy
kernel) is current, with ``cudaIpcMemLazyEnablePeerAccess``. torch's own IPC rebuild opens
handles on the owning GPU, and a kernel on another GPU then faults; opening under the local
GPU is what makes the mapping usable by that GPU's kernels. A handle can be opened once per
process and device, so opened mappings are reference-counted here: :func:`close_handle`
unmaps on the last release.

:class:`PeerMapping` holds one peer's regions, opened once per GPU that launches on them: the
local GPU (the direct kernel) and, for the staged engine, the peer's GPU (its scatter kernel
runs there, launched by this process). Each opening gives a pointer table ``[num peer region
ids]`` int64 (region base as mapped under that GPU; 0 for ids the peer did not export), which
the row and strided tables index by region id. A revoked region (:mod:`transport.nvlink.revoke`)
is unmapped by :meth:`PeerMapping.drop` and skipped by later openings; its table entries become
0. The mailbox thread drops while the writer's thread may open the mapping under another GPU:
both take the mapping's lock.

API
---
The CUDA calls come from cuda-python (``cuda.bindings.runtime`` / ``driver``, imported lazily),
or, when it is missing, from ``libcudart`` (and ``libcuda`` for the address range) through
ctypes. When neither can be loaded, :class:`CudaIpcUnavailable` says so. Memory from
``cuMemCreate`` (torch's ``expandable_segments``) has no legacy IPC handle: export fails with
:class:`CudaIpcError` naming the call. :class:`NvlinkUnsupported` is what the backend raises
for memory or a peer it cannot serve (host memory, another host, this process, an allocation
that cannot be opened here): the caller falls back to NIXL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np

from transport.base import PeerDescriptorError, Region, TransportError, unpack_descriptor

__all__ = [
    "BACKEND", "CudaIpcError", "CudaIpcUnavailable", "IPC_HANDLE_BYTES", "IpcExport", "NvlinkUnsupported",
    "PeerMapping", "close_handle", "export_region", "gpu_uuid", "load_api", "local_ordinal", "on_device",
    "open_handle", "parse_descriptor",
]


IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
API_CHOICES = ("auto", "cuda-python", "ctypes")


class CudaIpcUnavailable(TransportError):
    """Neither cuda-python nor a loadable libcudart is present."""


class CudaIpcError(TransportError):
    """A CUDA call failed; the message names the call and CUDA's error."""


class NvlinkUnsupported(TransportError):
    """This backend cannot serve the memory or peer asked for; use the NIXL backend."""


@dataclass(frozen=True)
class IpcExport:
    """The exporter's view of one region: handle of its allocation and its offset inside."""

    handle: bytes  # IPC_HANDLE_BYTES opaque bytes
    offset: int  # region ptr - allocation base
    alloc_size: int  # bytes of the whole allocation


class _CudaApi:
    """The CUDA calls the nvlink backend needs, behind one interface."""

    name = "abstract"

    def get_device(self) -> int: ...

    def set_device(self, device: int) -> None: ...

    def address_range(self, ptr: int) -> tuple[int, int]: ...

    def ipc_get(self, base: int) -> bytes: ...

    def ipc_open(self, handle: bytes) -> int: ...

    def ipc_close(self, ptr: int) -> None: ...

    def enable_peer_access(self, peer: int) -> None:
        """Let the current device reach ``peer``'s memory (no-op when already enabled)."""

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cudaMemcpyAsync`` (kind Default: UVA decides) on the raw ``stream`` handle."""

    def event_create(self):
        """A new event of the current device, without timing (``cudaEventDisableTiming``); an
        opaque handle for the three calls below."""

    def event_destroy(self, event) -> None: ...

    def raw(self, event) -> int:
        """An event's handle as an int (``cudaEvent_t`` is ``CUevent``), for C."""
        return int(event)

    def event_record(self, event, stream: int) -> None:
        """``cudaEventRecord`` on a raw stream of the event's device."""

    def stream_wait_event(self, stream: int, event) -> None:
        """``cudaStreamWaitEvent``: work queued on ``stream`` from now on waits for ``event``
        (any device)."""


_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming


def _code(err) -> int:
    return int(getattr(err, "value", err))


class _CudaPythonApi(_CudaApi):
    name = "cuda-python"

    def __init__(self):
        try:
            from cuda.bindings import driver, runtime
        except ImportError:
            from cuda import cuda as driver, cudart as runtime  # cuda-python < 12.6
        self.rt, self.drv = runtime, driver
        self._success = runtime.cudaError_t.cudaSuccess  # compared by identity first on the hot calls
        self._kind_default = runtime.cudaMemcpyKind(_MEMCPY_DEFAULT)

    def _ok(self, result, what: str):
        err = result[0]
        if _code(err) != 0:
            raise CudaIpcError(f"{what} failed: {err!r}")
        return result[1:]

    def get_device(self) -> int:
        err, device = self.rt.cudaGetDevice()
        if err is not self._success and _code(err) != 0:
            raise CudaIpcError(f"cudaGetDevice failed: {err!r}")
        return int(device)

    def set_device(self, device: int) -> None:
        self._ok(self.rt.cudaSetDevice(device), f"cudaSetDevice({device})")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = self._ok(self.drv.cuMemGetAddressRange(self.drv.CUdeviceptr(ptr)), "cuMemGetAddressRange")
        return int(base), int(size)

    def ipc_get(self, base: int) -> bytes:
        (handle,) = self._ok(self.rt.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle(0x{base:x})")
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        h = self.rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
        (ptr,) = self._ok(self.rt.cudaIpcOpenMemHandle(h, _LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
        return int(ptr)

    def ipc_close(self, ptr: int) -> None:
        self._ok(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def enable_peer_access(self, peer: int) -> None:
        (err,) = self.rt.cudaDeviceEnablePeerAccess(peer, 0)
        if _code(err) == _PEER_ACCESS_ALREADY_ENABLED:
            self.rt.cudaGetLastError()  # clear the sticky-free error the call left
        elif _code(err) != 0:
            raise CudaIpcError(f"cudaDeviceEnablePeerAccess({peer}) failed: {err!r}")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self.rt.cudaMemcpyAsync(dst, src, nbytes, self._kind_default, stream)[0]
        if err is not self._success and _code(err) != 0:  # the message only on failure (hot path)
            raise CudaIpcError(f"cudaMemcpyAsync(0x{dst:x}, 0x{src:x}, {nbytes}) failed: {err!r}")

    def event_create(self):
        return self._ok(self.rt.cudaEventCreateWithFlags(_EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")[0]

    def event_destroy(self, event) -> None:
        self._ok(self.rt.cudaEventDestroy(event), "cudaEventDestroy")

    def event_record(self, event, stream: int) -> None:
        err = self.rt.cudaEventRecord(event, stream)[0]
        if err is not self._success and _code(err) != 0:
            raise CudaIpcError(f"cudaEventRecord failed: {err!r}")

    def stream_wait_event(self, stream: int, event) -> None:
        err = self.rt.cudaStreamWaitEvent(stream, event, 0)[0]
        if err is not self._success and _code(err) != 0:
            raise CudaIpcError(f"cudaStreamWaitEvent failed: {err!r}")


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


def _loaded_library(stem: str) -> Optional[str]:
    """Path of a shared library already mapped into this process (torch loads libcudart)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(" ")[-1]
                if f"/{stem}.so" in path:
                    return path
    except OSError:
        pass
    return None


def _load_cdll(stem: str, names: tuple) -> Optional[ctypes.CDLL]:
    for name in (_loaded_library(stem), ctypes.util.find_library(stem[3:]), *names):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class _CtypesApi(_CudaApi):
    name = "ctypes"

    def __init__(self):
        rt = _load_cdll("libcudart", ("libcudart.so", "libcudart.so.13", "libcudart.so.12"))
        drv = _load_cdll("libcuda", ("libcuda.so.1", "libcuda.so"))
        if rt is None or drv is None:
            missing = " and ".join(n for n, lib in (("libcudart", rt), ("libcuda", drv)) if lib is None)
            raise CudaIpcUnavailable(f"cannot load {missing} through ctypes")
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        rt.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        drv.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self.rt, self.drv = rt, drv

    def _ok(self, code: int, what: str) -> None:
        if code != 0:
            msg = self.rt.cudaGetErrorString(code)
            raise CudaIpcError(f"{what} failed: error {code} ({msg.decode() if msg else '?'})")

    def get_device(self) -> int:
        dev = ctypes.c_int()
        self._ok(self.rt.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        return dev.value

    def set_device(self, device: int) -> None:
        self._ok(self.rt.cudaSetDevice(ctypes.c_int(device)), f"cudaSetDevice({device})")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if code != 0:
            raise CudaIpcError(f"cuMemGetAddressRange(0x{ptr:x}) failed: CUresult {code}")
        return base.value, size.value

    def ipc_get(self, base: int) -> bytes:
        h = _Handle()
        self._ok(self.rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base)), f"cudaIpcGetMemHandle(0x{base:x})")
        return bytes(h)

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        h = _Handle.from_buffer_copy(handle)
        self._ok(self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self._ok(self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")

    def enable_peer_access(self, peer: int) -> None:
        code = self.rt.cudaDeviceEnablePeerAccess(ctypes.c_int(peer), ctypes.c_uint(0))
        if code == _PEER_ACCESS_ALREADY_ENABLED:
            self.rt.cudaGetLastError()
        else:
            self._ok(code, f"cudaDeviceEnablePeerAccess({peer})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self.rt.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream)
        if code != 0:  # the message only on failure (hot path)
            self._ok(code, f"cudaMemcpyAsync(0x{dst:x}, 0x{src:x}, {nbytes})")

    def raw(self, event) -> int:
        return event.value or 0

    def event_create(self):
        event = ctypes.c_void_p()
        self._ok(self.rt.cudaEventCreateWithFlags(ctypes.byref(event), ctypes.c_uint(_EVENT_DISABLE_TIMING)),
                 "cudaEventCreateWithFlags")
        return event

    def event_destroy(self, event) -> None:
        self._ok(self.rt.cudaEventDestroy(event), "cudaEventDestroy")

    def event_record(self, event, stream: int) -> None:
        self._ok(self.rt.cudaEventRecord(event, stream), "cudaEventRecord")

    def stream_wait_event(self, stream: int, event) -> None:
        self._ok(self.rt.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


_APIS: dict[str, _CudaApi] = {}
_LOCK = threading.Lock()


def load_api(choice: str = "auto") -> _CudaApi:
    """cuda-python when importable (``auto``), else ctypes on libcudart; cached per choice."""
    if choice not in API_CHOICES:
        raise ValueError(f"ipc api must be one of {API_CHOICES}, got {choice!r}")
    with _LOCK:
        if choice in _APIS:
            return _APIS[choice]
        errors = []
        for name, cls in (("cuda-python", _CudaPythonApi), ("ctypes", _CtypesApi)):
            if choice not in ("auto", name):
                continue
            try:
                api = cls()
            except (ImportError, CudaIpcUnavailable, AttributeError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            _APIS[choice] = api
            return api
    raise CudaIpcUnavailable(
        "CUDA IPC needs cuda-python (pip install cuda-python) or a loadable libcudart; "
        + "; ".join(errors)
    )


class on_device:
    """Make ``device`` current for the block (torch and the CUDA runtime alike; with
    ``torch_too=False`` the runtime alone, which is cheaper), then restore the previous one."""

    def __init__(self, api: _CudaApi, device: int, torch_too: bool = True):
        self.api, self.device, self.torch_too = api, device, torch_too

    def __enter__(self):
        if self.torch_too:
            import torch

            self._torch = torch.cuda.device(self.device)
            self._torch.__enter__()
        self.prev = self.api.get_device()
        self.api.set_device(self.device)
        return self

    def __exit__(self, *exc):
        try:
            self.api.set_device(self.prev)
        finally:
            if self.torch_too:
                self._torch.__exit__(*exc)


def export_region(api: _CudaApi, ptr: int, length: int, device: int) -> IpcExport:
    """Handle of the allocation holding ``[ptr, ptr + length)`` on ``device`` plus the offset."""
    with on_device(api, device):
        base, size = api.address_range(ptr)
        if ptr + length > base + size:
            raise ValueError(
                f"region [0x{ptr:x}, +{length}) runs past its allocation [0x{base:x}, +{size}) on cuda:{device}"
            )
        return IpcExport(api.ipc_get(base), ptr - base, size)


# (handle bytes, local device) -> [mapped base, reference count]
_OPENED: dict[tuple[bytes, int], list] = {}


def open_handle(api: _CudaApi, handle: bytes, device: int) -> int:
    """Map the peer allocation named by ``handle`` for ``device``'s kernels; return its base."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {type(handle).__name__} {handle!r:.40}")
    key = (bytes(handle), device)
    with _LOCK:
        entry = _OPENED.get(key)
        if entry is None:
            with on_device(api, device):
                entry = _OPENED[key] = [api.ipc_open(bytes(handle)), 0]
        entry[1] += 1
        return entry[0]


def close_handle(api: _CudaApi, handle: bytes, device: int) -> None:
    """Release one :func:`open_handle`; unmap on the last release."""
    key = (bytes(handle), device)
    with _LOCK:
        entry = _OPENED.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _OPENED[key]
        with on_device(api, device):
            api.ipc_close(entry[0])


# -- a peer's regions mapped here ------------------------------------------------------------------


class PeerMapping:
    """The peer's regions, opened per local GPU on demand; :meth:`close` unmaps them all."""

    def __init__(self, api, name: str, regions: Mapping[int, Region], handles: Mapping[int, tuple[bytes, int, int]]):
        """``handles``: region id -> (IPC handle, offset in the allocation, allocation bytes)."""
        for rid, (_, offset, alloc_size) in handles.items():
            reg = regions[rid]
            if offset + reg.length > alloc_size:
                raise PeerDescriptorError(
                    f"peer region {rid} [{offset}, +{reg.length}) exceeds its allocation of {alloc_size} bytes"
                )
        self._api, self._name, self._regions, self._handles = api, name, regions, dict(handles)
        self._bases: dict[int, np.ndarray] = {}  # GPU -> [num peer region ids] addresses
        self._opened: list[tuple[int, bytes, int]] = []  # (region id, handle, GPU it was opened under)
        self._dropped: set[int] = set()  # revoked region ids: unmapped, never opened again
        self._lock = threading.Lock()

    def is_open(self, device: int) -> bool:
        return device in self._bases

    def bases(self, device: int) -> np.ndarray:
        """The pointer table of the peer's regions as mapped for ``device``'s kernels (opened at
        the first call). :class:`NvlinkUnsupported` when a handle cannot be opened there."""
        table = self._bases.get(device)
        if table is not None:
            return table
        with self._lock:
            table = self._bases.get(device)
            return table if table is not None else self._open(device)

    def _open(self, device: int) -> np.ndarray:
        top = max(self._regions) if self._regions else -1
        table = np.zeros(top + 1, dtype=np.int64)  # [num peer region ids] addresses
        for rid, (handle, offset, _) in self._handles.items():
            if rid in self._dropped:
                continue
            try:
                base = open_handle(self._api, handle, device)
            except CudaIpcError as exc:
                raise NvlinkUnsupported(
                    f"cannot open peer {self._name!r} region {rid} (peer cuda:{self._regions[rid].device}) "
                    f"on local cuda:{device}: {exc}"
                ) from None
            self._opened.append((rid, handle, device))
            table[rid] = base + offset
        self._bases[device] = table
        return table

    @property
    def opened(self) -> bool:
        return bool(self._opened)

    def drop(self, regions: Iterable[int]) -> None:
        """Unmap ``regions`` (revoked: the caller waited for the copies that use them) under
        every GPU; later openings skip them."""
        regions = set(regions)
        with self._lock:
            self._dropped |= regions
            self._close([o for o in self._opened if o[0] in regions])
            for table in self._bases.values():
                table[[r for r in regions if r < table.size]] = 0

    def close(self) -> None:
        """Unmap every opened handle (the caller first waits for the copies that use them)."""
        with self._lock:
            self._close(list(self._opened))
            self._bases.clear()

    def _close(self, opened: list) -> None:
        for entry in opened:
            self._opened.remove(entry)
            _, handle, device = entry
            try:
                close_handle(self._api, handle, device)
            except CudaIpcError:
                pass  # the mapping is gone with the peer; nothing left to release


# -- the export ------------------------------------------------------------------------------------


BACKEND = "nvlink"


def gpu_uuid(device: Optional[int]) -> Optional[str]:
    """The UUID of ``device`` (the same GPU has the same UUID in every process), or None."""
    if device is None:
        return None
    try:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # no CUDA, or a torch without the property: the staged engine stays off
        return None


def local_ordinal(uuid) -> Optional[int]:
    """This process's ordinal of the GPU with ``uuid`` (None when it does not see it)."""
    if not isinstance(uuid, str):
        return None
    import torch

    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    return None


def parse_descriptor(peer_bytes) -> tuple[dict, dict[int, Region], dict[int, tuple[bytes, int, int]]]:
    """Decode an nvlink export: (body, regions by id, ipc by id as (handle, offset, alloc_size))."""
    body, regions = unpack_descriptor(peer_bytes, BACKEND, required=("name", "host", "pid", "mailbox", "ipc"))
    for key, typ in (("name", str), ("host", str), ("pid", int), ("mailbox", str), ("ipc", list)):
        if not isinstance(body[key], typ):
            raise PeerDescriptorError(f"peer descriptor field {key!r} must be {typ.__name__}, got {body[key]!r:.60}")
    host_regions = [rid for rid, r in regions.items() if not r.is_cuda]
    if host_regions:
        raise PeerDescriptorError(f"nvlink peer descriptor lists host regions {host_regions}; only GPU regions are allowed")
    ipc: dict[int, tuple[bytes, int, int]] = {}
    for item in body["ipc"]:
        ok = (
            isinstance(item, list) and len(item) == 4 and isinstance(item[0], int)
            and isinstance(item[1], bytes) and len(item[1]) == IPC_HANDLE_BYTES
            and isinstance(item[2], int) and isinstance(item[3], int) and item[2] >= 0 and item[3] > 0
        )
        if not ok:
            raise PeerDescriptorError(
                f"ipc entry must be [region id, {IPC_HANDLE_BYTES}-byte handle, offset >= 0, "
                f"allocation size > 0], got {item!r:.80}"
            )
        ipc[item[0]] = (item[1], item[2], item[3])
    if set(ipc) != set(regions):
        raise PeerDescriptorError(
            f"ipc entries cover regions {sorted(ipc)}, the region table lists {sorted(regions)}"
        )
    return body, regions, ipc
