"""Stop requests from SIGINT / SIGTERM / SIGHUP: the first asks the loop to save and stop at
the next micro-batch boundary; a second one exits at once. Save requests from SIGUSR1: a
checkpoint after the current optimizer step, and training goes on."""

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


# Asks a training run for a checkpoint now (``kill -USR1 <pid>``); None where the system has none.
SAVE_SIGNAL = getattr(signal, "SIGUSR1", None)


def _nothing_to_save(signum=None, frame=None) -> None:
    _say("SIGUSR1: no training steps are running now, so there is nothing to save")


def hold_save_requests() -> None:
    """Keep SIGUSR1 from ending the process (its default) outside a training loop: a command
    line entry point calls this first, so a save request sent while the model loads is only
    answered, not fatal. Main thread only; a loop's :class:`StopRequests` takes it over."""
    if SAVE_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(SAVE_SIGNAL, _nothing_to_save)


def ignore_save_requests() -> None:
    """Ignore SIGUSR1 from here on, as a command line entry point ends: Python's shutdown puts
    a Python handler back to the system's default, which ends the process (exit code 138 after
    a run that had saved everything), but leaves an ignored signal ignored."""
    if SAVE_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(SAVE_SIGNAL, signal.SIG_IGN)


class StopRequests:
    """Installs handlers for the lifetime of a ``with`` block (main thread only)."""

    # SIGHUP: the terminal closed (a dropped SSH session), which by default kills the run unsaved.
    SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

    def __init__(self):
        self.signum: int | None = None
        self._reason = ""
        self._previous: dict[int, object] = {}
        self._interrupt = False
        self.save_requested = False
        self._taking_saves = False

    @property
    def handles_signals(self) -> bool:
        """Whether this ``with`` block installed the handlers (only the main thread can)."""
        return bool(self._previous)

    def request_save(self) -> None:
        """Ask the loop for a checkpoint after the current optimizer step, as SIGUSR1 does."""
        self.save_requested = True

    def _handle_save(self, signum, frame) -> None:
        if not self._taking_saves:
            _nothing_to_save()
            return
        self.save_requested = True
        _say("SIGUSR1: saving a checkpoint after the current step; training goes on")

    @contextmanager
    def taking_saves(self):
        """The block in which a save request is carried out (the training loop); a request
        arriving elsewhere is answered, not kept for later."""
        self._taking_saves = True
        try:
            yield
        finally:
            self._taking_saves, self.save_requested = False, False

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
            if SAVE_SIGNAL is not None:
                self._previous[SAVE_SIGNAL] = signal.signal(SAVE_SIGNAL, self._handle_save)
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
