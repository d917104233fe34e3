"""Stop requests from SIGINT / SIGTERM / SIGHUP: the first asks the loop to save and stop at
the next micro-batch boundary; a second one exits at once."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager


class Interrupted(Exception):
    """A stop request cut short a block run under :meth:`StopRequests.interrupting`."""


def _say(line: str) -> None:
    """One line to stderr from a signal handler (a closed terminal is no reason to fail)."""
    try:
        os.write(2, f"\n{line}\n".encode())
    except OSError:
        pass


class StopRequests:
    """Installs handlers for the lifetime of a ``with`` block (main thread only)."""

    # SIGHUP: the terminal closed (a dropped SSH session), which by default kills the run unsaved.
    SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

    def __init__(self):
        self.signum: int | None = None
        self._reason = ""
        self._previous: dict[int, object] = {}
        self._interrupt = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGTERM, reason: str = "") -> None:
        """Ask the loop to stop as a signal would (also usable from code and tests); ``reason``
        names the cause in messages instead of the signal."""
        self.signum, self._reason = signum, reason

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None and not self._reason:
            _say(f"{name} again: exiting at once; what was trained since the last checkpoint is not saved")
            os._exit(128 + signum)  # a second signal: the user wants out now
        self.signum, self._reason = signum, ""  # a signal after a request from code is the first
        # A save can take seconds: said at once, so a wait is not taken for a hang and answered
        # with the second signal, which loses the work.
        _say(f"{name}: stopping; a run saves what it has trained first ({name} again exits at once, unsaved)")
        if self._interrupt:
            self._interrupt = False
            raise Interrupted(self.name)

    @contextmanager
    def interrupting(self, enabled: bool = True):
        """Let a stop request (made already or arriving inside) end the block with
        :class:`Interrupted`: for work whose result is not worth waiting for, such as the
        validation before the final save. Elsewhere a request waits for the loop to see it."""
        if not enabled:
            yield
            return
        if self.requested:
            raise Interrupted(self.name)
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started under nohup: the user asked for the run to outlive the terminal
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        if self._reason:
            return self._reason
        return signal.Signals(self.signum).name if self.signum else "stop request"
