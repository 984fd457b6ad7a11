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


def process_name(pid: int) -> str:
    """The name the launcher gave process ``pid`` ("rollout-0", "actor-rank1"; its ``AREAL_PROCESS_NAME``), or
    "" when it has none or has ended. Pid order says nothing about start order: pick processes by this name."""
    from areal_core.processes.supervisor import PROCESS_NAME_ENV

    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # it ended while we looked
        return ""
    prefix = PROCESS_NAME_ENV.encode() + b"="
    return next((v[len(prefix):].decode() for v in environ if v.startswith(prefix)), "")


def launched_pids(module: str, *markers: str) -> list[int]:
    """Pids of the real processes of ``python -m module`` (not the launcher's trampolines) whose command line
    holds one of ``markers`` as an argument (a model folder, a run folder), sorted by :func:`process_name`."""
    found = []
    for pid in processes_mentioning(module):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended while we looked
            continue
        if module.encode() in argv and not any(a.endswith(b"child.py") for a in argv) and \
                any(m.encode() in a for m in markers for a in argv):
            found.append(pid)
    return sorted(found, key=process_name)
