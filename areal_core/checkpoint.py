"""Checkpoint folders that are either complete or absent, for exact resume.

A checkpoint is ``root/step-<step:08d>/``: whatever the train engine writes
(model, optimizer, data position) plus ``meta.json`` and, written last,
``manifest.json``: the size and SHA-256 of every other file in the folder.
The folder is assembled under a temporary sibling name (``*.tmp-<pid>``),
fsynced, then renamed into place; ``root/latest`` names the newest one and is
replaced with ``os.replace``. A process killed at any instant leaves either the
previous checkpoint or the new one, never a half-written folder under a final
name.

A checkpoint proves what it holds: :func:`verify` re-reads every file against
the manifest (a truncated file, flipped bytes, another step's weights copied
in, a file added or removed) and :meth:`CheckpointStore.resumable` picks the
newest checkpoint that verifies, saying why each newer one was passed over.
Resume loads nothing before that. The manifest guards against damage (a disk,
a copy, a hand), not against someone who may write the folder: they can
rewrite the manifest too. What a run reads back is data, never code: the
trainer's own state is JSON (:func:`save_json_atomic`), and nothing here
unpickles.

One process writes a store. With several ranks, one rank owns
:func:`atomic_dir` / :meth:`CheckpointStore.save` and the others write into
the temporary folder it hands them before ``write`` returns.

A save that cannot fit is refused before anything is written when the free
space is below the size of the previous checkpoint plus a margin; a disk that
fills up during the write (whatever the writer: ``torch.save`` reports it as
``unexpected pos``) ends in :class:`CheckpointSpaceError`, whose message
names the disk, what the checkpoint needs and the fix, and the partial
folder is removed as for any failed write.

Importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

META_NAME = "meta.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
CONTROLLER_FILE = "controller.json"  # the rollout controller's counters and done items (rank 0)
# Files areal adds to a checkpoint after its save and never loads at resume (``areal eval``'s scores): not in the
# manifest, and not counted as added by someone else.
NOTES = frozenset({"eval.json"})


def rng_file(rank: int) -> str:
    """The file of a train rank's random states in a checkpoint folder."""
    return f"rng-rank{rank}.json"


POINTER_NAME = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_MARK = ".tmp-"
# The precheck: free space must exceed the previous checkpoint's size by this fraction plus these bytes (the
# run's logs and metrics go on meanwhile, and the model's files vary a little in size).
SPACE_MARGIN_FRACTION = 0.10
SPACE_MARGIN_BYTES = 64 * 1024**2
# A write that failed while less than this was free failed for want of space, whatever the writer said.
FULL_BYTES = 4 * 1024**2
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> int:
    """fsync every file and folder under ``top``, then ``top`` itself; returns the files' total size."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                _fsync_path(path)
                total += path.stat().st_size
        _fsync_path(Path(dirpath))
    return total


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


def _replace_atomically(path: Path, dump: Callable[[Any], None], mode: str = "wb") -> None:
    """Write ``path`` through ``dump(file)`` into a temporary sibling, fsync, rename over it; on failure the
    temporary file goes and ``path`` is unchanged."""
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as f:
            dump(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)


def _write_text_atomic(path: Path, text: str) -> None:
    _replace_atomically(path, lambda f: f.write(text), "w")


# ------------------------------------------------------------------ disk space
class CheckpointSpaceError(OSError):
    """No room for a checkpoint: the message names the disk, what the checkpoint needs, what is free and the fix.

    ``errno`` is ENOSPC. ``began`` is False when the save was refused before
    anything was written, True when the disk filled up during the write.
    """

    def __init__(self, message: str, *, path: Path, needed: int | None, free: int | None, began: bool) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message, self.path, self.needed, self.free, self.began = message, path, needed, free, began

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Any:  # pickled with its keywords (OSError's default drops them)
        return (_rebuild_space_error, (self.message, self.path, self.needed, self.free, self.began))


def _rebuild_space_error(message: str, path: Path, needed: int | None, free: int | None,
                         began: bool) -> CheckpointSpaceError:
    return CheckpointSpaceError(message, path=path, needed=needed, free=free, began=began)


def tree_bytes(top: str | os.PathLike[str]) -> int:
    """The total size of the files under ``top`` (0 when it does not exist)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free to this user on the filesystem holding ``path`` (its nearest existing folder); None if unknown."""
    try:
        return shutil.disk_usage(_existing(Path(path))).free
    except OSError:
        return None


def describe_disk(path: str | os.PathLike[str]) -> str:
    """``the filesystem mounted at /data (ext4)``: the filesystem holding ``path``, as ``df`` would name it."""
    mount = _existing(Path(path))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    kind = ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[1].replace("\\040", " ") == str(mount):
                    kind = fields[2]  # the last entry for a mount point is the one in effect
    except OSError:
        pass
    return f"the filesystem mounted at {mount}" + (f" ({kind})" if kind else "")


def human_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def needed_with_margin(expected: int) -> int:
    """The free space a save expected to take ``expected`` bytes asks for before it starts."""
    return int(expected * (1 + SPACE_MARGIN_FRACTION)) + SPACE_MARGIN_BYTES


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank errors a torch.distributed.checkpoint error holds."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        link = todo.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        todo += [link.__cause__, link.__context__, *_rank_failures(link)]


def _rank_failures(exc: BaseException) -> list[BaseException]:
    """The errors of a torch.distributed.checkpoint ``CheckpointException``: ``failures`` maps each rank to
    its exception, or to (exception, stack)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    found = [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return [f for f in found if isinstance(f, BaseException)]


def is_disk_full(exc: BaseException, path: str | os.PathLike[str]) -> bool:
    """Whether ``exc``, raised while writing under ``path``, means that its filesystem had no room.

    True for ENOSPC / EDQUOT anywhere in the exception's chain, for writers
    that only say so in words (safetensors: ``No space left on device (os
    error 28)``), and for any failure while less than :data:`FULL_BYTES` are
    free there: ``torch.save`` on a full disk says only ``[enforce fail at
    inline_container.cc] unexpected pos``. Call it before the partial files
    are removed.
    """
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in _FULL_ERRNOS:
            return True
        if any(text in str(link) for text in _FULL_TEXTS):
            return True
    free = free_bytes(path)
    return free is not None and free < FULL_BYTES


def _first_line(exc: BaseException) -> str:
    exc = next(iter(_rank_failures(exc)), exc)  # torch.distributed.checkpoint: the first rank's own error
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def space_error_during_write(exc: BaseException, folder: str | os.PathLike[str], what: str,
                             expected: int | None = None, expected_from: str = "", outcome: str = "",
                             measure: bool = True) -> CheckpointSpaceError:
    """The :class:`CheckpointSpaceError` for a write of ``what`` into ``folder`` that :func:`is_disk_full`
    says failed for want of space. ``measure``: say how much of it was written (measure before the partial
    files go). ``expected``: the size of ``expected_from``, the previous checkpoint. ``outcome`` says what
    is left, as a sentence."""
    folder = Path(folder)
    written = tree_bytes(folder) if measure else 0
    free = free_bytes(folder) or 0
    done = f" after {human_bytes(written)} of it were written" if written else ""
    need = ""
    if measure:  # what it had, written and free: it needs more
        need = f"; it needs more than the {human_bytes(written + free)} that were free when it began"
        if expected:
            need += f" ({expected_from} took {human_bytes(expected)})"
    message = (f"no space left for {what} in {folder.parent}: {describe_disk(folder)} ran out of space{done} "
               f"({human_bytes(free)} free now){need}. {outcome}Fix: free space there, or set output_dir to a "
               f"folder on a disk with room (the writer said: {_first_line(exc)})")
    return CheckpointSpaceError(message, path=folder, needed=expected, free=free, began=True)


@contextlib.contextmanager
def reporting_full_disk(folder: str | os.PathLike[str], what: str, expected: int | None = None,
                        expected_from: str = "", outcome: str = "") -> Iterator[None]:
    """Turn a write into ``folder`` that fails for want of space into :class:`CheckpointSpaceError`.

    For a rank that writes its share of a checkpoint into the folder another
    rank's :meth:`CheckpointStore.save` handed it. Other errors pass as they are.
    """
    try:
        yield
    except CheckpointSpaceError:
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is no Exception
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)) or not is_disk_full(exc, folder):
            raise
        raise space_error_during_write(exc, folder, what, expected, expected_from, outcome) from exc


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ integrity
class CheckpointDamagedError(RuntimeError):
    """No checkpoint of the run verifies against its manifest: the message names each one and what is wrong."""


def _files_under(folder: Path) -> list[str]:
    """The regular files under ``folder`` as sorted POSIX paths relative to it, the manifest left out."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(folder):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel != MANIFEST_NAME:
                found.append(rel)
    return sorted(found)


def file_sha256(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Record the size and SHA-256 of every file under ``folder`` in ``folder/manifest.json`` (atomically).

    Symbolic links are refused: a checkpoint holds its own bytes, and a link could name any file."""
    folder = Path(folder)
    files = {}
    for rel in _files_under(folder):
        path = folder / rel
        if path.is_symlink():
            raise ValueError(f"checkpoint folder {folder} holds a symbolic link, {rel}: a checkpoint must hold its "
                             f"own files")
        files[rel] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
    _write_text_atomic(folder / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def verify(folder: str | os.PathLike[str]) -> list[str]:
    """What is wrong with checkpoint ``folder`` against its manifest, one sentence per file; [] when it verifies.

    Sizes are compared before any digest is computed, so a truncated file is named without reading the rest."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("unknown manifest layout")
    except FileNotFoundError:
        return [f"it has no {MANIFEST_NAME} (the save writes it last; a copy may have left it out, and areal "
                f"before it had none), so what it holds cannot be checked"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"its {MANIFEST_NAME} cannot be read ({type(exc).__name__}: {exc})"]
    problems = []
    present = set(_files_under(folder))
    for rel in sorted(set(files) - present):
        problems.append(f"{rel} is missing")
    for rel in sorted(present - set(files) - NOTES):
        problems.append(f"{rel} is not in the manifest (a file added after the save)")
    present -= NOTES - set(files)
    listed = sorted(set(files) & present)
    for rel in listed:
        path = folder / rel
        if path.is_symlink():
            problems.append(f"{rel} is a symbolic link, not the file that was saved")
            continue
        size, want = path.stat().st_size, files[rel].get("bytes")
        if size != want:
            problems.append(f"{rel} has {size} bytes, the manifest {want} (truncated or replaced)")
    if problems:
        return problems
    for rel in listed:
        try:
            digest = file_sha256(folder / rel)
        except OSError as exc:
            problems.append(f"{rel} cannot be read ({exc.strerror or exc})")
            continue
        if digest != files[rel].get("sha256"):
            problems.append(f"{rel} does not hold what was saved (its SHA-256 differs from the manifest's)")
    return problems


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
        ``meta.json`` inside it and the digest of every file to
        ``manifest.json``, the folder is renamed to ``root/step-<step:08d>``
        (replacing one already there) and ``root/latest`` is replaced to name
        it. If ``write`` raises, nothing under a final name changes.

        Raises :class:`CheckpointSpaceError` before anything is written when
        the free space is below the previous checkpoint's size plus a margin,
        and in place of the writer's error when the disk fills up meanwhile.
        """
        final = self.path_for(step)
        record = {"step": step, **meta}
        text = json.dumps(record, indent=2, sort_keys=True)
        what = f"the checkpoint of step {step}"
        previous = self.latest()
        expected, expected_from = self._expected_bytes(previous)
        kept = (f"the checkpoint of step {self._step_of(previous)} is still the latest. " if previous is not None
                else "no checkpoint of this run is complete yet. ")
        self._check_space(what, expected, expected_from, kept)
        try:
            with atomic_dir(final) as tmp:
                with reporting_full_disk(tmp, what, expected, expected_from,
                                         outcome=f"The partial checkpoint was removed; {kept}"):
                    write(tmp)
                    (tmp / META_NAME).write_text(text, encoding="utf-8")
                    write_manifest(tmp)
                    size = _fsync_tree(tmp)  # in here, where a full disk is still measured
        except OSError as exc:  # the rename (a folder that must grow on a full disk)
            if isinstance(exc, CheckpointSpaceError) or exc.errno not in _FULL_ERRNOS:
                raise
            raise space_error_during_write(exc, final, what, expected, expected_from,
                                           f"Nothing of it was kept; {kept}", measure=False) from exc
        self._last_bytes = (step, size)
        try:
            self._write_pointer(final.name)
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            raise space_error_during_write(
                exc, self.root / POINTER_NAME, f"the pointer to {final.name}", expected, expected_from,
                f"{final} is complete, but {kept}", measure=False) from exc
        return final

    _last_bytes: tuple[int, int] | None = None  # (step, size) of the checkpoint this process saved last

    @staticmethod
    def _step_of(path: Path) -> int:
        m = _STEP_DIR.match(path.name)
        return int(m.group(1)) if m else -1

    def _expected_bytes(self, previous: Path | None) -> tuple[int | None, str]:
        """The size the next checkpoint will likely take: the previous one's; None before the first."""
        if previous is None:
            return None, ""
        step = self._step_of(previous)
        if self._last_bytes is not None and self._last_bytes[0] == step:
            size = self._last_bytes[1]
        else:
            size = tree_bytes(previous)
        return (size or None), f"the checkpoint of step {step}"

    def _check_space(self, what: str, expected: int | None, expected_from: str, kept: str) -> None:
        """Refuse a save that cannot fit, before anything is written."""
        if not expected:
            return
        free, needed = free_bytes(self.root), needed_with_margin(expected)
        if free is None or free >= needed:
            return
        margin = needed - expected
        raise CheckpointSpaceError(
            f"no room for {what} in {self.root}: it needs about {human_bytes(expected)} (as much as {expected_from}) "
            f"plus a margin of {human_bytes(margin)}, and {describe_disk(self.root)} has {human_bytes(free)} free. "
            f"Nothing was written; {kept}Fix: free at least {human_bytes(needed - free)} there, or set "
            f"output_dir to a folder on a disk with room",
            path=self.root, needed=needed, free=free, began=False)

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

    def resumable(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that verifies against its manifest, and a sentence for each newer one passed over.

        (None, []) when there is no complete checkpoint. Raises
        :class:`CheckpointDamagedError`, naming every checkpoint and what is
        wrong with it, when none verifies: nothing of a damaged checkpoint is
        ever loaded, and starting over would silently discard the run."""
        latest = self.latest()
        candidates = [path for _, path in reversed(self._complete())]
        if latest is not None and latest in candidates:  # the pointer's choice first, then by step
            candidates.remove(latest)
            candidates.insert(0, latest)
        passed = []
        for path in candidates:
            problems = verify(path)
            if not problems:
                return path, passed
            passed.append(f"{path} does not verify: {'; '.join(problems[:3])}"
                          f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}")
        if not passed:
            return None, []
        raise CheckpointDamagedError(
            f"no checkpoint under {self.root} verifies, so none is loaded: {' | '.join(passed)}. Fix: restore the "
            f"folder from a copy, or start the run afresh in another folder (trial=<name>); what a checkpoint holds "
            f"is checked against its {MANIFEST_NAME}, written last by the save")

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


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def rng_state() -> dict[str, Any]:
    """Global RNG states as a dict that JSON holds as it is (lists, numbers, base64 text).

    Python's ``random`` always; numpy's global generator when numpy is
    importable; torch's CPU generator when torch is already imported (an
    unimported torch has consumed no randomness), and every CUDA device's when
    CUDA is initialised. Torch states are stored as base64 text of their bytes,
    so loading the dict needs no torch.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = _b64(torch.get_rng_state().numpy().tobytes())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (as read back from JSON); parts not captured are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    if "torch" in state or "torch_cuda" in state:
        import torch

        def tensor(text: str) -> Any:
            return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()

        if "torch" in state:
            torch.set_rng_state(tensor(state["torch"]))
        if "torch_cuda" in state and torch.cuda.is_available():
            saved = state["torch_cuda"]
            for device in range(min(len(saved), torch.cuda.device_count())):
                torch.cuda.set_rng_state(tensor(saved[device]), device)


def save_json_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` as JSON to ``path``: to a temporary file, fsynced, then ``os.replace``d.

    The trainer's own checkpoint state goes this way, never pickle: a checkpoint is data that may come from
    someone else, and unpickling runs whatever code the file names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, allow_nan=True)
    _write_text_atomic(path, text + "\n")


def load_json(path: str | os.PathLike[str]) -> Any:
    """Read what :func:`save_json_atomic` wrote."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
