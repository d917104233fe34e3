"""Build MLX's fused CPU kernels for the processor they run on.

On the CPU backend ``mx.compile`` fuses elementwise graphs into C++ kernels that MLX compiles at
run time with ``g++ -O3`` and no target, so for generic x86-64: no AVX, and every fused
multiply-add in MLX's ``exp`` is a call into libm. MLX finds ``g++`` on ``PATH``, so on import
mlxft puts a wrapper first there that adds ``-march=native`` to the compilations of sources in
MLX's kernel cache (``.../mlx/<version>/cpu/``; a kernel runs only where it was built) and runs
every other compilation exactly as asked, so nothing else this process or its children build
changes. Where the flag fails, the wrapper compiles as MLX asked. On this repository's Intel Xeon
a SmolLM2-135M chat step (4 x 224 tokens) took 4.09-4.17 s against 4.42-4.50, with the same loss.

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
# Written by mlxft (mlxft/_jit.py): MLX's CPU kernels are built for this processor, anything else as asked.
case "$*" in
  */mlx/*/cpu/*) {real} -march=native "$@" 2>/dev/null && exit 0 ;;
esac
exec {real} "$@"
"""


def wrapper_source(real: str) -> str:
    """The wrapper script around the compiler at ``real``."""
    return _WRAPPER.format(real=shlex.quote(real))


def write_wrapper(directory: str, real: str) -> str:
    """Write (or keep) ``directory/g++`` around ``real``; returns its path."""
    path = os.path.join(directory, "g++")
    source = wrapper_source(real)
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
