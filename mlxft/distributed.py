"""Data-parallel training on MLX's own distributed engine (``mx.distributed``, ``mlx.launch``).

Each rank reads a disjoint, strided shard of every global batch; gradients, losses and
supervised-token counts are summed across ranks inside the compiled step, so an update
equals one process training on the whole global batch. Only rank 0 writes files.

MLX's collectives block forever when a peer is gone, and ``mlx.launch`` exits 0 even when a
rank fails. So the backend is initialised explicitly (``strict``), and a watchdog process
ends a rank with a clear message (and a non-zero exit) when start-up or training makes no
progress for ``timeout`` seconds: a peer crashed or cannot be reached. It pauses while a rank
does work that waits on no peer (loading, generating), which can take any time. While rank 0
saves, the others wait in collectives it answers between files (:meth:`World.main_rank_work`).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, TypeVar

import mlx.core as mx

from mlxft.errors import UserError, first_line

T = TypeVar("T")

# Environment variables each backend's launcher sets, in order of precedence.
_LAUNCH_ENV = (
    ("jaccl", ("MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR")),
    ("nccl", ("NCCL_HOST_IP",)),
    ("ring", ("MLX_HOSTFILE",)),
    ("mpi", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
)



def detect_backend(choice: str) -> str:
    """The backend to start: the configured one, or what the launcher's environment implies."""
    if choice != "auto":
        return choice
    for backend, names in _LAUNCH_ENV:
        if any(os.environ.get(n) for n in names):
            return backend
    return "none"


class PeerLost(Exception):
    """A collective failed because another rank went away (crashed, killed, unreachable)."""

    exit_code = 3


class World:
    """The process group this run trains in (a single process when not launched)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1
        self._watchdog: _Watchdog | None = None
        self._local_depth = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, tree):
        """Sum a tree of arrays over ranks (inside or outside a compiled function)."""
        if self.size == 1:
            return tree
        from mlx.utils import tree_map

        return tree_map(lambda x: mx.distributed.all_sum(x, group=self.group), tree)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank (e.g. a stop request)."""
        return self.any_each(flag)[0]

    def any_each(self, *flags: bool) -> tuple[bool, ...]:
        """:meth:`any` of each flag, in one collective."""
        if self.size == 1:
            return tuple(bool(flag) for flag in flags)
        totals = mx.distributed.all_sum(mx.array([1.0 if flag else 0.0 for flag in flags]), group=self.group)
        return tuple(total > 0 for total in totals.tolist())

    def main_rank_work(self, work: Callable[[Callable[[], None]], T]) -> T | None:
        """Run ``work(progress)`` on rank 0 while the other ranks wait for it (saving).

        Rank 0 calls ``progress()`` between pieces of the work. Each call is a collective that
        shows every rank that rank 0 is alive and restarts their watchdogs, so only a piece,
        not the whole save, has to fit in the timeout on the waiting ranks, and a rank lost
        meanwhile is still noticed. Rank 0's own watchdog runs only during those collectives:
        its pieces take as long as they take. When a collective fails (a peer went away), rank
        0 finishes the work alone and then raises that error. Every rank must call this at the
        same point. Returns ``work``'s result on rank 0 and None on the others."""
        if self.size == 1:
            return work(lambda: None)
        if not self.is_main:
            while self.any(False):
                self.heartbeat()
            return None
        lost: list[RuntimeError] = []

        def answer(busy: bool) -> None:
            if lost:
                return
            watching = self._local_depth > 0 and self._watchdog is not None
            if watching:  # a collective can hang on a lost peer: the watchdog times it
                self._watchdog.resume()
            try:
                self.any(busy)
            except RuntimeError as err:  # MLX's collectives raise this when a peer is gone
                lost.append(err)
            finally:
                if watching:
                    self._watchdog.pause()
            self.heartbeat()

        try:
            with self.local_work():
                result = work(lambda: answer(True))
        finally:
            answer(False)  # releases the others, also when the work failed
        if lost:
            raise lost[0]
        return result

    def shard(self, indices):
        """This rank's rows of a global batch: strided, so lengths stay balanced."""
        return indices[self.rank :: self.size]

    def heartbeat(self) -> None:
        if self._watchdog is not None:
            self._watchdog.beat()

    @contextmanager
    def local_work(self):
        """Work that waits on no other rank: no stretch of it can be a lost peer, however long.

        The watchdog's clock restarts when it ends, so a peer lost meanwhile is still noticed
        in the next collective."""
        self._local_depth += 1
        if self._local_depth == 1 and self._watchdog is not None:
            self._watchdog.pause()
        try:
            yield
        finally:
            self._local_depth -= 1
            if self._local_depth == 0 and self._watchdog is not None:
                self._watchdog.resume()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None


_WATCHDOG = r"""
import os, select, signal, sys
# Ctrl-C or a closed terminal signals the whole process group: the rank stops with a checkpoint,
# still guarded (a peer lost meanwhile), and this process ends when the rank closes the pipe.
# SIGUSR1 sent to the group asks the rank for a checkpoint, and would otherwise end this process.
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
fd, timeout, parent = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
messages = {b"i": sys.argv[4], b"p": sys.argv[5]}
phase, paused = b"i", False
while True:
    ready, _, _ = select.select([fd], [], [], None if paused else timeout)
    if not ready:
        sys.stderr.write(messages[phase] + "\n")
        sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        break
    data = os.read(fd, 4096)
    if not data:  # the parent closed the pipe: it finished or died
        break
    if b"p" in data:
        phase = b"p"
    last = max(data.rfind(b"z"), data.rfind(b"r"))  # the latest of pause (z) and resume (r) holds
    if last >= 0:
        paused = data[last:last + 1] == b"z"
"""


class _Watchdog:
    """A separate process that kills this one when no heartbeat arrives for ``timeout`` s.

    A thread cannot do this: MLX's blocking collectives and ``init`` may hold the GIL.
    """

    def __init__(self, rank: int, backend: str, timeout: float, parent: int | None = None):
        import subprocess

        read, self._write = os.pipe()
        starting = (f"error: rank {rank}: the '{backend}' backend could not reach its peers within {timeout:.0f} s "
                    "(check the hostfile, addresses and that every rank was started)")
        stalled = (f"error: rank {rank}: no progress for {timeout:.0f} s; another rank has probably failed or "
                   "cannot be reached (see its output); stopping")
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(read), str(timeout), str(parent or os.getpid()),
                                       starting, stalled], pass_fds=(read,))
        os.close(read)

    def _send(self, byte: bytes, wait: bool = False) -> None:
        """Write one byte; a beat may be dropped on a full pipe (which wakes the watchdog anyway),
        a pause or resume waits (briefly: the watchdog drains the pipe)."""
        os.set_blocking(self._write, wait)
        try:
            os.write(self._write, byte)
        except (BlockingIOError, BrokenPipeError):  # broken: the watchdog has ended
            pass

    def started(self) -> None:
        self._send(b"p")

    def beat(self) -> None:
        self._send(b".")

    def pause(self) -> None:
        self._send(b"z", wait=True)

    def resume(self) -> None:
        self._send(b"r", wait=True)

    def stop(self) -> None:
        os.close(self._write)
        self._proc.wait(timeout=10)


def init(backend: str = "auto", timeout: float = 600.0) -> World:
    """Start the distributed backend (strictly, under a deadline) or return a 1-process world."""
    backend = detect_backend(backend)
    if backend == "none":
        return World()
    if not mx.distributed.is_available(backend):
        raise UserError(f"the '{backend}' distributed backend is not available in this MLX build; "
                        "choose another with --backend or launch without mlx.launch")
    watchdog = _Watchdog(int(os.environ.get("MLX_RANK", "0")), backend, timeout)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as err:  # MLX raises RuntimeError subclasses with the reason
        watchdog.stop()
        raise UserError(f"cannot start the '{backend}' distributed backend: {first_line(err)}") from err
    watchdog.started()
    world = World(group)
    world._watchdog = watchdog
    return world
