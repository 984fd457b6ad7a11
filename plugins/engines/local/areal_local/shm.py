"""Weights for the embedded server through one safetensors file in ``/dev/shm``, rewritten in place per version.

``update_weights_from_tensors`` used to write each version to a fresh temporary
folder in ``/dev/shm`` with ``safetensors.torch.save_file`` and delete it after
the server had loaded it. Each version then paid for new shared-memory pages
(allocated and zeroed by the kernel, 270 MB for SmolLM2-135M in bf16) and for
``save_file``'s intermediate byte copies: 0.6 s per version on the 2-core test
machine, on the critical path of a synchronous run. Here the file is created
once and every later version with the same layout is copied straight into its
mapped pages (``torch`` copies, multi-threaded), so the pages are already
resident on both sides.

The file is a plain safetensors file (8-byte little-endian header length, JSON
header, tensor bytes back to back, no holes), so the server reads it with
``safetensors.torch.load_file`` like any other folder. safetensors has no call
that serialises into an existing buffer, hence the short writer below.
Tensors are laid out widest dtype first so every tensor starts at an offset
divisible by its element size (the JSON header is padded to 8 bytes), which a
``uint8 -> dtype`` view needs.

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
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from areal_core.checkpoint import pid_alive

FILE_NAME = "model.safetensors"
PREFIX = "areal-weights-"

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


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


def _layout(named: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[tuple[int, torch.Tensor]], int]:
    """(header block incl. its length prefix, [(offset in file, tensor)], file size)."""
    for name, tensor in named:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
    ordered = sorted(named, key=lambda pair: -pair[1].element_size())  # widest first: every offset aligned
    header: dict[str, Any] = {}
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
        head, placed, size = _layout(named)
        if size != self._size or self._map is None:
            self._open(size)
        assert self._map is not None and self.folder is not None
        self._staged = None  # a write that fails half way must not be taken for a whole one
        self._map[:len(head)] = head
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        for offset, tensor in placed:
            nbytes = tensor.numel() * tensor.element_size()
            buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        del buffer  # no export of the map may outlive this call (mmap.close refuses while one exists)
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
