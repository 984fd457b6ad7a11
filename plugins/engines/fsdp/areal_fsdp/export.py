"""The fsdp engine's weights on their way out: full tensors gathered from the shards, to disk or in buckets.

- :meth:`ExportMixin.export_to_disk`: a HF folder in ``model.dtype`` (or LoRA's adapter folder), written
  atomically by rank 0 (:mod:`areal_core.engine_kit.hf_folder`).
- :meth:`ExportMixin.export_tensors`: full CPU tensors in HF names, in buckets cut by
  :func:`areal_core.engine_kit.packing.buckets`, the next bucket's all-gathers in flight while the current
  one is used. The export holds the engine's export lock (:class:`_Leased`) until its last bucket is read,
  so an optimizer step cannot change the weights half way.
- :meth:`ExportMixin._full_state_dict`: the same gathered tensors in one piece, for export and save.

LoRA adapters are merged in (or left alone, or only they are taken: ``_items``); tied aliases are left out.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

import torch

from areal_core.engine_kit import packing
from areal_core.engine_kit.hf_folder import checkpoint_names, write_hf_folder
from areal_fsdp.lora import export_items, is_adapter, write_adapter


class ExportMixin:
    """Export and full-state gathering of :class:`~areal_fsdp.engine.FSDPEngine` (its ``lm``, ``rank``,
    ``dtype``, LoRA state and export lock)."""

    def _items(self, which: str = "merged") -> tuple[dict, list[tuple[str, list[str], Any]]]:
        """The (sharded) state dict and what to export from it: ``merged`` (LoRA merged in), ``base``
        (LoRA's frozen weights, plain names) or ``adapters`` (LoRA names); tied aliases left out."""
        state = {name: value for name, value in self.lm.state_dict().items() if name not in self._aliases}
        if which == "adapters":
            return state, [(name, [name], None) for name in state if is_adapter(name)]
        return state, export_items(list(state), self._lora_layers, merged=which == "merged")

    def _full_state_dict(self, which: str = "merged") -> dict[str, torch.Tensor]:
        """Full tensors (master dtype, CPU) of :meth:`_items` ``which``, exported names.

        Collective when sharded; only rank 0 gets the tensors, the others an empty dict.
        """
        state, items = self._items(which)
        return {name: t for bucket in self._stream_buckets(state, items, [list(range(len(items)))], None)
                for name, t in bucket}

    def export_to_disk(self, path: str) -> None:
        """Write the weights in ``model.dtype`` as a HF folder at ``path``, atomically.

        With LoRA, the adapters merged in; or, with ``lora_export: adapter``,
        the adapters only, as a PEFT adapter folder. Collective when the world
        is larger than 1 (every rank gathers, rank 0 writes).
        """
        self._require_model("export_to_disk")
        if self._peft is not None and self.options.lora_export == "adapter":
            from areal_core.checkpoint import atomic_dir

            adapters = self._full_state_dict("adapters")
            if self.rank == 0:
                with atomic_dir(path) as folder:
                    write_adapter(folder, adapters, self._peft, self.dtype, self.source)
            self._barrier()
            return
        state = self._full_state_dict()
        if self.rank == 0:
            write_hf_folder(path, self.lm, state, self.dtype, source=self.source)
        self._barrier()

    def export_tensors(self, bucket_bytes: int, into: Any = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights as full CPU tensors in HF names and ``model.dtype``, in buckets of at most ``bucket_bytes``.

        Collective: every rank iterates the whole generator (the same number of
        buckets everywhere); rank 0's buckets hold ``(name, tensor)`` pairs, the
        other ranks' are empty lists. A tensor larger than ``bucket_bytes`` is a
        bucket on its own. On an accelerator the next bucket's all-gathers are
        issued (DTensor ``redistribute(async_op=True)``) before the current
        bucket is handed out, so gathering overlaps with whatever the caller
        does with it; over gloo they are waited one by one (see ``_gather``).
        Tied aliases (a tied ``lm_head.weight``) are left out, as on disk;
        LoRA adapters are merged in (the names are the plain model's). The
        tensors are copies (``_finish``), never views of the parameters:
        with ``into`` (capability ``export_into``), copies into the memory
        ``into(name, shape, dtype)`` gives, cast in the same pass, where it
        gives any.
        """
        self._require_model("export_tensors")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"FSDPEngine.export_tensors: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        state, items = self._items("merged")
        self._hold_weights("export_tensors", "for the previous export's buckets to be read to the end (or the "
                                             "export closed)")
        try:
            buckets = self._stream_buckets(state, items, _buckets(state, items, self.dtype, bucket_bytes), self.dtype,
                                           into)
        except BaseException:
            self._export_lock.release()
            raise
        return _Leased(buckets, self._export_lock)

    def _stream_buckets(self, state: dict, items: list, plan: list[list[int]], dtype: torch.dtype | None,
                        into: Any = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket of ``plan`` (indices into ``items``), its successor's gathers in flight while it is used."""
        pending = self._gather(state, [items[i] for i in plan[0]]) if plan else []
        for k in range(len(plan)):
            current = pending
            pending = self._gather(state, [items[i] for i in plan[k + 1]]) if k + 1 < len(plan) else []
            yield self._finish(current, dtype, into)

    @staticmethod
    def _gather(state: dict, items: list) -> list:
        """Start the all-gathers of the items' sources (sharded DTensors); :meth:`_finish` waits for them."""
        from torch.distributed.tensor import DTensor, Replicate

        out = []
        for name, sources, combine in items:
            values = []
            for source in sources:
                value = state[source].detach()
                if isinstance(value, DTensor):
                    # In flight only on an accelerator (nccl): over gloo, DTensor's async all-gathers corrupt
                    # the heap, and on a CPU the gather shares the caller's cores anyway.
                    value = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim,
                                               async_op=value.device.type != "cpu").to_local()
                values.append(value)
            out.append((name, values, combine))
        return out

    def _finish(self, gathered: list, dtype: torch.dtype | None, into: Any = None) -> list[tuple[str, torch.Tensor]]:
        """Wait for a bucket's gathers; on rank 0 its tensors in HF names, combined, cast and copied to CPU (into
        the memory ``into`` gives, where it gives any: see ``export_tensors``)."""
        if self.rank != 0:
            for _, values, _ in gathered:
                for value in values:
                    if hasattr(value, "wait"):
                        value.wait()
            return []
        tensors = {}
        for name, values, combine in gathered:
            value = combine(values) if combine is not None else values[0]
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            target = into(name, tuple(value.shape), cast) if into is not None else None
            if target is not None:
                tensors[name] = target.copy_(value)  # cast and copy in one pass, straight into the caller's memory
                continue
            fresh = combine is not None  # a combined tensor is already new
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                value, fresh = value.to(dtype), True
            # One pass per tensor: a cast on the CPU already made the copy the contract asks for
            tensors[name] = value if fresh and value.device.type == "cpu" else value.to("cpu", copy=True)
        if dtype is None:
            return list(tensors.items())  # module names: the HF-folder writer renames
        return list(checkpoint_names(self.lm, tensors).items())


class _Leased:
    """An export's buckets, holding the engine's export lock until the last is read or the export is closed.

    The lock is taken when ``export_tensors`` is called, not when iteration starts, so an optimizer step on the
    calling thread cannot slip in before a consumer thread has begun. An export dropped unread releases it
    when collected.
    """

    def __init__(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], lock: threading.Lock) -> None:
        self._buckets = buckets
        self._release = weakref.finalize(self, lock.release)  # runs at most once: close() or collection

    def __iter__(self) -> "_Leased":
        return self

    def __next__(self) -> list[tuple[str, torch.Tensor]]:
        try:
            return next(self._buckets)
        except BaseException:  # StopIteration at the end, or a failed gather: the weights are free again
            self.close()
            raise

    def close(self) -> None:
        self._buckets.close()
        self._release()


def _buckets(state: dict, items: list, dtype: torch.dtype, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``items`` in order, grouped so each group's bytes (floats in ``dtype``) stay within
    ``bucket_bytes``; an item larger than that is a group alone."""
    float_size = torch.empty((), dtype=dtype).element_size()
    sizes = []
    for _, sources, _ in items:
        value = state[sources[0]]  # the exported tensor has the shape of its first source
        # the full tensor's bytes, also for a shard
        sizes.append(value.numel() * (float_size if value.is_floating_point() else value.element_size()))
    return packing.buckets(sizes, bucket_bytes)
