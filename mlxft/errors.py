"""User-facing errors: one clear line, exit code 2, traceback only with --debug."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable


class UserError(Exception):
    """A problem with the user's input (files, flags, config) that they can fix.

    The message is shown as a single line, so it must name the file, line or field
    at fault and what to do about it.
    """


EXIT_USER_ERROR = 2


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for quoting in a one-line error; its type's
    name when the message is empty (some library errors carry none)."""
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


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

    return wrapper
