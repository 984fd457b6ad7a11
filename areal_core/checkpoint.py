"""Checkpoint folders that are either complete or absent, for exact resume.

A checkpoint is ``root/step-<step:08d>/``: whatever the train engine writes
(model, optimizer, data position) plus ``meta.json``, written last. The folder
is assembled under a temporary sibling name (``*.tmp-<pid>``), fsynced, then
renamed into place; ``root/latest`` names the newest one and is replaced with
``os.replace``. A process killed at any instant leaves either the previous
checkpoint or the new one, never a half-written folder under a final name.

One process writes a store. With several ranks, one rank owns
:func:`atomic_dir` / :meth:`CheckpointStore.save` and the others write into
the temporary folder it hands them before ``write`` returns.

Importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

META_NAME = "meta.json"
POINTER_NAME = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_MARK = ".tmp-"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file and folder under ``top``, then ``top`` itself."""
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                _fsync_path(path)
        _fsync_path(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``final``; on success it becomes ``final``.

    The temporary folder is ``final.name + ".tmp-<pid>"``. On a clean exit its
    files are fsynced and it is renamed to ``final``; an existing ``final`` is
    replaced (old renamed aside under a ``.tmp-`` name, new renamed in, old
    deleted; a kill between those two renames leaves neither under ``final``,
    and :meth:`CheckpointStore.latest` falls back to the step before). On an exception the temporary folder is removed, any previous
    ``final`` is untouched, and the exception propagates.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    tmp = final.with_name(f"{final.name}{_TMP_MARK}{pid}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f"{final.name}{_TMP_MARK}old-{pid}")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        _fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
        _fsync_path(final.parent)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointStore:
    """Numbered checkpoint folders under ``root`` (usually ``run_dir / "checkpoints"``)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def save(self, step: int, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` and make it the latest; returns its folder.

        ``write(tmp_dir)`` writes the model / optimizer / data files into a
        temporary folder; then ``meta`` (plus ``"step"`` unless given) goes to
        ``meta.json`` inside it, the folder is renamed to ``root/step-<step:08d>``
        (replacing one already there) and ``root/latest`` is replaced to name
        it. If ``write`` raises, nothing under a final name changes.
        """
        final = self.path_for(step)
        record = {"step": step, **meta}
        text = json.dumps(record, indent=2, sort_keys=True)
        with atomic_dir(final) as tmp:
            write(tmp)
            (tmp / META_NAME).write_text(text, encoding="utf-8")
        self._write_pointer(final.name)
        return final

    def _write_pointer(self, name: str) -> None:
        _write_text_atomic(self.root / POINTER_NAME, name + "\n")

    def _complete(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint folder, oldest step first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / META_NAME).is_file():
                found.append((int(m.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        """The checkpoint to resume from, or None when there is none.

        The folder ``root/latest`` names, if it exists and has ``meta.json``;
        otherwise (pointer missing, unreadable, or naming a broken folder) the
        complete folder with the highest step. Temporary folders never count.
        """
        try:
            name = (self.root / POINTER_NAME).read_text(encoding="utf-8").strip()
        except OSError:
            name = ""
        if _STEP_DIR.match(name) and (self.root / name / META_NAME).is_file():
            return self.root / name
        complete = self._complete()
        return complete[-1][1] if complete else None

    def load_meta(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The ``meta.json`` of checkpoint folder ``path``."""
        return json.loads((Path(path) / META_NAME).read_text(encoding="utf-8"))

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` complete checkpoints, never the latest.

        A folder is renamed to a temporary name before it is deleted, so a kill
        mid-delete never leaves a partial folder under a final name. Leftover
        temporary folders of processes no longer alive on this host go too.
        """
        if keep < 0:
            raise ValueError(f"prune(keep={keep}): keep must be >= 0")
        latest = self.latest()
        complete = [path for _, path in self._complete()]
        doomed = complete[: max(len(complete) - keep, 0)]
        pid = os.getpid()
        for path in doomed:
            if path == latest:
                continue
            aside = path.with_name(f"{path.name}{_TMP_MARK}del-{pid}")
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            _, mark, tail = child.name.rpartition(_TMP_MARK)
            if not mark:
                continue
            digits = tail.rpartition("-")[2]
            if digits.isdigit() and int(digits) != os.getpid() and not pid_alive(int(digits)):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """Global RNG states as a picklable dict of plain Python objects.

    Python's ``random`` always; numpy's global generator when numpy is
    importable; torch's CPU generator when torch is already imported (an
    unimported torch has consumed no randomness), and every CUDA device's when
    CUDA is initialised. Torch states are stored as bytes, so loading the dict
    needs no torch.
    """
    state: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy().tobytes()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured; parts not captured are left alone."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state or "torch_cuda" in state:
        import torch

        def tensor(raw: bytes) -> Any:
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

        if "torch" in state:
            torch.set_rng_state(tensor(state["torch"]))
        if "torch_cuda" in state and torch.cuda.is_available():
            saved = state["torch_cuda"]
            for device in range(min(len(saved), torch.cuda.device_count())):
                torch.cuda.set_rng_state(tensor(saved[device]), device)


def save_pickle_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """Pickle ``obj`` to ``path``: written to a temporary file, fsynced, then ``os.replace``d."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)


def load_pickle(path: str | os.PathLike[str]) -> Any:
    """Load what :func:`save_pickle_atomic` wrote (only load files this run wrote: it is pickle)."""
    with open(path, "rb") as f:
        return pickle.load(f)
