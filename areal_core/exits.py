"""Ending a process of a torch.distributed group without the interpreter's finalization.

Seen on this project's CPU test machine (torch 2.13, gloo): a rank that had done its work, passed a barrier with
the others and destroyed its process group was killed by SIGABRT at exit, "terminate called without an active
exception", twice in two runs of the default suite, in a different 2- or 4-rank test each time. That message is a
C++ thread object destroyed while still joinable; at exit that happens in static destructors and in Python's
finalization, which tear the distributed runtime's objects down in no particular order. A launcher reads the
abort as a failed rank, so a finished run would be reported as failed.

:func:`exit_now` runs what an ordinary exit runs first (the ``atexit`` functions: loggers, trackers, shared
memory cleanup), flushes the standard streams, then ends the process with ``os._exit``: no finalization, no
static destructors. Call it only when the process's work is done and its results are written.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_now(code: int) -> None:
    """End this process with ``code`` now, after the ``atexit`` functions and a flush of stdout and stderr."""
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at an ordinary exit, before its finalization
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its pipe gone
                pass
        os._exit(code)
