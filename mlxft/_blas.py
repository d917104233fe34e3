"""Give MLX's Linux CPU backend an optimized BLAS before MLX is first imported.

The ``mlx-cpu`` wheel links a reference BLAS that runs float32 matmuls ~30x slower than
OpenBLAS on the same cores. MLX resolves ``cblas_sgemm`` and friends through the dynamic
linker, so loading an optimized BLAS into the global symbol scope *before* ``mlx.core``
is imported makes MLX use it, with no environment variables and no relaunch.

Search order: ``MLXFT_BLAS`` (a CBLAS library path, or ``none`` to keep MLX's own), Intel MKL
installed by pip into this environment (``pip install "mlxft[mkl]"``: installing it there is a
choice, and on this repository's Intel Xeon it took a SmolLM2-135M step 9% under the system's
OpenBLAS), the system's OpenBLAS, and finally the ``scipy-openblas32`` wheel (a dependency on
Linux). That wheel prefixes its symbols (``scipy_cblas_sgemm``), so a
three-function C shim exporting the plain names is compiled once with the system's C
compiler into the cache directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from mlxft.builtin import cache_dir  # plain Python: MLX is not imported before the BLAS

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

_INSTALL_HINT = (
    "MLX's Linux CPU wheel is using its slow reference BLAS; install OpenBLAS for ~30x faster "
    "float32 training (Debian/Ubuntu: apt-get install libopenblas0-pthread, Fedora: dnf install "
    "openblas-threads, or pip install mkl; or install a C compiler so mlxft can use the "
    "scipy-openblas32 wheel), or set MLXFT_BLAS to a CBLAS library path"
)

# The three CBLAS entry points MLX's CPU backend calls, forwarded to the prefixed ones.
_SHIM_SOURCE = """
typedef int I;
extern void scipy_cblas_sgemm(I, I, I, I, I, I, float, const float *, I, const float *, I, float, float *, I);
extern void scipy_cblas_dgemm(I, I, I, I, I, I, double, const double *, I, const double *, I, double, double *, I);
extern void scipy_cblas_cgemm(I, I, I, I, I, I, const void *, const void *, I, const void *, I, const void *, void *, I);
void cblas_sgemm(I o, I ta, I tb, I m, I n, I k, float al, const float *a, I la, const float *b, I lb, float be, float *c, I lc)
{ scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
void cblas_dgemm(I o, I ta, I tb, I m, I n, I k, double al, const double *a, I la, const double *b, I lb, double be, double *c, I lc)
{ scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
void cblas_cgemm(I o, I ta, I tb, I m, I n, I k, const void *al, const void *a, I la, const void *b, I lb, const void *be, void *c, I lc)
{ scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, la, b, lb, be, c, lc); }
"""

loaded: str | None = None
"""Path of the BLAS library preloaded for MLX, or None when MLX keeps its own."""

mlx_came_first = False
"""True when mlx.core was already imported as mlxft loaded, so no BLAS could be preloaded."""

_searched = False


def _mkl_candidates() -> list[str]:
    found = []
    for prefix in {sys.prefix, sys.base_prefix}:
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    return found


def _scipy_openblas_shim() -> str | None:
    """Path of a compiled shim over the scipy-openblas32 wheel, building it once if needed."""
    spec = importlib.util.find_spec("scipy_openblas32")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = os.path.join(spec.submodule_search_locations[0], "lib")
    lib = os.path.join(lib_dir, "libscipy_openblas.so")
    if not os.path.exists(lib):
        return None
    key = hashlib.sha256(f"{lib}:{os.path.getmtime(lib)}:{_SHIM_SOURCE}".encode()).hexdigest()[:16]
    shim = str(cache_dir() / "blas" / f"libmlxft_cblas-{key}.so")
    if os.path.exists(shim):
        return shim
    if compiler is None:
        return None
    try:
        os.makedirs(os.path.dirname(shim), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(shim)) as tmp:
            source = os.path.join(tmp, "shim.c")
            with open(source, "w") as f:
                f.write(_SHIM_SOURCE)
            built = os.path.join(tmp, "shim.so")
            subprocess.run(
                [compiler, "-shared", "-fPIC", "-O2", "-o", built, source, f"-L{lib_dir}", "-lscipy_openblas",
                 f"-Wl,-rpath,{lib_dir}"],
                check=True, capture_output=True, timeout=120,
            )
            os.replace(built, shim)
    except (OSError, subprocess.SubprocessError):
        return None
    return shim


def _candidates() -> list[str]:
    choice = os.environ.get("MLXFT_BLAS", "").strip()
    if choice.lower() == "none":
        return []
    if choice:
        return [choice]
    names = _mkl_candidates() + list(_CANDIDATES)
    try:
        system = ctypes.util.find_library("openblas")
    # CPython's search parses the linker's output, and raises where that output names a file
    # that is not there (an LD_PRELOAD of a missing library): importing mlxft must not fail.
    except Exception:
        system = None
    if system:
        names.append(system)
    return names + ["scipy-openblas32"]


def _find(mode: int) -> str | None:
    """Path of the first usable CBLAS, opened with ``mode``; None when there is none."""
    for path in _candidates():
        if path == "scipy-openblas32":
            path = _scipy_openblas_shim()
            if path is None:
                continue
        if os.path.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=mode)
            lib.cblas_sgemm  # noqa: B018 - must export the symbol MLX calls
        except (OSError, AttributeError):
            continue
        return path
    return None


def preload() -> str | None:
    """Load the first usable CBLAS into the global scope; return its path (Linux only)."""
    global loaded, mlx_came_first, _searched
    if loaded is not None or not sys.platform.startswith("linux"):
        return loaded
    if "mlx.core" in sys.modules:
        # Only the first call sees the user's import order: later ones may follow mlxft's own import of MLX.
        if not _searched:
            mlx_came_first = True
        _searched = True
        return None
    _searched = True
    loaded = _find(ctypes.RTLD_GLOBAL)
    return loaded


@functools.cache
def hint() -> str:
    """What to do about MLX's reference BLAS: install a faster one, or import mlxft before mlx (worked
    out when a warning needs it, since naming the library mlxft would have loaded can mean a search)."""
    choice = os.environ.get("MLXFT_BLAS", "").strip()
    if choice.lower() == "none":
        return "MLX's Linux CPU wheel is using its slow reference BLAS, as MLXFT_BLAS=none asks; unset it for a faster one"
    if choice and not mlx_came_first:  # the only candidate a set MLXFT_BLAS leaves
        return (f"MLXFT_BLAS={choice} could not be loaded as a CBLAS library, so MLX uses its slow reference BLAS; "
                "point it at one (libopenblas.so.0, libmkl_rt.so) or unset it to let mlxft search")
    if not mlx_came_first or not _candidates():
        return _INSTALL_HINT
    # RTLD_LOCAL: MLX has already bound its BLAS symbols, so this only checks what the search would pick.
    found = _find(ctypes.RTLD_LOCAL)
    if found is None:
        return f"{_INSTALL_HINT}; then import mlxft before mlx and mlx_lm in your script"
    return (f"MLX's Linux CPU wheel is using its slow reference BLAS because mlx was imported before mlxft, too late "
            f"for mlxft to load {found}: import mlxft first in your script, before mlx and mlx_lm")


def uses_reference_blas() -> bool:
    """True when MLX runs on the CPU backend of Linux with its slow bundled BLAS."""
    if not sys.platform.startswith("linux") or loaded is not None:
        return False
    import mlx.core as mx

    return mx.default_device() == mx.cpu
