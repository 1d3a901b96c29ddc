"""CPU host setting for selected-row training: keep freed memory in the process (glibc malloc).

The selected-row backward allocates fresh buffers of a new size each step (the gathered rows).  glibc
returns freed memory at the top of its heap to the OS (trim threshold 128 KiB) and serves large blocks
with mmap, so each step page-faults its buffers in again: measured on deit_tiny (12 blocks, N=128, one
thread) the gathers took 260-400 ms of a 1.6 s backward at f = 0.5 (backward 0.66 of dense), 39 ms with
the settings below (0.52 of dense, ideal 0.50).  GPU allocators cache blocks, so this is CPU-only.

``retain_freed_memory()`` sets glibc's trim threshold to 1 GiB and its mmap threshold to its maximum
(32 MiB) with ``mallopt``; a no-op (False) off glibc.  The training CLI calls it for CPU runs
(``CAPSKIP_MALLOC_TUNING=0`` opts out); call it yourself in a CPU training script.  The price: up to
the trim threshold of freed memory stays mapped to the process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_BYTES, MMAP_BYTES = 1 << 30, 32 << 20  # glibc caps the mmap threshold at 32 MiB on 64-bit


def retain_freed_memory() -> bool:
    """Keep freed heap memory mapped (see the module docstring).  True if glibc accepted both settings."""
    if not sys.platform.startswith("linux") or os.environ.get("CAPSKIP_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES))
