"""Ctrl-C and SIGTERM in the `kvrewrite` command: one line, `error: interrupted; nothing was written`, exit 130.

While the command's modules import, nothing has been written, so a signal exits at once with that line. Once the
command runs, a signal raises Interrupted: a BaseException that is not a KeyboardInterrupt, so click does not turn
it into "Aborted!", while every atomic writer (io/checkpoint_io.py, io/atomic_files.py) still deletes its temporary
files on the way out; cli/app.py's main() then prints the line. This module imports nothing heavy: kvrewrite's
__init__ installs the import-time handler before it imports torch and transformers.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED_MESSAGE = "error: interrupted; nothing was written"
EXIT_INTERRUPTED = 130
CONSOLE_SCRIPT = "kvrewrite"


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while a command ran (raised by the handler, caught by cli/app.py's main)."""


def _exit_now(signum, frame) -> None:
    sys.stderr.write(INTERRUPTED_MESSAGE + "\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def started_as_console_script() -> bool:
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == CONSOLE_SCRIPT


def exit_while_importing() -> None:
    """Until unwind_while_running(): a signal prints the line and exits (no traceback from inside an import)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_now)


def unwind_while_running() -> None:
    """A signal raises Interrupted, so what is being written is cleaned up before the line is printed."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupted)
