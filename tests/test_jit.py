"""MLX's fused CPU kernels are built for this processor, and nothing else mlxft's process builds is."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxft import _jit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the wrapper is for MLX's Linux CPU backend")

PROBE = """
import json, os
import mlxft, mlxft._jit as jit
import mlx.core as mx, numpy as np
x = mx.linspace(-5, 5, 1001)
y = mx.compile(lambda v: mx.exp(v) * 2 + 1)(x)
err = float(np.abs(np.array(y) - (np.exp(np.array(x, dtype=np.float64)) * 2 + 1)).max())
print(json.dumps({"applied": jit.applied, "path": os.environ["PATH"], "cpu": mx.default_device() == mx.cpu, "err": err}))
"""


def clean_path() -> list[str]:
    """This process's PATH without mlxft's wrapper."""
    return [p for p in os.environ["PATH"].split(os.pathsep) if not p.endswith(os.path.join("jit", "bin"))]


def probe(tmp, cache, path_first=None, **env):
    """Run PROBE with a fresh MLX kernel cache (TMPDIR) under ``tmp``; no wrapper of this test
    process on PATH unless ``path_first`` puts one there."""
    path = os.pathsep.join(([path_first] if path_first else []) + clean_path())
    full = {**os.environ, "MLXFT_CACHE": str(cache), "TMPDIR": str(tmp), "PATH": path, **env}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=full, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def instructions(library) -> list[str]:
    """The disassembled code of a compiled kernel, without addresses or its file's name."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True).stdout
    return [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(" ") and ":" in line]


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX compiles its CPU kernels with g++")
def test_mlx_kernels_are_compiled_by_the_wrapper_unless_the_user_opts_out(tmp_path):
    """The same kernel, built through the wrapper and (opted out, with the wrapper inherited on
    PATH) without it, computes exp either way and differs in its code."""
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    cache = tmp_path / "cache"
    on = probe(tmp_path / "on", cache)
    if not on["cpu"]:
        pytest.skip("MLX's default device is not the CPU")
    wrapper = str(cache / "jit" / "bin")
    off = probe(tmp_path / "off", cache, path_first=wrapper, MLXFT_JIT="default")
    assert on["applied"] == wrapper and on["path"].split(os.pathsep)[0] == wrapper
    assert off["applied"] is None and wrapper not in off["path"].split(os.pathsep)
    assert on["err"] < 1e-4 and off["err"] < 1e-4
    built = {name: {k.name: k for k in (tmp_path / name).glob("mlx/*/cpu/*.so")} for name in ("on", "off")}
    assert built["on"] and built["on"].keys() == built["off"].keys()
    if shutil.which("objdump"):
        for name, library in built["on"].items():
            assert instructions(library) != instructions(built["off"][name]), "the wrapper did not change MLX's build"
    # MLX's header was precompiled, and the kernels built with it have the code a plain build gives.
    (headers,) = (cache / "jit" / "headers").iterdir()
    assert (headers / "ready").is_file() and (headers / "mlx" / "backend" / "cpu" / "compiled_preamble.h.gch").is_file()
    if shutil.which("objdump"):
        import mlx.core as mx

        source = next(iter(built["on"].values())).with_suffix(".cpp")
        source = source.with_name(source.name.removeprefix("lib"))
        plain = tmp_path / "plain.so"
        subprocess.run(["g++", "-march=native", "-std=c++17", "-O3", "-Wall", "-fPIC", "-shared", "-I",
                        str(Path(mx.__file__).parent / "include"), str(source), "-o", str(plain)],
                       capture_output=True, check=True, env={**os.environ, "PATH": os.pathsep.join(clean_path())})
        assert instructions(plain) == instructions(next(iter(built["on"].values())))


def _fake_compiler(tmp_path, refuse_native: bool, refuse_header: bool = False):
    """A 'compiler' that records its arguments, writes a header's output file (unless it refuses
    headers) and refuses -march=native when asked to."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake-g++"
    refuse = 'case "$1" in -march=native) exit 1 ;; esac\n' if refuse_native else ""
    header = ("exit 1" if refuse_header else 'for a; do [ "$prev" = -o ] && : > "$a"; prev="$a"; done')
    fake.write_text(f'#!/bin/sh\n{refuse}echo "$*" >> "{log}"\ncase "$*" in *c++-header*) {header} ;; esac\n')
    fake.chmod(0o755)
    return str(fake), log


@pytest.mark.parametrize("refuse_native", [False, True])
def test_only_sources_in_mlx_kernel_cache_get_the_flag_and_a_refused_flag_falls_back(tmp_path, refuse_native):
    real, log = _fake_compiler(tmp_path, refuse_native)
    wrapper = _jit.write_wrapper(str(tmp_path / "bin"), real)
    assert _jit.write_wrapper(str(tmp_path / "bin"), real) == wrapper  # kept, not rewritten
    kernel = ["-std=c++17", "-O3", "-shared", "/tmp/mlx/0.32.4/cpu/k.cpp", "-o", "/tmp/mlx/0.32.4/cpu/libk.so"]
    other = ["-O2", "-shared", "/home/me/ext/module.cpp", "-o", "/home/me/ext/module.so"]
    for args in (kernel, other, ["--version"]):
        assert subprocess.run([wrapper, *args]).returncode == 0
    calls = log.read_text().splitlines()
    first = [] if refuse_native else ["-march=native " + " ".join(kernel)]
    fallback = [" ".join(kernel)] if refuse_native else []
    assert calls == first + fallback + [" ".join(other), "--version"]


@pytest.mark.parametrize("refuse_header", [False, True])
def test_mlx_header_is_precompiled_once_per_installation(tmp_path, refuse_header):
    real, log = _fake_compiler(tmp_path, False, refuse_header)
    include = tmp_path / "site-packages" / "mlx" / "include"
    header = include / "mlx" / "backend" / "cpu" / "compiled_preamble.h"
    header.parent.mkdir(parents=True)
    header.write_text("#pragma once\n")
    wrapper = _jit.write_wrapper(str(tmp_path / "cache" / "jit" / "bin"), real)
    kernel = ["-std=c++17", "-O3", "-shared", "-I", str(include), "/tmp/mlx/0.32.4/cpu/k.cpp", "-o", "/tmp/mlx/0.32.4/cpu/libk.so"]
    for _ in range(2):
        assert subprocess.run([wrapper, *kernel]).returncode == 0
    (pch,) = [d for d in (tmp_path / "cache" / "jit" / "headers").iterdir() if not d.name.endswith(".lock")]
    build = (f"-march=native -std=c++17 -O3 -Wall -fPIC -I {include} -x c++-header "
             f"{pch}/mlx/backend/cpu/compiled_preamble.h -o {pch}/building.gch")
    calls = log.read_text().splitlines()
    if refuse_header:  # tried once; the kernels build as before
        assert calls == [build] + ["-march=native " + " ".join(kernel)] * 2
        assert not (pch / "ready").exists()
        return
    assert calls == [build] + [f"-I {pch} -march=native " + " ".join(kernel)] * 2
    assert (pch / "mlx" / "backend" / "cpu" / "compiled_preamble.h.gch").is_file()
    assert (pch / "mlx" / "backend" / "cpu" / "compiled_preamble.h").read_text() == header.read_text()
    # MLX reinstalled or rebuilt (any header newer): its header is precompiled anew.
    included = header.parent / "simd.h"
    included.write_text("")
    os.utime(included, (header.stat().st_mtime + 10,) * 2)
    assert subprocess.run([wrapper, *kernel]).returncode == 0
    assert len([d for d in pch.parent.iterdir() if not d.name.endswith(".lock")]) == 2
