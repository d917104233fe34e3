"""Give MLX's Linux CPU backend an optimized BLAS before MLX is first imported.

The ``mlx-cpu`` wheel links a reference BLAS that runs float32 matmuls ~30x slower than
OpenBLAS on the same cores. MLX resolves ``cblas_sgemm`` and friends through the dynamic
linker, so loading an optimized BLAS into the global symbol scope *before* ``mlx.core``
is imported makes MLX use it, with no environment variables and no relaunch.

Set ``MLXFT_BLAS=/path/to/libopenblas.so`` to choose a library, or ``MLXFT_BLAS=none`` to
keep MLX's bundled one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

_CANDIDATES = (
    # Debian / Ubuntu (apt install libopenblas0-pthread)
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    # Fedora / RHEL / Arch
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

HINT = (
    "MLX's Linux CPU wheel is using its slow reference BLAS; install OpenBLAS for ~30x faster "
    "float32 training (Debian/Ubuntu: apt-get install libopenblas0-pthread, Fedora: dnf install "
    "openblas-threads, or pip install mkl), or set MLXFT_BLAS to a CBLAS library path"
)

loaded: str | None = None
"""Path of the BLAS library preloaded for MLX, or None when MLX keeps its own."""


def _mkl_candidates() -> list[str]:
    found = []
    for prefix in {sys.prefix, sys.base_prefix}:
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    return found


def _candidates() -> list[str]:
    choice = os.environ.get("MLXFT_BLAS", "").strip()
    if choice.lower() == "none":
        return []
    if choice:
        return [choice]
    names = list(_CANDIDATES)
    system = ctypes.util.find_library("openblas")
    if system:
        names.append(system)
    return names + _mkl_candidates()


def preload() -> str | None:
    """Load the first usable CBLAS into the global scope; return its path (Linux only)."""
    global loaded
    if loaded is not None or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return loaded
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - must export the symbol MLX calls
        except (OSError, AttributeError):
            continue
        loaded = path
        return loaded
    return None


def uses_reference_blas() -> bool:
    """True when MLX runs on the CPU backend of Linux with its slow bundled BLAS."""
    if not sys.platform.startswith("linux") or loaded is not None:
        return False
    import mlx.core as mx

    return mx.default_device() == mx.cpu
