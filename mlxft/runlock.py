"""One run at a time in an output directory.

Two runs started into the same ``--output-dir`` would both exit 0 while the second silently
replaced the first one's checkpoints and interleaved their metrics. Rank 0 of a run holds an
advisory lock on ``<output-dir>/.mlxft.lock`` from setting the directory up until training
ends; a second process asking for it is refused with the holder's pid. The lock belongs to
the open file, so a killed run releases it without leaving anything to clean up.

Within one process (a research script or notebook building a Trainer after another on the
same directory) the lock is shared: the process already owns the directory. A Trainer there
refuses, when it starts training, a directory where another has saved a run since it was built.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxft.errors import UserError

try:
    import fcntl
except ImportError:  # no flock (Windows): runs are not guarded
    fcntl = None

LOCK_FILE = ".mlxft.lock"

_held: dict[str, list] = {}  # resolved directory -> [file descriptor, users in this process]


class RunLock:
    """This process's hold on a run directory; :meth:`release` once, further calls do nothing."""

    def __init__(self, key: str):
        self.key = key
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        entry = _held.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.key]
            os.close(entry[0])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a holder that opened the file read-only left an older run's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def acquire(run_dir: Path, create: bool = True) -> RunLock | None:
    """Lock ``run_dir`` (which exists) for this process, or raise UserError naming the run
    that holds it. None where the platform or file system offers no lock, or where ``create``
    is False and no run has made the lock file (a directory that is not a run's stays as it is)."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        _held[key][1] += 1
        return RunLock(key)
    path = run_dir / LOCK_FILE
    if fcntl is None or not (create or path.is_file()):
        return None
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except PermissionError:  # another user's lock file in a shared directory: flock needs no write access
            if not path.is_file():
                raise
            fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise UserError(f"cannot update {run_dir}: {err.strerror or err}; make it writable or choose "
                        "another --output-dir") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        raise UserError(f"output directory {run_dir} is in use by another run"
                        + (f" (pid {owner})" if owner.isdigit() and _alive(int(owner)) else "")
                        + "; wait for it to finish or choose another --output-dir") from None
    except OSError:  # a file system without flock (some network mounts): run unguarded, as before
        os.close(fd)
        return None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the pid only makes the refusal clearer
    _held[key] = [fd, 1]
    return RunLock(key)
