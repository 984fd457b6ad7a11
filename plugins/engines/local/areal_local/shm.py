"""Weights for the embedded server through safetensors files in ``/dev/shm``, two of them used in turn.

The writer (:class:`WeightStage`, the client's side)
-----------------------------------------------------
``update_weights_from_tensors`` used to write each version to a fresh temporary
folder in ``/dev/shm`` with ``safetensors.torch.save_file`` and delete it after
the server had loaded it. Each version then paid for new shared-memory pages
(allocated and zeroed by the kernel, 270 MB for SmolLM2-135M in bf16) and for
``save_file``'s intermediate byte copies: 0.6 s per version on the 2-core test
machine, on the critical path of a synchronous run. Here the files are created
once and every later version with the same layout is copied straight into the
mapped pages of one of them (``torch`` copies), so the pages are already
resident on both sides.

There are two such files, slots ``slot0`` and ``slot1`` of the stage folder,
and a version goes into the slot that does NOT hold the newest version
written: a server on this node serves its weights straight from the slot it
last loaded (:meth:`areal_local.generator.Generator.load_state_dict` with
``adopt``: no copy into the model), and the next version is written into the
other slot while it generates. The rule that makes this safe: a server leaves
a slot (it loads the other one, or copies its weights out before a delta)
before the version after next is written. The rollout controller awaits
every engine's update before the trainer sends the next version, and an
engine whose update failed leaves routing (or fails the run), so a routed
server never reads a slot being rewritten.

Each file is a plain safetensors file (8-byte little-endian header length, JSON
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
0.05 s for the copy itself). The server keeps both slot files mapped (read
only) between versions (same inode, same size: same pages) and hands out
tensors that are views of the mapping, which the generator either serves
from as they are or copies into its own memory. Any other safetensors file (a
``disk`` update's folder) is mapped the same way for one load, then let go.

A folder left by a process that died (SIGKILL skips every cleanup) is removed
by the next stage created on this machine: names carry the owner's pid. So do
the folders a delta goes through (``areal-delta-<pid>-``), swept the same way.
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
DELTA_PREFIX = "areal-delta-"  # a delta's folder (areal_local.engine), written and removed per update
VERSION_KEY = "areal_version"  # in the header's __metadata__: the version the file holds

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def _root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def stage_root() -> Path:
    """Where the stages and delta folders of every process of this machine go (``/dev/shm`` where it exists)."""
    return _root()


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove stage and delta folders whose owning process is gone; returns what was removed."""
    removed = []
    for prefix in (PREFIX, DELTA_PREFIX):
        for folder in (root or _root()).glob(f"{prefix}*"):
            match = re.fullmatch(rf"{prefix}(\d+)-.*", folder.name)
            if match and folder.is_dir() and not pid_alive(int(match.group(1))):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def _version_field(version: int) -> str:
    return f"{version:020d}"  # fixed width: the header, hence every offset, is the same for every version


def _layout(named: list[tuple[str, torch.Tensor]],
            version: int) -> tuple[bytes, list[tuple[str, int, torch.Tensor]], int]:
    """(header block incl. its length prefix, [(name, offset in file, tensor)], file size)."""
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
    placed = [(name, len(head) + header[name]["data_offsets"][0], tensor) for name, tensor in ordered]
    return head, placed, len(head) + at


SLOTS = ("slot0", "slot1")  # the stage's two files, used in turn (see the module docstring)


class Destination:
    """Where an export of ``version`` may put its tensors straight away: views of the stage slot the next
    write of that version fills (:meth:`WeightStage.destination`), so the export's copy is the transfer.

    Called as ``destination(name, shape, dtype)``: a writable CPU tensor of that shape and dtype inside the
    slot when the last version written had a tensor ``name`` laid out so, else None (the exporter makes its
    own tensor and :meth:`WeightStage.write` copies it in). :meth:`complete` says the export ended whole."""

    def __init__(self, stage: "WeightStage", version: int, slot: int) -> None:
        self.version, self.slot = version, slot
        self.completed = False
        self._buffer = torch.frombuffer(stage._maps[slot], dtype=torch.uint8)
        self._places = dict(stage._places)  # name -> (offset, shape, dtype) of the last layout written

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        place = self._places.get(name)
        if place is None or place[1] != tuple(shape) or place[2] != dtype:
            return None
        offset, shape, dtype = place
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._buffer[offset:offset + nbytes].view(dtype).view(shape)

    def complete(self) -> None:
        self.completed = True


class WeightStage:
    """The staging files of one process (shared by every local engine client in it).

    Which slot a version goes into (the rule of the module docstring): never the one holding the newest
    version written, nor the one an export just filled to serve as the trainer's delta base. A version names
    one set of weights: writing a version the newest slot already holds writes nothing (every engine of this
    process, and a server joining later, takes the same file)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or _root()
        self.folder: Path | None = None
        self._maps: list[mmap.mmap] = []  # one per slot
        self._size = 0
        self._newest: int | None = None  # the slot holding the newest version written
        self._newest_version: int | None = None  # ... and that version (None: an export's, header not written)
        self._places: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}  # the last layout written
        self._reserved: Destination | None = None  # the last destination handed out, until its version is written
        self._finalizer: Any = None

    def _open(self, size: int) -> None:
        self.close()
        sweep_stale(self.root)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        for slot in SLOTS:
            (self.folder / slot).mkdir()
            with open(self.folder / slot / FILE_NAME, "w+b") as f:
                f.truncate(size)
                self._maps.append(mmap.mmap(f.fileno(), size))
        self._size = size

    def slot_folder(self, slot: int) -> Path:
        assert self.folder is not None
        return self.folder / SLOTS[slot]

    def _free_slot(self, version: int) -> int:
        """The slot the next version goes into (see the class docstring); settles the last destination."""
        reserved = self._reserved
        if reserved is not None and (reserved.version == version or not reserved.completed):
            return reserved.slot  # this version's export, or one that failed half way: never served from
        if reserved is not None:  # a whole export of an older version that was never written: a delta base
            self._newest, self._newest_version, self._reserved = reserved.slot, None, None
        return 0 if self._newest is None else 1 - self._newest

    def destination(self, version: int) -> Destination | None:
        """Where an export of ``version`` may write its tensors (:class:`Destination`); None before the first
        write (no layout yet). The same object for every call with this version until it is written."""
        if self._reserved is not None and self._reserved.version == version:
            return self._reserved
        if not self._maps or not self._places:
            return None
        slot = self._free_slot(version)
        self._maps[slot][:8] = bytes(8)  # its content is about to change: no reader may take it as whole
        self._reserved = Destination(self, version, slot)
        return self._reserved

    def write(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> Path:
        """Put ``named_tensors`` in the slot not holding the newest version (tensors an export already put in
        place through :meth:`destination` are not copied again); returns that slot's folder."""
        if self._newest is not None and self._newest_version == version:
            return self.slot_folder(self._newest)  # another engine of this process takes the same version
        named = [(name, t.detach().cpu()) for name, t in named_tensors]  # .cpu() is a no-op for CPU tensors
        head, placed, size = _layout(named, version)
        if size != self._size or not self._maps:
            self._open(size)  # a new layout (or the first version): both slots are new, slot 0 goes first
            self._newest, self._newest_version, self._reserved = None, None, None
        slot = self._free_slot(version)
        mapped = self._maps[slot]
        # A write that fails half way must not be taken for a whole one, here or by a reader: the header length
        # is zeroed first (the file reads as incomplete) and the header, with its version, goes in last.
        mapped[:8] = bytes(8)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        low, high = buffer.data_ptr(), buffer.data_ptr() + size
        # A tensor inside this slot but not at its place (the layout moved) is taken out before anything moves.
        placed = [(name, offset, tensor.clone() if low <= tensor.data_ptr() < high and
                   tensor.data_ptr() != low + offset else tensor) for name, offset, tensor in placed]
        for name, offset, tensor in placed:
            if tensor.data_ptr() == low + offset:
                continue  # exported straight into its place (destination)
            nbytes = tensor.numel() * tensor.element_size()
            buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        del buffer
        mapped[8:len(head)] = head[8:]
        mapped[:8] = head[:8]
        self._newest, self._newest_version, self._reserved = slot, version, None
        self._places = {name: (offset, tuple(tensor.shape), tensor.dtype) for name, offset, tensor in placed}
        return self.slot_folder(slot)

    def close(self) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # views handed out (destinations) still live: the mapping goes with the last
                pass
        self._maps = []
        if self._finalizer is not None:
            self._finalizer()  # removes the folder
            self._finalizer = None
        self.folder, self._size, self._newest, self._reserved = None, 0, None, None
        self._newest_version, self._places = None, {}


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

    A stage file (one whose header carries ``areal_version``) stays mapped while its identity (device, inode,
    size) stays the same, so the next version written into the same pages costs no page faults, and the
    views handed out stay valid for as long as anything holds them (a mapping goes only with its last view).
    Up to :attr:`KEEP` stage files are kept (the stage's two slots, and a new layout's); any other file is
    mapped for one :meth:`tensors` call. Little-endian only, like every platform areal runs on.
    """

    KEEP = 4

    def __init__(self) -> None:
        # path -> (identity, map, bytes) of the stage files kept mapped, oldest first
        self._kept: dict[str, tuple[tuple[int, int, int], mmap.mmap, torch.Tensor]] = {}
        self.last_is_stage = False  # whether the last tensors() call read a stage file (its views stay mapped)

    def tensors(self, file: str | Path, version: int | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of ``file``, viewing the mapped file (valid until the file changes: copy them now, or
        serve from them only while the writer leaves the file alone: the stage's rule, see the module docstring).

        Checked whole before anything is handed out: a file whose header length is zero (a stage write that
        failed half way), a header that does not parse, a tensor whose bytes lie past the end, or a stage file
        holding another version than ``version`` is refused with :class:`IncompleteWeights` naming it; a
        dtype this reader does not know is read by ``safetensors`` itself (a copy)."""
        file = Path(file)
        self.last_is_stage = False
        with open(file, "rb") as f:
            st = os.fstat(f.fileno())
            identity = (st.st_dev, st.st_ino, st.st_size)
            kept = self._kept.get(str(file))
            if kept is not None and kept[0] == identity:
                _, mapped, data = kept
            else:
                self._kept.pop(str(file), None)  # a stage file replaced (a new layout): its old map goes
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
            self._kept[str(file)] = (identity, mapped, data)
            while len(self._kept) > self.KEEP:
                self._kept.pop(next(iter(self._kept)))
        if any(entry.get("dtype") not in _TORCH_DTYPES for entry in header.values()):
            from safetensors.torch import load_file

            return load_file(str(file))
        out = {}
        for name, entry in header.items():
            out[name] = _view(file, name, entry, data, start)
        self.last_is_stage = held is not None
        return out

    def close(self) -> None:
        self._kept.clear()


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
