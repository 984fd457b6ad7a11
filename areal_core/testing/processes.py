"""Helpers for tests that run real processes: find them by command line, read what they wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes (other than this one) whose command line contains ``text`` (Linux ``/proc``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(proc.name))
        except OSError:  # it ended while we looked
            continue
    return [pid for pid in pids if pid != os.getpid()]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict]:
    """The rows of a JSONL file; [] when it does not exist (yet)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
