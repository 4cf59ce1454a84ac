"""How the command line reports trouble: an error, or a warning of kvjax's own, is one line on
stderr, and what orbax's background reads leave behind after a failed read is not shown."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable


def fail(command: str, error: BaseException, code: int) -> int:
    message = " ".join(str(error).split())  # one line, whatever the message holds
    print(f"kvjax {command}: error: {message}", file=sys.stderr, flush=True)
    return code


def one_line_warnings(command: str, show: Callable) -> Callable:
    """A `warnings.showwarning` that prints a warning whose class kvjax defines (e.g.
    `kvjax.checkpoint.UnverifiedCheckpointWarning`) as one line, `kvjax sample: warning: ...`,
    and hands every other warning to `show`."""

    def show_warning(message, category, filename, lineno, file=None, line=None):
        if category.__module__.split(".")[0] != "kvjax":
            return show(message, category, filename, lineno, file, line)
        text = " ".join(str(message).split())
        print(f"kvjax {command}: warning: {text}", file=file or sys.stderr, flush=True)

    return show_warning


def _in_orbax(filename: str) -> bool:
    return any(f"{os.sep}{package}{os.sep}" in filename for package in ("orbax", "tensorstore"))


def quiet_orbax_leftovers(unraisable) -> None:
    """Drops what orbax's background reads print when they are garbage-collected after a
    failed read, whose error was already reported in one line: "Event loop is closed", and
    the same read error again from each pending coroutine. Anything else is shown."""
    error, source = unraisable.exc_value, unraisable.object
    code = getattr(source, "cr_code", None)
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
        return
    if code is not None and _in_orbax(code.co_filename):
        return
    sys.__unraisablehook__(unraisable)


def not_an_orbax_leftover(record: logging.LogRecord) -> bool:
    """A filter for the `asyncio` logger: False for its report of an orbax read whose
    exception no one retrieved ("... exception was never retrieved"), the same failed read
    that was already reported in one line; True for everything else. A read that tensorstore
    failed in native code carries no Python frames at all: no Python code raised it, so it is
    a leftover of that read too."""
    error = record.exc_info[1] if record.exc_info else None
    if error is None or "never retrieved" not in record.getMessage():
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and not any(_in_orbax(frame.filename) for frame in frames)
