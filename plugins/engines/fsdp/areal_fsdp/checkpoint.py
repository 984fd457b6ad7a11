"""The fsdp engine's checkpoints: :meth:`CheckpointMixin.save` and :meth:`CheckpointMixin.load`.

A checkpoint folder holds ``model.safetensors`` + ``config.json`` (the
master weights, loadable by transformers; with LoRA the frozen base weights
and ``adapter/``, PEFT's adapter folder), ``optimizer/`` (a
``torch.distributed.checkpoint`` folder of the sharded AdamW state, written by
every rank, reloadable at another world size; its pickled index is read by
:mod:`areal_fsdp.safe_dcp`, which builds nothing but DCP's own classes) and ``engine_state.json``
(version, scheduler) written last: its presence marks a complete save.
"""

from __future__ import annotations

import json
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from areal_core.engine_kit.hf_folder import read_hf_weights, write_hf_files, write_json_atomic
from areal_fsdp.lora import module_names, read_adapter, write_adapter
from areal_fsdp.safe_dcp import SafeFileSystemReader, refusal_in

STATE_FILE = "engine_state.json"
STATE_FORMAT = 1
OPTIMIZER_DIR = "optimizer"
ADAPTER_DIR = "adapter"


class CheckpointMixin:
    """Save and load of :class:`~areal_fsdp.engine.FSDPEngine` (its model, optimizer, scheduler and version)."""

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Model (master dtype, HF safetensors), optimizer (DCP, sharded), scheduler and version into ``path``.

        With LoRA the model files hold the frozen base weights and ``adapter/``
        the adapters (PEFT format, master dtype). Every rank calls it with the
        same folder.
        """
        self._require_model("save")
        folder = Path(path)
        state = self._full_state_dict("base")
        adapters = self._full_state_dict("adapters") if self._peft is not None else {}
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
            shutil.rmtree(folder / OPTIMIZER_DIR, ignore_errors=True)  # no shard files of an older save remain
            master = next(self.lm.parameters()).dtype
            write_hf_files(folder, self.lm, state, master, source=self.source)
            if self._peft is not None:
                (folder / ADAPTER_DIR).mkdir(exist_ok=True)
                write_adapter(folder / ADAPTER_DIR, adapters, self._peft, master, self.source)
        self._barrier()
        saved_optimizer = with_optimizer and self.optimizer is not None
        if saved_optimizer:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optim = get_optimizer_state_dict(self.model, self.optimizer)
            with _quiet_single_process_dcp():
                dcp.save({"optimizer": optim}, storage_writer=dcp.FileSystemWriter(str(folder / OPTIMIZER_DIR),
                                                                                   overwrite=True),
                         no_dist=self.world == 1)
        if self.rank == 0:
            write_json_atomic(folder / STATE_FILE, {
                "format": STATE_FORMAT, "version": self._version, "role": self.role, "world_size": self.world,
                "optimizer": saved_optimizer, "lora": self._peft is not None,
                "scheduler": self.scheduler.state_dict() if saved_optimizer else None,
            })
        self._barrier()

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote; every rank calls it with the same folder.

        With ``with_optimizer=False`` any HF model folder of the same
        architecture loads (weights only; the version is the folder's, else 0);
        with LoRA the folder needs ``adapter/`` too.
        """
        from transformers import AutoModelForCausalLM

        self._require_model("load")
        folder = Path(path)
        state_file = folder / STATE_FILE
        meta = json.loads(state_file.read_text()) if state_file.is_file() else None
        master = next(self.lm.parameters()).dtype
        if self.role == "critic":  # a value head transformers would not load into a causal LM: the files as written
            state = {name: t.to(master) for name, t in read_hf_weights(folder, "FSDPEngine.load").items()}
        else:
            fresh = AutoModelForCausalLM.from_pretrained(str(folder), dtype=master)
            state = dict(fresh.state_dict())
            del fresh
        if self._peft is not None:
            own = list(self.lm.state_dict())
            state = {**module_names(state, own), **read_adapter(folder / ADAPTER_DIR)}
        self._load_full_state_dict(state, str(folder))
        if with_optimizer and self.optimizer is not None:
            if not meta or not meta.get("optimizer"):
                raise FileNotFoundError(f"FSDPEngine.load: {folder} holds no optimizer state (saved with "
                                        f"with_optimizer=False, or not by this engine); load it with "
                                        f"with_optimizer=False to take the weights only")
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            box = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            with _quiet_single_process_dcp():
                try:
                    dcp.load(box, storage_reader=SafeFileSystemReader(str(folder / OPTIMIZER_DIR)),
                             no_dist=self.world == 1)
                except BaseException as exc:  # DCP's CheckpointException is no Exception
                    refused = refusal_in(exc)
                    if refused is not None:
                        raise refused from None
                    raise
            set_optimizer_state_dict(self.model, self.optimizer, box["optimizer"])
            self.scheduler.load_state_dict(meta["scheduler"])
        self._version = int(meta["version"]) if meta else 0
        self._barrier()

    def _load_full_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Copy full tensors (module names) into the (sharded) parameters and buffers."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = self.lm.state_dict(keep_vars=True)
        missing = [n for n in own if n not in state and self._aliases.get(n) not in state]
        unexpected = [n for n in state if n not in own]
        if missing or unexpected:
            raise ValueError(f"FSDPEngine: the weights in {where} do not fit {type(self.lm).__name__}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, target in own.items():
                if name in self._aliases:
                    continue  # the same tensor as its primary
                src = state[name]
                if isinstance(target, DTensor):
                    src = src.to(device=target.device, dtype=target.dtype)
                    target.copy_(distribute_tensor(src, target.device_mesh, target.placements, src_data_rank=None))
                else:
                    target.copy_(src.to(device=target.device, dtype=target.dtype))


@contextmanager
def _quiet_single_process_dcp() -> Iterator[None]:
    """DCP warns that it runs in one process when no process group exists: that is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
