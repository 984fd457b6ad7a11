"""Weights for the embedded server through one safetensors file in ``/dev/shm``, rewritten in place per version.

The writer (:class:`WeightStage`, the client's side)
-----------------------------------------------------
``update_weights_from_tensors`` used to write each version to a fresh temporary
folder in ``/dev/shm`` with ``safetensors.torch.save_file`` and delete it after
the server had loaded it. Each version then paid for new shared-memory pages
(allocated and zeroed by the kernel, 270 MB for SmolLM2-135M in bf16) and for
``save_file``'s intermediate byte copies: 0.6 s per version on the 2-core test
machine, on the critical path of a synchronous run. Here the file is created
once and every later version with the same layout is copied straight into its
mapped pages (``torch`` copies), so the pages are already resident on both
sides.

The file is a plain safetensors file (8-byte little-endian header length, JSON
header, tensor bytes back to back, no holes) that any safetensors reader
takes. safetensors has no call that serialises into an existing buffer, hence
the short writer below. Tensors are laid out widest dtype first so every
tensor starts at an offset divisible by its element size (the JSON header is
padded to 8 bytes), which a ``uint8 -> dtype`` view needs. The header's
``__metadata__`` carries the version (``areal_version``, fixed width, so the
layout never moves between versions), and a write zeroes the header length
first and puts the header back last: a file whose write failed half way reads
as incomplete and is refused, and a file still holding another version than
the one the server is asked to load is refused too (:class:`MappedWeights`).

The reader (:class:`MappedWeights`, the server's side)
-------------------------------------------------------
``safetensors.torch.load_file`` maps each tensor afresh at every load, so the
copy into the model page-faulted the whole file in again each version (0.2 to
0.3 s of a 0.5 s load of SmolLM2-135M in float32 on the test machine, against
0.05 s for the copy itself). The server keeps the stage file mapped between
versions (same inode, same size: same pages) and hands out tensors that are
views of the mapping, which the generator copies straight into its parameters:
one copy, no intermediate tensors. Any other safetensors file (a ``disk``
update's folder) is mapped the same way for one load, then let go.

The server must not read a version while the next one is written: the
rollout controller awaits every engine's update before the trainer sends the
next version, so versions never overlap.

A file left by a process that died (SIGKILL skips every cleanup) is removed
by the next stage created on this machine: names carry the owner's pid.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from areal_core.checkpoint import pid_alive

FILE_NAME = "model.safetensors"
PREFIX = "areal-weights-"
VERSION_KEY = "areal_version"  # in the header's __metadata__: the version the file holds

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def _root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove stage folders whose owning process is gone; returns what was removed."""
    removed = []
    for folder in (root or _root()).glob(f"{PREFIX}*"):
        match = re.fullmatch(rf"{PREFIX}(\d+)-.*", folder.name)
        if match and folder.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _version_field(version: int) -> str:
    return f"{version:020d}"  # fixed width: the header, hence every offset, is the same for every version


def _layout(named: list[tuple[str, torch.Tensor]],
            version: int) -> tuple[bytes, list[tuple[int, torch.Tensor]], int]:
    """(header block incl. its length prefix, [(offset in file, tensor)], file size)."""
    for name, tensor in named:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
    ordered = sorted(named, key=lambda pair: -pair[1].element_size())  # widest first: every offset aligned
    header: dict[str, Any] = {"__metadata__": {VERSION_KEY: _version_field(version)}}
    at = 0
    for name, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [at, at + size]}
        at += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    placed = [(len(head) + header[name]["data_offsets"][0], tensor) for name, tensor in ordered]
    return head, placed, len(head) + at


class WeightStage:
    """The staging file of one process (shared by every local engine client in it)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or _root()
        self.folder: Path | None = None
        self._map: mmap.mmap | None = None
        self._size = 0
        self._staged: tuple[Any, int] | None = None  # (the tensors object, version) last written
        self._finalizer: Any = None

    def _open(self, size: int) -> None:
        self.close()
        sweep_stale(self.root)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root))
        path = self.folder / FILE_NAME
        with open(path, "w+b") as f:
            f.truncate(size)
            self._map = mmap.mmap(f.fileno(), size)
        self._size = size
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    def write(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> Path:
        """Put ``named_tensors`` in the file (once per tensors object and version); returns its folder."""
        if self._staged is not None and self._staged[0] is named_tensors and self._staged[1] == version:
            assert self.folder is not None
            return self.folder  # another engine of this process takes the same version: written already
        named = [(name, t.detach().cpu()) for name, t in named_tensors]  # .cpu() is a no-op for CPU tensors
        head, placed, size = _layout(named, version)
        if size != self._size or self._map is None:
            self._open(size)
        assert self._map is not None and self.folder is not None
        # A write that fails half way must not be taken for a whole one, here or by a reader: the header length
        # is zeroed first (the file reads as incomplete) and the header, with its version, goes in last.
        self._staged = None
        self._map[:8] = bytes(8)
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        for offset, tensor in placed:
            nbytes = tensor.numel() * tensor.element_size()
            buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        del buffer  # no export of the map may outlive this call (mmap.close refuses while one exists)
        self._map[8:len(head)] = head[8:]
        self._map[:8] = head[:8]
        self._staged = (named_tensors, version)
        return self.folder

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._finalizer is not None:
            self._finalizer()  # removes the folder
            self._finalizer = None
        self.folder, self._size, self._staged = None, 0, None


_STAGES: dict[Path | None, WeightStage] = {}


def stage(root: Path | None = None) -> WeightStage:
    """This process's stage under ``root`` (default: /dev/shm), created on first use. Engines whose servers
    share this node use the default; those on other nodes one under the run's shared storage."""
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    if root not in _STAGES:
        _STAGES[root] = WeightStage(root)
    return _STAGES[root]


class IncompleteWeights(ValueError):
    """A weights file that cannot be loaded whole: half written, truncated, or holding another version."""


class MappedWeights:
    """Safetensors files mapped read-only, their tensors handed out as views of the mapping (the server's side).

    A stage file (one whose header carries ``areal_version``) stays mapped until a file of another identity is
    read, so the next version, written in place into the same pages, costs no page faults; any other file is
    mapped for one :meth:`tensors` call. Little-endian only, like every platform areal runs on.
    """

    def __init__(self) -> None:
        self._kept: tuple[tuple[int, int, int, str], mmap.mmap, torch.Tensor] | None = None  # (identity, map, bytes)

    def tensors(self, file: str | Path, version: int | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of ``file``, viewing the mapped file (valid until the file changes: copy them now).

        Checked whole before anything is handed out: a file whose header length is zero (a stage write that
        failed half way), a header that does not parse, a tensor whose bytes lie past the end, or a stage file
        holding another version than ``version`` is refused with :class:`IncompleteWeights` naming it; a
        dtype this reader does not know is read by ``safetensors`` itself (a copy)."""
        file = Path(file)
        with open(file, "rb") as f:
            st = os.fstat(f.fileno())
            identity = (st.st_dev, st.st_ino, st.st_size, str(file))
            if self._kept is not None and self._kept[0] == identity:
                _, mapped, data = self._kept
            else:
                self._kept = None  # a stage file replaced (a new layout) or another file: the old map goes
                if st.st_size < 8:
                    raise IncompleteWeights(f"{file}: {st.st_size} bytes, too short for a safetensors file")
                mapped = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
                with warnings.catch_warnings():  # read only; torch warns that a tensor could write to it
                    warnings.simplefilter("ignore", UserWarning)
                    data = torch.frombuffer(mapped, dtype=torch.uint8)
        header, start = _read_header(file, data)
        metadata = header.pop("__metadata__", None) or {}
        held = metadata.get(VERSION_KEY)
        if held is not None:
            if version is not None and int(held) != version:
                raise IncompleteWeights(f"{file} holds version {int(held)}, not the version {version} asked for "
                                        "(a stage write that never finished, or a stale file)")
            self._kept = (identity, mapped, data)
        if any(entry.get("dtype") not in _TORCH_DTYPES for entry in header.values()):
            from safetensors.torch import load_file

            return load_file(str(file))
        out = {}
        for name, entry in header.items():
            out[name] = _view(file, name, entry, data, start)
        return out

    def close(self) -> None:
        self._kept = None


def _read_header(file: Path, data: torch.Tensor) -> tuple[dict, int]:
    """The JSON header of a mapped safetensors file and where its tensor bytes start."""
    length = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if length == 0:
        raise IncompleteWeights(f"{file}: the header length is 0: a stage write that never finished")
    if 8 + length > data.numel():
        raise IncompleteWeights(f"{file}: a header of {length} bytes does not fit in {data.numel()} bytes")
    try:
        header = json.loads(data[8:8 + length].numpy().tobytes())
    except ValueError as exc:
        raise IncompleteWeights(f"{file}: the header does not parse ({exc})") from None
    if not isinstance(header, dict):
        raise IncompleteWeights(f"{file}: the header is not a JSON object")
    return header, 8 + length


def _view(file: Path, name: str, entry: dict, data: torch.Tensor, start: int) -> torch.Tensor:
    """Tensor ``name`` of the header, a view of ``data`` (a copy where its offset is not aligned to its dtype)."""
    dtype, shape = _TORCH_DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
    begin, end = (int(x) for x in entry["data_offsets"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * itemsize or begin < 0 or start + end > data.numel():
        raise IncompleteWeights(f"{file}: tensor {name!r} ({entry['dtype']} {shape}) has bytes "
                                f"{begin}..{end} of {data.numel() - start}: a truncated or corrupt file")
    raw = data[start + begin:start + end]
    if (start + begin) % itemsize:
        raw = raw.clone()  # safetensors does not promise alignment; the stage's own files are aligned
    return raw.view(dtype).view(shape)
