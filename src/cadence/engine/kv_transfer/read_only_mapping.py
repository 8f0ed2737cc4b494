"""A file's bytes as a uint8 tensor over a read-only shared mapping that holds no descriptor.

Python's `mmap.mmap` keeps a duplicate of the file's descriptor for the mapping's life
(before 3.13's `trackfd`), so a reader mapping every KV tensor of a few prefill engines
would hold hundreds of descriptors, near the usual limit of 1024. `torch.from_file`
closes its descriptor but maps read-write. So the mapping is made with libc's `mmap`
here, and undone by `munmap` when the tensor's storage lets go of it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_read_only(fd: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of the file open as `fd`, mapped shared and read-only: a write
    through the tensor faults instead of changing the file. The caller may close `fd`."""
    address = _libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    # The tensor holds `raw` through the buffer protocol; once it is released, unmap.
    weakref.finalize(raw, _libc.munmap, address, nbytes)
    return torch.frombuffer(raw, dtype=torch.uint8)
