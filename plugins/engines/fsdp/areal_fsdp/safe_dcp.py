"""Reading a ``torch.distributed.checkpoint`` folder without running code from it.

DCP stores a folder's index (``.metadata``) as a pickle and its
``FileSystemReader`` unpickles it with ``pickle.load``, so a checkpoint
folder from anyone else can run any code at resume (the tensors themselves
are read with ``torch.load(weights_only=True)``). :class:`SafeFileSystemReader`
reads the index with an unpickler that builds only what DCP writes there:
its metadata dataclasses, ``torch.Size``, dtypes, layouts and paths; any
other name in the pickle is refused with :class:`UnsafeCheckpointError`.
Python's documented way to restrict unpickling (``Unpickler.find_class``) is
all it takes; no library offers it for DCP.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# Modules whose classes DCP's index is made of: dataclasses and enums only (no function of theirs is allowed).
_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                  "torch.distributed.checkpoint.planner")
_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("pathlib", "Path"), ("collections", "OrderedDict")}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A DCP index names something other than what DCP writes there: it is not unpickled."""


_REFUSAL = re.compile(r"\S+ names \S+, which a torch\.distributed\.checkpoint index never holds; .*?this project wrote")


def refusal_in(exc: BaseException) -> UnsafeCheckpointError | None:
    """The refusal of :class:`SafeFileSystemReader` inside what ``dcp.load`` raised (it reports a reader's error
    as text inside a ``CheckpointException`` of every rank), as an :class:`UnsafeCheckpointError`; None if none."""
    texts = [str(exc), *(str(f) for f in (getattr(exc, "failures", None) or {}).values())]
    for text in texts:
        found = _REFUSAL.search(text)
        if found:
            return UnsafeCheckpointError(found.group(0))
    return None


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _CLASS_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise UnsafeCheckpointError(
            f"{self.where} names {module}.{name}, which a torch.distributed.checkpoint index never holds; it is "
            f"not loaded, since unpickling it could run code. Fix: resume only from checkpoints this project "
            f"wrote")


class SafeFileSystemReader(FileSystemReader):
    """:class:`FileSystemReader` whose index is read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _IndexUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
