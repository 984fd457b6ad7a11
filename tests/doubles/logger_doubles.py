"""Metrics logger test doubles (entry-point group ``areal.loggers``), each failing one way a real tracker does.
Installed as a fake distribution by ``tests/test_loggers.py``; never shipped."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from areal_core.metrics import SinkError


class RecordingSinkDouble:
    """Appends ``{"step", "metrics", "resume_step", "experiment"}`` lines to ``<run_dir>/recorded.jsonl``."""

    def __init__(self, run_dir, resume_step=None, config=None):
        self.path = Path(run_dir) / "recorded.jsonl"
        self.resume_step, self.experiment = resume_step, (config or {}).get("experiment")

    def write(self, step, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "metrics": metrics, "resume_step": self.resume_step,
                                "experiment": self.experiment}) + "\n")

    def close(self):
        pass


class DiskFullSinkDouble:
    """Writes step 1, then meets a full disk (the kernel's ENOSPC) from step 2 on; counts its writes in
    ``<run_dir>/disk_full_writes``."""

    def __init__(self, run_dir, resume_step=None, config=None):
        self.counter = Path(run_dir) / "disk_full_writes"
        self.counter.write_text("0")

    def write(self, step, metrics):
        self.counter.write_text(str(int(self.counter.read_text()) + 1))
        if step >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", "tracker-cache/events.bin")

    def close(self):
        pass

    def __repr__(self):
        return "DiskFullSinkDouble()"


class BadCredentialsSinkDouble:
    """Refused at the start, as a tracker refuses a wrong API key."""

    def __init__(self, run_dir, resume_step=None, config=None):
        raise SinkError("the tracker refused the API key 'abc…' (401 Unauthorized)",
                        "set TRACKER_API_KEY to a valid key, or leave bad_credentials_double out of metrics.loggers")


class MissingLibrarySinkDouble:
    """Needs a library that is not installed."""

    def __init__(self, run_dir, resume_step=None, config=None):
        import areal_test_tracker_library_that_is_not_installed  # noqa: F401
