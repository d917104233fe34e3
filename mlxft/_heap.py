"""Keep freed buffers mapped on MLX's Linux CPU backend, so each step does not fault them in again.

MLX's CPU allocator passes every buffer to ``malloc`` and back to ``free``. glibc serves large
requests with fresh ``mmap`` pages and unmaps them when they are freed, so every training step
maps its activations anew and the kernel zeroes each page before MLX writes it: on this
repository's 2-core machine 9% of a SmolLM2-135M step's CPU time was the kernel's
``clear_page``. With ``mmap`` off for ``malloc`` and the heap's trim threshold raised, freed
buffers stay in the heap and the next step reuses them (see :data:`TRIM_THRESHOLD`).

Applied once, on import, only on Linux with glibc while MLX's default device is the CPU (a CUDA
build's buffers do not come from ``malloc``). A user's own ``GLIBC_TUNABLES`` malloc settings or
``MALLOC_MMAP_*_``, ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_TOP_PAD_`` stand, and
``MLXFT_HEAP=default`` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

import mlx.core as mx

# mallopt(3) parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Free memory at the top of the heap beyond this goes back to the system; below it, it stays
# for the next step. 2 GB, the most mallopt's int takes (SmolLM2-135M's step peaks at 1.9 GB).
TRIM_THRESHOLD = 2**31 - 1

# glibc's own variables for what this module sets (and the two beside them).
_MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

applied = False
"""Whether this process's ``malloc`` was set to keep freed buffers."""


def _user_settings() -> bool:
    if os.environ.get("MLXFT_HEAP", "").strip().lower() == "default":
        return True
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(name in os.environ for name in _MALLOC_VARIABLES)


def keep_freed_buffers() -> bool:
    """Set glibc's ``malloc`` to serve MLX's CPU buffers from a heap it keeps; True if it did."""
    global applied
    if applied or not sys.platform.startswith("linux") or _user_settings():
        return applied
    if mx.default_device() != mx.cpu:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries: nothing to set
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_MAX, 0))
    return applied
