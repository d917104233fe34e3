"""Build MLX's fused CPU kernels for the processor they run on.

On the CPU backend ``mx.compile`` fuses elementwise graphs into C++ kernels that MLX compiles at
run time with ``g++ -O3`` and no target, so for generic x86-64: no AVX, and every fused
multiply-add in MLX's ``exp`` is a call into libm. MLX finds ``g++`` on ``PATH``, so on import
mlxft puts a wrapper first there that adds ``-march=native`` to the compilations of sources in
MLX's kernel cache (``.../mlx/<version>/cpu/``; a kernel runs only where it was built) and runs
every other compilation exactly as asked, so nothing else this process or its children build
changes. Where the flag fails, the wrapper compiles as MLX asked. On this repository's Intel Xeon
a SmolLM2-135M chat step (4 x 224 tokens) took 4.09-4.17 s against 4.42-4.50, with the same loss.

Each kernel's source includes MLX's ``compiled_preamble.h``, and parsing it was 1.2 of the 1.4 s
a kernel took to build on a 2-core EPYC (a run builds dozens; the test suite about 300). The
wrapper precompiles that header once per MLX installation (keyed on its include directory and
the newest time stamp of its headers, kept in the cache's ``jit/headers``) and puts it first on
the include path: a kernel then builds in 0.3 s, to the same machine code. g++ checks that a
precompiled header matches the compilation's flags and parses the header itself when it does
not; while one process builds it, the others compile without it.

Applied once, on import, only on Linux while MLX's default device is the CPU and ``g++`` is
installed; ``MLXFT_JIT=default`` leaves MLX's compiler as it is (and takes the wrapper off a
``PATH`` inherited from a process that applied it). MLX keeps compiled kernels in
its cache by name, so kernels it compiled before keep their code.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx

from mlxft.builtin import cache_dir

applied: str | None = None
"""The directory whose ``g++`` wrapper this process put first on ``PATH``, or None."""

_WRAPPER = """#!/bin/sh
# Written by mlxft (mlxft/_jit.py): MLX's CPU kernels are built for this processor, with MLX's
# header parsed once per installation; anything else is compiled as asked.
case "$*" in
  */mlx/*/cpu/*) ;;
  *) exec {real} "$@" ;;
esac
include="" previous=""
for arg in "$@"; do
  [ "$previous" = "-I" ] && include="$arg"
  previous="$arg"
done
header="$include/mlx/backend/cpu/compiled_preamble.h"
pch=""
if [ -n "$include" ] && [ -f "$header" ]; then
  # The installation: its include directory and the newest time stamp among its headers.
  newest=$(find "$include/mlx" -name "*.h" -printf "%T@\\n" 2>/dev/null | sort -n | tail -n 1)
  key=$(printf '%s\\n' "$include" "$newest" | cksum | cut -d" " -f1)
  pch={headers}/$key
  if [ ! -f "$pch/ready" ] && [ ! -f "$pch/failed" ]; then
    # A lock left by a killed build; headers of installations unused for a month (50 MB each).
    mkdir -p {headers} && find {headers} -maxdepth 1 -name "*.lock" -mmin +10 -exec rmdir {{}} + 2>/dev/null
    find {headers} -mindepth 1 -maxdepth 1 ! -name "*.lock" -mtime +30 -exec rm -rf {{}} + 2>/dev/null
    if mkdir "$pch.lock" 2>/dev/null; then
      mkdir -p "$pch/mlx/backend/cpu" && cp "$header" "$pch/mlx/backend/cpu/" \\
        && {real} -march=native -std=c++17 -O3 -Wall -fPIC -I "$include" -x c++-header \\
             "$pch/mlx/backend/cpu/compiled_preamble.h" -o "$pch/building.gch" >/dev/null 2>&1 \\
        && mv "$pch/building.gch" "$pch/mlx/backend/cpu/compiled_preamble.h.gch" && touch "$pch/ready" \\
        || touch "$pch/failed"  # not tried again for this installation (until pruned)
      rmdir "$pch.lock"
    fi
  fi
  if [ -f "$pch/ready" ]; then touch "$pch" 2>/dev/null; else pch=""; fi  # touched: in use
fi
if [ -n "$pch" ]; then
  {real} -I "$pch" -march=native "$@" 2>/dev/null && exit 0
fi
{real} -march=native "$@" 2>/dev/null && exit 0
exec {real} "$@"
"""


def wrapper_source(real: str, headers: str) -> str:
    """The wrapper script around the compiler at ``real``, keeping precompiled headers in ``headers``."""
    return _WRAPPER.format(real=shlex.quote(real), headers=shlex.quote(headers))


def write_wrapper(directory: str, real: str) -> str:
    """Write (or keep) ``directory/g++`` around ``real``, with its precompiled headers in
    ``directory``'s sibling ``headers``; returns its path."""
    path = os.path.join(directory, "g++")
    source = wrapper_source(real, os.path.join(os.path.dirname(os.path.abspath(directory)), "headers"))
    try:
        with open(path) as f:
            if f.read() == source:
                return path
    except OSError:
        pass
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)  # a process starting beside this one sees the old wrapper or the new
    return path


def build_for_this_processor() -> str | None:
    """Put the ``g++`` wrapper first on ``PATH`` (see the module); returns its directory or None."""
    global applied
    if applied is not None or not sys.platform.startswith("linux"):
        return applied
    directory = str(cache_dir() / "jit" / "bin")
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    others = os.pathsep.join(p for p in path if os.path.abspath(p or ".") != directory)
    if os.environ.get("MLXFT_JIT", "").strip().lower() == "default" or mx.default_device() != mx.cpu:
        if others != os.pathsep.join(path):  # inherited from a parent process that applied it
            os.environ["PATH"] = others
        return None
    real = shutil.which("g++", path=others)
    if real is None:  # MLX has no compiler to run either
        return None
    try:
        wrapper = write_wrapper(directory, real)
        # A cache on a noexec mount would leave MLX no compiler at all: run it once first.
        subprocess.run([wrapper, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):  # MLX compiles as it would
        return None
    os.environ["PATH"] = directory + os.pathsep + others
    applied = directory
    return applied
