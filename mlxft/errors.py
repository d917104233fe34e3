"""User-facing errors: one clear line, exit code 2, traceback only with --debug."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from typing import Callable


class UserError(Exception):
    """A problem with the user's input (files, flags, config) that they can fix.

    The message is shown as a single line, so it must name the file, line or field
    at fault and what to do about it.
    """


EXIT_USER_ERROR = 2


class CliParser(argparse.ArgumentParser):
    """The parser of every mlxft command line."""

    def error(self, message: str):
        # The house one-line error, not argparse's usage block (train's lists ~50 options).
        self.exit(EXIT_USER_ERROR, f"error: {message} ({self.prog} --help lists the options)\n")


def print_error(message: str) -> None:
    """Print to standard error, quietly dropping the line when that stream is gone (a terminal
    that hung up): the message is never worth a traceback of its own."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # AttributeError: sys.stderr is None (fd 2 closed)
        pass


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for quoting in a one-line error; its type's
    name when the message is empty (some library errors carry none). A first line that ends in
    a colon announces the next one, which joins it: cut there, it would say nothing."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text, rest = lines[0], lines[1:]
    while text.endswith(":") and rest:
        text = f"{text} {rest.pop(0)}"
    return text


def run_cli(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main(argv)`` so user errors print one line and exit with code 2.

    ``--debug`` anywhere in argv re-raises with the full traceback instead.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in args
        try:
            return int(main(args) or 0)
        except UserError as err:
            if debug:
                traceback.print_exc()
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USER_ERROR
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except MemoryError as err:  # NumPy's, for a batch no machine holds (MLX's are reported where they happen)
            if debug:
                traceback.print_exc()
            print(f"error: out of memory ({first_line(err)}); lower --batch-size or --max-seq-length",
                  file=sys.stderr)
            return EXIT_USER_ERROR
        except BrokenPipeError:  # the reader of standard output went away (``| head``)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exiting flushes nowhere, quietly
            print("error: standard output was closed; stopping", file=sys.stderr)
            return 1

    return wrapper
