"""Command-line runs in the tests start as on a user's machine, where torch is not installed.

The test extras install torch for the PEFT round-trip tests, and transformers imports it
whenever it is installed (2.6 s of every ``python -m mlxft...`` start, on a suite that starts
dozens). mlxft never uses torch, so conftest puts this directory on PYTHONPATH for the
subprocesses it starts and this hides torch from the import system there."""

import os.path
import sys


class _WithoutTorch:
    """Wraps a path finder so that torch and its submodules are not found."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_WithoutTorch(f) if getattr(f, "__name__", "") == "PathFinder" else f for f in sys.meta_path]

# This module shadows any other sitecustomize (a distribution's, a coverage hook's): run that one too.
for _entry in sys.path:
    _other = os.path.join(_entry, "sitecustomize.py")
    if os.path.isfile(_other) and not os.path.samefile(_other, __file__):
        exec(compile(open(_other).read(), _other, "exec"), {"__name__": "sitecustomize", "__file__": _other})
        break
