"""CPU host setting for selected-row training: keep freed memory in the process (glibc malloc).

The selected-row backward allocates fresh buffers of a new size each step (the gathered rows).  glibc
adapts to that by itself after a few large frees (its dynamic mmap threshold, with the trim threshold
at twice it), but any explicit threshold switches the adaptation off: with ``MALLOC_MMAP_THRESHOLD_``
set alone (a common PyTorch-on-CPU tip, and what our benchmark used to set) the trim threshold stays at
128 KiB, freed buffers at the top of the heap go back to the OS, and every step page-faults its gathered
rows in again: on deit_tiny (12 blocks, N=128, one thread) the gathers then took 260-400 ms of a 1.6 s
backward at f = 0.5, against 39 ms with the settings below.  GPU allocators cache blocks: CPU only.

``retain_freed_memory()`` sets glibc's trim threshold to 1 GiB and its mmap threshold to its maximum
(32 MiB) with ``mallopt``, from the first step and whatever the environment says; a no-op (False) off
glibc.  In steady state with glibc's defaults it changes little (benchmark: backward 0.52 vs 0.51 of
dense at f = 0.5).  The training CLI calls it for CPU runs (``CAPSKIP_MALLOC_TUNING=0`` opts out).  The
price: up to 1 GiB of freed memory stays mapped to the process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

from .config import malloc_tuning_enabled

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_BYTES, MMAP_BYTES = 1 << 30, 32 << 20  # glibc caps the mmap threshold at 32 MiB on 64-bit


def retain_freed_memory() -> bool:
    """Keep freed heap memory mapped (see the module docstring).  True if glibc accepted both settings."""
    if not sys.platform.startswith("linux") or not malloc_tuning_enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES))
