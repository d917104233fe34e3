"""The Linux CPU path gets an optimized BLAS, and the results stay exact."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU wheel BLAS is a Linux matter")

PROBE = """
import json, mlxft._blas as blas
import mlx.core as mx, numpy as np
rng = np.random.default_rng(0)
a, b = rng.normal(size=(67, 45)).astype(np.float32), rng.normal(size=(45, 31)).astype(np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b).T.T) - a @ b).max())
errt = float(np.abs(np.array(mx.array(a.T).T @ mx.array(b)) - a @ b).max())
print(json.dumps({"loaded": blas.loaded, "reference": blas.uses_reference_blas(), "err": max(err, errt)}))
"""


def probe(tmp_path, choice):
    env = {**os.environ, "MLXFT_BLAS": choice, "MLXFT_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler for the shim")
def test_scipy_openblas_shim_is_built_once_and_exact(tmp_path):
    first = probe(tmp_path, "scipy-openblas32")
    assert first["loaded"].startswith(str(tmp_path / "blas")) and not first["reference"]
    assert first["err"] < 1e-4
    assert probe(tmp_path, "scipy-openblas32")["loaded"] == first["loaded"]  # cached, not rebuilt


def test_opting_out_keeps_the_reference_blas_and_says_so(tmp_path):
    result = probe(tmp_path, "none")
    assert result["loaded"] is None and result["reference"] and result["err"] < 1e-4


def test_mkl_installed_in_the_environment_comes_first_and_a_broken_one_is_passed_over(tmp_path):
    """``pip install mkl`` puts libmkl_rt in the environment's lib/: mlxft tries it before the
    system's OpenBLAS, and one that cannot be loaded leaves the choice as it was without it."""
    def choose(prefix):
        code = (f"import sys; sys.prefix = sys.base_prefix = {str(prefix)!r}\n"
                "import json, mlxft._blas as blas\n"
                "print(json.dumps({'order': blas._candidates(), 'loaded': blas.loaded}))")
        env = {k: v for k, v in os.environ.items() if k != "MLXFT_BLAS"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**env, "MLXFT_CACHE": str(tmp_path / "cache")})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    (tmp_path / "with" / "lib").mkdir(parents=True)
    fake = tmp_path / "with" / "lib" / "libmkl_rt.so.3"
    fake.write_bytes(b"not a library")
    with_fake, without = choose(tmp_path / "with"), choose(tmp_path / "without")
    assert with_fake["order"] == [str(fake)] + without["order"] and without["order"][-1] == "scipy-openblas32"
    assert with_fake["loaded"] == without["loaded"]


def test_importing_mlx_before_mlxft_is_named_as_the_cause_not_a_missing_blas(tmp_path):
    """``import mlx_lm`` before ``import mlxft`` leaves MLX on its reference BLAS whatever is
    installed: the warning must say to reorder the imports, naming the BLAS the search would load."""
    def run(code, choice=None):
        env = {k: v for k, v in os.environ.items() if k != "MLXFT_BLAS"}
        env.update({"MLXFT_CACHE": str(tmp_path)}, **({"MLXFT_BLAS": choice} if choice else {}))
        proc = subprocess.run([sys.executable, "-c", code + "\nimport json, mlxft._blas as blas\nprint(json.dumps("
                               "{'loaded': blas.loaded, 'reference': blas.uses_reference_blas(), 'hint': blas.hint()}))"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run("import mlxft")
    if first["loaded"] is None:
        pytest.skip("no optimized BLAS in this environment to be kept from MLX")
    late = run("import mlx.core\nimport mlxft")
    assert late["loaded"] is None and late["reference"]
    assert first["loaded"] in late["hint"] and "import mlxft first" in late["hint"]
    assert "install OpenBLAS" not in late["hint"]
    missing = run("import mlx.core\nimport mlxft", choice=str(tmp_path / "no-such-blas.so"))
    assert "install OpenBLAS" in missing["hint"] and "import mlxft before mlx" in missing["hint"]
    # A user's own MLXFT_BLAS had been answered with "install OpenBLAS", whatever was installed.
    kept = run("import mlxft", choice="none")
    assert kept["reference"] and "as MLXFT_BLAS=none asks" in kept["hint"]
    failed = run("import mlxft", choice=str(tmp_path / "no-such-blas.so"))
    assert failed["reference"] and "no-such-blas.so could not be loaded" in failed["hint"]


HEAP_PROBE = """
import ctypes, json, mlxft._heap as heap
import mlx.core as mx

libc = ctypes.CDLL("libc.so.6")
# mallinfo2 (glibc 2.33+) counts in size_t; the older mallinfo's ints suffice for 64 MB.
info = getattr(libc, "mallinfo2", None) or libc.mallinfo
field = ctypes.c_size_t if info.__name__ == "mallinfo2" else ctypes.c_int

class Info(ctypes.Structure):
    _fields_ = [(name, field) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

info.restype = Info
before = info().hblkhd
x = mx.zeros((16 * 1024 * 1024,))  # a 64 MB MLX buffer, well past glibc's mmap threshold
mx.eval(x)
print(json.dumps({"cpu": mx.default_device() == mx.cpu, "applied": heap.applied, "mmapped": info().hblkhd - before}))
"""


def heap_probe(**env):
    proc = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_buffers_come_from_the_heap_unless_the_user_set_malloc():
    ours = heap_probe()
    if not ours["cpu"]:
        pytest.skip("MLX's default device is not the CPU: its buffers do not come from malloc")
    assert ours["applied"] and ours["mmapped"] < 2**20  # the 64 MB buffer is no new mapping
    for env in ({"MLXFT_HEAP": "default"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
                {"MALLOC_MMAP_THRESHOLD_": "65536"}):
        theirs = heap_probe(**env)
        assert not theirs["applied"] and theirs["mmapped"] >= 64 * 2**20, env


def test_a_preload_of_a_missing_library_does_not_break_importing_mlxft(tmp_path):
    # CPython's find_library("openblas") took the path in the loader's complaint about a missing
    # preloaded libopenblas for a library it found, and raised FileNotFoundError opening it:
    # `import mlxft`, and with it every command, failed (the FACTS.md preload on a machine without it).
    env = {**os.environ, "LD_PRELOAD": str(tmp_path / "libopenblas.so.0"), "MLXFT_CACHE": str(tmp_path)}
    env.pop("MLXFT_BLAS", None)
    proc = subprocess.run([sys.executable, "-c", "import mlxft._blas as b; print(b.loaded)"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
