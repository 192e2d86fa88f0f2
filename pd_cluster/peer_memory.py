"""Memory that every rank of a tensor-parallel group can address: the buffers of the peer
all-reduce (pd_cluster/peer_all_reduce.py).

A rank allocates its own region and publishes a handle; the others open the handle and get
an address of that region in their own process:
- `CudaPeerMemory`: cudaMalloc'ed device memory shared by CUDA IPC (cudaIpcGetMemHandle /
  cudaIpcOpenMemHandle with lazy peer access, so a peer's loads and stores go over NVLink).
  It calls the CUDA runtime that torch itself loaded, through ctypes, so the handles are
  opened in this rank's own device context (torch's IPC would open a context on the peer's
  device in every process) and no extension has to be built.
- `HostPeerMemory`: a shared-memory file, for CPU ranks (the kernels run under Triton's
  interpreter there, which reads raw host addresses).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import tempfile
from typing import Protocol

import torch

IPC_LAZY_ENABLE_PEER_ACCESS = 1     # cudaIpcMemLazyEnablePeerAccess
MEMCPY_HOST_TO_DEVICE = 1           # cudaMemcpyHostToDevice


class PeerMemory(Protocol):
    address: int        # this rank's region, as this process addresses it
    handle: bytes       # what a peer needs to open it

    def open(self, handle: bytes) -> int:
        """Map a peer's region (its `handle`) into this process; returns its address here."""

    def write(self, offset: int, data: bytes) -> None:
        """Copy host bytes into this rank's region at `offset` (before any peer uses it)."""

    def close(self) -> None:
        """Unmap the peers' regions and free this rank's."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (the same one: its current device is torch's)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        raise OSError("torch did not load a shared CUDA runtime (libcudart) in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle,
                                         ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_cudart().cudaGetErrorString(rc).decode()}")


class CudaPeerMemory:
    """`nbytes` of zeroed device memory on the current device (torch.cuda.set_device first)."""

    def __init__(self, nbytes: int):
        rt = _cudart()
        ptr = ctypes.c_void_p()
        _check(rt.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        self.address = ptr.value
        self._opened: list[int] = []
        _check(rt.cudaMemset(ptr, 0, nbytes), "cudaMemset")
        torch.cuda.synchronize()        # zeroed before any peer can signal into it
        handle = _IpcHandle()
        _check(rt.cudaIpcGetMemHandle(ctypes.byref(handle), ptr), "cudaIpcGetMemHandle")
        self.handle = bytes(handle)     # all 64 bytes (`.reserved` would stop at a NUL)

    def open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        _check(_cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr),
                                             _IpcHandle.from_buffer_copy(handle),
                                             IPC_LAZY_ENABLE_PEER_ACCESS),
               "cudaIpcOpenMemHandle")
        self._opened.append(ptr.value)
        return ptr.value

    def write(self, offset: int, data: bytes) -> None:
        # Synchronous for pageable host memory: done when it returns.
        _check(_cudart().cudaMemcpy(self.address + offset, data, len(data),
                                    MEMCPY_HOST_TO_DEVICE), "cudaMemcpy")

    def close(self) -> None:
        rt = _cudart()
        for ptr in self._opened:
            rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
        if self.address:
            rt.cudaFree(ctypes.c_void_p(self.address))
        self._opened, self.address = [], 0


class SharedFile:
    """A file in /dev/shm mapped into this process: `create` makes one, `attach` maps one
    made by another process (by its `path`). It reads as zeros until written."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.view = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, prefix: str) -> SharedFile:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=prefix, dir=folder)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        return cls(path)

    @property
    def address(self) -> int:
        return self.view.data_ptr()

    def unlink(self) -> None:
        """Remove the name (the mappings stay): once every process has attached, or at close."""
        if os.path.exists(self.path):
            os.unlink(self.path)

    def close(self) -> None:
        self.view = None        # the tensor's export of the map ends before the map closes
        self._map.close()


class HostPeerMemory:
    """`nbytes` of zeroed shared memory (a SharedFile)."""

    def __init__(self, nbytes: int):
        self._own = SharedFile.create(nbytes, "pd-peer-")
        self._attached: list[SharedFile] = []
        self.address = self._own.address
        self.handle = self._own.path.encode()

    def open(self, handle: bytes) -> int:
        self._attached.append(SharedFile(handle.decode()))
        return self._attached[-1].address

    def write(self, offset: int, data: bytes) -> None:
        self._own.view[offset:offset + len(data)] = torch.frombuffer(bytearray(data),
                                                                     dtype=torch.uint8)

    def close(self) -> None:
        for f in self._attached + [self._own]:
            f.close()
        self._own.unlink()
        self._attached = []


def allocate(nbytes: int, device: torch.device) -> PeerMemory:
    return CudaPeerMemory(nbytes) if device.type == "cuda" else HostPeerMemory(nbytes)
