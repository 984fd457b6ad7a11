"""A megatron engine's weights in and out: HF folders loaded, exports, checkpoints.

:class:`CheckpointMixin` owns:

- :meth:`~CheckpointMixin._load_hf_weights`: each rank's tensor-parallel shard of its stage's layers from
  a HF folder (:func:`areal_core.engine_kit.hf_folder.read_hf_weights`, :mod:`areal_megatron.convert`);
- :meth:`~CheckpointMixin._gather_hf`: the full HF-named tensors gathered over tensor ranks and stages;
- :meth:`~CheckpointMixin.export_to_disk` (a HF folder in ``model.dtype``, written atomically by rank 0)
  and :meth:`~CheckpointMixin.export_tensors` (buckets cut by
  :func:`areal_core.engine_kit.packing.buckets`);
- :meth:`~CheckpointMixin.save` / :meth:`~CheckpointMixin.load`: ``model.safetensors`` + ``config.json``
  (HF names, every stage's layers, the master dtype, loadable by transformers; tokenizer and generation
  config from the model's folder), ``optimizer/`` (one file per tensor-parallel rank and stage on CPU;
  Megatron's parameter state on GPU) and ``engine_state.json`` (version, schedule step, t, p, virtual
  pipeline size) written last: its presence marks a complete save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from areal_core.engine_kit import packing
from areal_core.engine_kit.hf_folder import read_hf_weights, write_hf_tensors
from areal_megatron import convert

STATE_FILE = "engine_state.json"
STATE_FORMAT = 1
OPTIMIZER_DIR = "optimizer"


class CheckpointMixin:
    """Weights, exports and checkpoints of :class:`~areal_megatron.engine.MegatronEngine` (its chunks,
    ``hf_config``, ``source``, parallel ranks and groups, optimizer and schedule)."""

    # ------------------------------------------------------------------ weights
    def _load_hf_weights(self, folder: str) -> None:
        """This rank's tensor-parallel shard of its pipeline stage's parameters, from the HF folder."""
        shard = convert.hf_to_megatron(read_hf_weights(folder, "MegatronEngine"), self.hf_config, tp=self.tp,
                                       rank=self.tp_rank)
        needed: set[str] = set()
        with torch.no_grad():
            for chunk in self.chunks:
                names = convert.stage_names(chunk, tied=self.tied)
                for name, param in chunk.named_parameters():
                    source = names[name]
                    needed.add(source)
                    if source not in shard:
                        raise ValueError(f"MegatronEngine: the weights of {folder} do not fit the Megatron model: "
                                         f"{source} (this stage's {name}) is missing")
                    if shard[source].shape != param.shape:
                        raise ValueError(f"MegatronEngine: {source} from {folder} has shape "
                                         f"{tuple(shard[source].shape)}, the model expects {tuple(param.shape)}")
                    param.copy_(shard[source].to(device=param.device, dtype=param.dtype))
        if self.pp > 1:  # every stage loads its share: together they must take every tensor
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, needed, group=self.pp_group)
            needed = set().union(*stages)
        if set(shard) - needed:
            raise ValueError(f"MegatronEngine: the weights of {folder} do not fit the Megatron model: unexpected "
                             f"{sorted(set(shard) - needed)[:5]}")

    def _gather_hf(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (CPU, the parameters' dtype) on every rank; collective over the tensor-parallel
        group, then over the pipeline group (each stage brings its layers, numbered in the whole model)."""
        own: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            names = convert.stage_names(chunk, tied=self.tied)
            own.update({names[name]: p.detach() for name, p in chunk.named_parameters()})
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.tp)]
        for name, value in own.items():
            if self.tp == 1:
                shards[0][name] = value.cpu()
                continue
            pieces = [torch.empty_like(value) for _ in range(self.tp)]
            dist.all_gather(pieces, value.contiguous(), group=self.tp_group)
            for r, piece in enumerate(pieces):
                shards[r][name] = piece.cpu()
        if self.pp > 1:
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, shards, group=self.pp_group)
            # A tied embedding comes from both ends (equal copies): the first stage's is kept.
            shards = [{name: t for stage in reversed(stages) for name, t in stage[r].items()} for r in range(self.tp)]
        return convert.megatron_to_hf(shards, self.hf_config)

    def _writer(self) -> bool:
        return self.rank == 0

    def _write_hf(self, folder: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """HF model files into ``folder``: weights in ``dtype``, the model's config saying so, its tokenizer and
        generation config."""
        from transformers import AutoConfig

        write_hf_tensors(folder, tensors, dtype, AutoConfig.from_pretrained(self.source), source=self.source)

    # ------------------------------------------------------------------ exports
    def export_to_disk(self, path: str) -> None:
        """Write the weights in ``model.dtype`` as a HF folder at ``path``, atomically. Collective."""
        from areal_core.checkpoint import atomic_dir

        self._require_model("export_to_disk")
        tensors = self._gather_hf()
        if self._writer():
            with atomic_dir(path) as folder:
                self._write_hf(folder, tensors, self.dtype)
        self._barrier()

    def export_tensors(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """Full tensors in HF names and ``model.dtype``, in buckets of at most ``bucket_bytes`` (one tensor
        larger than that comes alone). Collective: every rank iterates; every rank gets the tensors, copies
        that later steps leave alone (at t1 / p1 in float32 the HF tensors can be the parameters themselves)."""
        self._require_model("export_tensors")
        if bucket_bytes < 1:
            raise ValueError(f"MegatronEngine.export_tensors: bucket_bytes must be >= 1, got {bucket_bytes}")
        items = list(self._gather_hf().items())

        def dtype_of(t: torch.Tensor) -> torch.dtype:
            return self.dtype if t.is_floating_point() else t.dtype

        sizes = [t.numel() * dtype_of(t).itemsize for _, t in items]
        for bucket in packing.buckets(sizes, bucket_bytes):
            yield [(items[i][0], items[i][1].to(dtype_of(items[i][1]), copy=True)) for i in bucket]

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Model (master dtype, HF safetensors), optimizer, schedule and version into ``path``. Collective."""
        self._require_model("save")
        folder = Path(path)
        tensors = self._gather_hf()
        if self._writer():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
            shutil.rmtree(folder / OPTIMIZER_DIR, ignore_errors=True)
            (folder / OPTIMIZER_DIR).mkdir()
            self._write_hf(folder, tensors, self._parameters()[0].dtype)
        self._barrier()
        saved = with_optimizer and self.optimizer is not None
        if saved:
            self._save_optimizer(folder / OPTIMIZER_DIR)
        if self._writer():
            tmp = folder / f".{STATE_FILE}.tmp"
            tmp.write_text(json.dumps({"format": STATE_FORMAT, "version": self._version, "role": self.role,
                                       "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "optimizer": saved,
                                       "schedule_step": self.schedule.step if saved else None}, indent=2) + "\n")
            os.replace(tmp, folder / STATE_FILE)
        self._barrier()

    def _optimizer_file(self, kind: str) -> str:
        """This model-parallel rank's optimizer file: ``tp{r}.pt`` at p1, ``pp{s}-tp{r}.pt`` with stages;
        ``kind`` prefixes Megatron's parameter state on GPU."""
        name = f"tp{self.tp_rank}.pt" if self.pp == 1 else f"pp{self.pp_rank}-tp{self.tp_rank}.pt"
        return f"{kind}-{name}" if kind else name

    def _save_optimizer(self, folder: Path) -> None:
        if self.cpu:
            if self.dp_rank == 0:  # data-parallel ranks hold the same state
                torch.save(self.optimizer.state_dict(), folder / self._optimizer_file(""))
        else:
            # Gathered over the data-parallel group and written by its rank 0: one file per tensor rank and stage.
            self.optimizer.save_parameter_state(str(folder / self._optimizer_file("parameter_state")))
            if self.dp_rank == 0:
                torch.save(self.optimizer.state_dict(), folder / self._optimizer_file("common"))
        self._barrier()

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote (any HF folder of the model, weights only, with ``with_optimizer=False``)."""
        self._require_model("load")
        folder = Path(path)
        state_file = folder / STATE_FILE
        meta = json.loads(state_file.read_text()) if state_file.is_file() else None
        self._load_hf_weights(str(folder))
        if with_optimizer and self.optimizer is not None:
            if not meta or not meta.get("optimizer"):
                raise FileNotFoundError(f"MegatronEngine.load: {folder} holds no optimizer state (saved with "
                                        f"with_optimizer=False, or not by this engine); load it with "
                                        f"with_optimizer=False to take the weights only")
            saved_at = (meta.get("tp"), meta.get("pp", 1), meta.get("vpp", 1))
            if saved_at != (self.tp, self.pp, self.vpp):
                was = "t{} p{} virtual pipeline {}".format(*saved_at)
                raise ValueError(f"MegatronEngine.load: {folder} was saved at {was}, this engine runs t{self.tp} "
                                 f"p{self.pp} virtual pipeline {self.vpp} (the optimizer state is split that way); "
                                 f"resume at {was} or load with with_optimizer=False")
            if self.cpu:
                self.optimizer.load_state_dict(_load_tensors(folder / OPTIMIZER_DIR / self._optimizer_file("")))
            else:
                self.optimizer.load_state_dict(_load_tensors(folder / OPTIMIZER_DIR / self._optimizer_file("common")))
                self.optimizer.load_parameter_state(
                    str(folder / OPTIMIZER_DIR / self._optimizer_file("parameter_state")))
            self.schedule.step = int(meta["schedule_step"])
            self._apply_lr()
        self._version = int(meta["version"]) if meta else 0
        self._barrier()


def _load_tensors(path: Path) -> Any:
    """An optimizer state file, with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
    only, so a checkpoint from someone else cannot run code at resume."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"MegatronEngine.load: {path} holds more than tensors and plain values, so it is not loaded "
                         f"(loading it could run code): {first[:300]}. Fix: resume only from checkpoints this "
                         f"project wrote") from None
