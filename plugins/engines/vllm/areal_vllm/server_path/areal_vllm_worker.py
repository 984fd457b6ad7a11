"""areal's vLLM worker extension: the digests of the weights a vLLM worker holds, under the trainer's names.

The vLLM plugin starts its servers with ``--worker-extension-cls
areal_vllm_worker.ArealWorkerExtension`` and this folder on their
``PYTHONPATH``; ``/collective_rpc`` then calls :meth:`ArealWorkerExtension.areal_weight_digest`
on every worker. This module runs inside the server's own environment
(``.venv-vllm``), where areal_core is not installed: it needs torch, xxhash
and (for the load hook) vllm only, and it re-implements
``areal_core.weight_check.tensor_digest`` byte for byte (a test holds the two
equal).

What is digested, and where (vLLM >=0.32,<0.33, Llama- and Qwen2-family
models, any tensor-parallel size):

- vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and
  ``gate_proj``/``up_proj`` into ``gate_up_proj`` (the model's
  ``packed_modules_mapping``). The fused tensor is split back along its output
  rows by the layer's ``output_partition_sizes`` (q, kv, kv; intermediate,
  intermediate) and each slice digested under the name the trainer sent.
- On CPU a linear layer's weight is handed to oneDNN (or the SGL kernel) right
  after loading, which keeps its own packed copy, and the parameter is emptied:
  nothing is left to read (float32 on the test machine; bf16 only on CPUs with
  AVX-512 BF16 or AMX, elsewhere vLLM keeps the parameter for plain torch, and
  a parameter still there in the loaded dtype is read live). A load hook (on
  ``UnquantizedLinearMethod.process_weights_after_loading``, installed when
  vLLM imports this module, before the model loads) digests
  each linear layer's weight and bias once the loader has written them (fused,
  in the dtype vLLM computes in), just before the repacking; those digests
  are reported for the layer until its next load. The repacked copy itself
  cannot be read back; the parity probe covers what happens after this point.
- Embeddings and the output head are read live; their rows past the
  vocabulary (vLLM pads it to a multiple of 64) are left out.
- A tied ``lm_head.weight`` is the embedding tensor in vLLM (it ignores an
  ``lm_head.weight`` it is sent): it is reported with the embedding's digest,
  so a trainer that sends an output head other than its embeddings to a tied
  model fails the check, as it should.
- Tensor parallel (tp > 1): each rank holds a shard of a split parameter
  (column-parallel layers, fused ``qkv_proj``/``gate_up_proj`` included: rows
  of each fused part; row-parallel ``o_proj``/``down_proj``: columns, their
  bias whole on every rank; vocabulary-parallel embedding and output head: a
  range of vocabulary rows, padding after the last real row of each shard).
  The shards of each parameter are gathered to the first rank of vLLM's
  tensor-parallel group (over its CPU group, as bytes) and put back together
  in the trainer's layout there: each fused part's rows of every rank in rank
  order; the k/v heads a rank shares with others when tp exceeds the model's
  kv heads taken once, from the first rank holding them, and the copies held
  by the others compared with it (a copy that differs is reported as such,
  which fails the check naming the tensor); columns side by side; vocabulary
  rows without padding. Only that rank digests a split parameter (the others
  report nothing for it); a parameter every rank holds whole (norms, a
  row-parallel bias) is digested on each and the client merges the answers (a
  rank that differs fails the check). Every rank takes the same decisions in
  the same module order, so the gathers match; on CPU the load hook gathers
  each linear layer as it is loaded (the layers load in the same order on
  every rank), otherwise the live parameters are gathered when digested.
- What cannot be mapped back is reported as ``"not checkable: <why>"`` (the
  trainer's side skips it and says which in the run log): quantised layers,
  a module split over tensor-parallel ranks in a layout not known here (or
  over a group of its own rather than vLLM's tensor-parallel group), a linear layer
  repacked before the hook saw it, a name vLLM's weight mapper would not send
  to the parameter found.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

SAMPLE_BLOCK_BYTES = 4096  # as areal_core.weight_check
SAMPLE_BLOCKS = 16
MODES = ("on", "sample")
NOT_CHECKABLE = "not checkable"  # as areal_core.weight_check.NOT_CHECKABLE
EXTENSION_VERSION = "1"
# The modes the load hook digests in (comma-separated; the plugin sets it from rollout.weight_check: one mode, or
# none when the check is off, so a load costs no more hashing than the check needs). Default: both.
LOAD_MODES_ENV = "AREAL_VLLM_DIGEST_MODES"


def digest_bytes(data: Any, dtype: str, shape: Any, mode: str) -> str:
    """``areal_core.weight_check._digest_bytes``: ``"<dtype>[<shape>]:<xxh3-64 hex>"`` of a buffer."""
    import xxhash

    if mode not in MODES:
        raise ValueError(f"weight digest mode {mode!r}: choose 'on' or 'sample'")
    nbytes = memoryview(data).nbytes
    if mode == "on" or nbytes <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        digest = xxhash.xxh3_64_hexdigest(data)
    else:
        hasher = xxhash.xxh3_64()
        span = nbytes - SAMPLE_BLOCK_BYTES
        for i in range(SAMPLE_BLOCKS):
            at = span * i // (SAMPLE_BLOCKS - 1)
            hasher.update(data[at:at + SAMPLE_BLOCK_BYTES])
        digest = hasher.hexdigest()
    return f"{dtype}[{','.join(str(d) for d in shape)}]:{digest}"


def tensor_digest(tensor: Any, mode: str = "on") -> str:
    """``areal_core.weight_check.tensor_digest``: the tensor's bytes in row-major order."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return digest_bytes(data, str(t.dtype).removeprefix("torch."), t.shape, mode)


def split_rows(tensor: Any, sizes: list[int]) -> list[Any]:
    """The slices of a fused tensor along its rows (dim 0), one per size; ``[tensor]`` when ``sizes`` does not
    cover exactly its rows or names one part only."""
    if len(sizes) <= 1 or tensor.dim() == 0 or sum(sizes) != tensor.shape[0]:
        return [tensor]
    return list(tensor.split(list(sizes), dim=0))


def load_modes() -> tuple[str, ...]:
    """The modes the load hook digests in (``$AREAL_VLLM_DIGEST_MODES``, default both)."""
    value = os.environ.get(LOAD_MODES_ENV)
    return MODES if value is None else tuple(m for m in value.split(",") if m in MODES)


def fused_digests(tensor: Any, sizes: list[int], modes: tuple[str, ...] = MODES) -> dict[str, list[str]]:
    """Per mode, the digests of the slices of ``tensor`` (:func:`split_rows`)."""
    parts = split_rows(tensor, sizes)
    return {mode: [tensor_digest(p, mode) for p in parts] for mode in modes}


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


# ------------------------------------------------------------------ tensor parallel
MAX_DIMS = 8  # of a gathered shard


class GroupGather:
    """Gathers one tensor from every rank of a vLLM ``GroupCoordinator`` (the tensor-parallel group) to the
    group's first rank, over the group's CPU (gloo) group, as bytes (so any dtype travels). Shards may differ in
    shape (the last vocabulary shard holds fewer real rows). Every rank of the group must call it, in the same
    order, with a tensor of the same dtype."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank_in_group)
        self.size = int(group.world_size)

    def __call__(self, tensor: Any) -> list[Any] | None:
        """On the first rank, every rank's tensor in rank order (on CPU); None on the others."""
        import torch
        import torch.distributed as dist

        t = tensor.detach().cpu().contiguous()
        if t.dim() > MAX_DIMS:
            raise ValueError(f"areal's tensor-parallel gather: a shard of {t.dim()} dimensions (at most {MAX_DIMS})")
        meta = torch.full((MAX_DIMS + 1,), -1, dtype=torch.int64)
        meta[0] = t.dim()
        meta[1:1 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
        metas = [torch.empty_like(meta) for _ in range(self.size)]
        dist.all_gather(metas, meta, group=self.group.cpu_group)
        shapes = [[int(d) for d in m[1:1 + int(m[0])]] for m in metas]
        itemsize = t.element_size()
        nbytes = [itemsize * int(torch.tensor(s, dtype=torch.int64).prod()) if s else itemsize for s in shapes]
        data = torch.zeros(max(1, *nbytes), dtype=torch.uint8)  # (gloo sends no empty tensor)
        data[:nbytes[self.rank]] = t.reshape(-1).view(torch.uint8)
        first = self.group.ranks[0]
        received = [torch.empty_like(data) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(data, received, dst=first, group=self.group.cpu_group)
        if received is None:
            return None
        return [r[:n].view(t.dtype).reshape(s) for r, n, s in zip(received, nbytes, shapes)]


def tp_gather() -> GroupGather | None:
    """The gather over vLLM's tensor-parallel group of this worker; None outside a vLLM worker or at tp 1."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):  # no vLLM; its groups not made (a test outside the server)
        return None
    return GroupGather(group) if group is not None and group.world_size > 1 else None


def tp_layout(module: Any) -> str | None:
    """How vLLM splits ``module``'s parameters over tensor-parallel ranks: ``"rows"`` (ColumnParallelLinear and
    the fused QKVParallelLinear / MergedColumnParallelLinear: each fused part's rows), ``"columns"``
    (RowParallelLinear: its weight's columns; its bias is whole on every rank), ``"vocab"``
    (VocabParallelEmbedding, ParallelLMHead: vocabulary rows, padded per shard), ``"whole"`` (not split: tp 1,
    ReplicatedLinear, a module without ``tp_size`` such as a norm); None: split in a layout not known here, or
    over a group of its own (an embedding given a ``parallel_group``), which the gather does not run over."""
    if int(getattr(module, "tp_size", 1) or 1) <= 1:
        return "whole"
    if getattr(module, "parallel_group", None) is not None:
        return None
    if hasattr(module, "input_is_parallel"):
        return "columns"
    if hasattr(module, "shard_indices"):
        return "vocab"
    if hasattr(module, "gather_output"):
        return "rows"
    if "ReplicatedLinear" in {c.__name__ for c in type(module).__mro__}:
        return "whole"
    return None


def is_split(layout: str | None, attr: str) -> bool:
    """Whether parameter ``attr`` of a module of ``layout`` is split over the ranks (a shard on each)."""
    return layout in ("rows", "vocab") or (layout == "columns" and attr == "weight")


def local_shard(module: Any, layout: str, tensor: Any) -> Any:
    """What this rank contributes of a split parameter: its shard, less the padding rows of a vocabulary shard."""
    if layout == "vocab":
        return tensor[:int(module.shard_indices.num_org_elements)]
    return tensor


def assemble(module: Any, layout: str, shards: list[Any], sizes: list[int]) -> list[Any]:
    """The trainer's tensors from every rank's shard (rank order), one per fused part (``sizes``: this rank's
    rows of each part, as :func:`split_rows`). A k/v part whose heads are replicated over ranks
    (``num_kv_head_replicas`` > 1) is taken from the first rank of each replica set; a copy on another rank that
    differs from it is given as a text saying so (a digest no trainer sends: the check fails naming the tensor)."""
    import torch

    if layout == "columns":
        return [torch.cat(shards, dim=1)]
    if layout == "vocab":
        return [torch.cat(shards, dim=0)]
    per_rank = [split_rows(s, sizes) for s in shards]
    replicas = int(getattr(module, "num_kv_head_replicas", 1) or 1)
    out: list[Any] = []
    for i in range(len(per_rank[0])):
        step = replicas if i > 0 else 1  # QKVParallelLinear: q (part 0) is split, k and v may be replicated
        held = [tensor_digest(per_rank[r][i]) for r in range(len(shards))] if step > 1 else []
        differ = [r for r in range(len(shards)) if step > 1 and held[r] != held[r - r % step]]
        if differ:
            out.append("; ".join(f"tensor-parallel rank {r} holds {held[r]}, its replica on rank {r - r % step} "
                                 f"{held[r - r % step]}" for r in differ))
        else:
            out.append(torch.cat([per_rank[r][i] for r in range(0, len(shards), step)], dim=0))
    return out


def gathered_digests(module: Any, layout: str, tensor: Any, sizes: list[int], modes: tuple[str, ...],
                     gather: GroupGather) -> dict[str, list[str]] | None:
    """Per mode, the digests of the trainer's tensors of a split parameter whose shard on this rank is
    ``tensor``: gathered to the group's first rank and digested there (:func:`assemble`); None on the other
    ranks. A collective: every rank calls it for the same parameter in turn."""
    shards = gather(local_shard(module, layout, tensor))
    if shards is None:
        return None
    parts = assemble(module, layout, shards, sizes)
    return {mode: [p if isinstance(p, str) else tensor_digest(p, mode) for p in parts] for mode in modes}


# ------------------------------------------------------------------ the load hook
# layer -> {"weight"/"bias": {"dtype": the loaded dtype, "digests": {mode: [digest per fused part] or None (a
# split parameter: the group's first rank holds its digests)}}}, written as the layer's weights are loaded
LOADED: "weakref.WeakKeyDictionary[Any, dict[str, dict[str, Any]]]" = weakref.WeakKeyDictionary()


def record_loaded(layer: Any, gather: Any = None) -> None:
    """Digest a linear layer's weight and bias as the loader left them (before any kernel repacking); a
    parameter split over tensor-parallel ranks is gathered to the first rank (``gather``, default
    :func:`tp_gather`) and digested there. Every rank loads the same layers in the same order, so the gathers
    match."""
    modes = load_modes()
    sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    layout = tp_layout(layer)
    tp = int(getattr(layer, "tp_size", 1) or 1)
    if modes and tp > 1 and gather is None:
        gather = tp_gather()
    entry = {}
    for attr in ("weight", "bias"):
        t = getattr(layer, attr, None)
        if not modes or t is None or not t.numel() or t.is_meta:
            continue
        if is_split(layout, attr) and gather is not None and gather.size == tp:
            digests = gathered_digests(layer, layout, t.data, sizes, modes, gather)
            digests = digests if digests is not None else dict.fromkeys(modes)
        else:
            digests = fused_digests(t.data, sizes, modes)
        entry[attr] = {"dtype": _dtype_name(t), "digests": digests}
    LOADED[layer] = entry


def install_load_hook() -> bool:
    """Wrap vLLM's ``UnquantizedLinearMethod.process_weights_after_loading`` (once) to call
    :func:`record_loaded` first. False when vLLM is not importable (a test outside the server)."""
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    except ImportError:
        return False
    original = UnquantizedLinearMethod.process_weights_after_loading
    if getattr(original, "_areal_digest_hook", False):
        return True

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        record_loaded(layer)
        return original(self, layer)

    process_weights_after_loading._areal_digest_hook = True
    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    return True


# ------------------------------------------------------------------ vLLM's parameters -> the trainer's names
def _not_checkable(why: str) -> str:
    return f"{NOT_CHECKABLE}: {why}"


def _quantised(module: Any) -> str | None:
    method = getattr(module, "quant_method", None)
    name = type(method).__name__ if method is not None else ""
    if not name or name in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return None
    return name


def module_digests(name: str, module: Any, mode: str, packed: dict[str, list[str]],
                   loaded: dict[str, dict[str, Any]] | None, gather: Any = None) -> dict[str, str]:
    """The digests of one module's own parameters under the trainer's names (see the module docstring).

    ``packed``: the model's ``packed_modules_mapping`` (fused module -> the trainer's module names);
    ``loaded``: what the load hook recorded for this module, if anything; ``gather``: the tensor-parallel
    gather (:class:`GroupGather`; None at tp 1). A parameter split over ranks is reported by the group's first
    rank only; the others leave its names out."""
    out: dict[str, str] = {}
    prefix, _, short = name.rpartition(".")
    parts = packed.get(short)
    trainer_modules = [f"{prefix}.{p}" if prefix else p for p in parts] if parts else [name]
    params = dict(module.named_parameters(recurse=False))
    quantised = _quantised(module)
    tp = int(getattr(module, "tp_size", 1) or 1)
    layout = tp_layout(module)
    for attr in sorted(set(params) | set(loaded or {})):
        names = [f"{m}.{attr}" for m in trainer_modules]
        if quantised:
            out.update({n: _not_checkable(f"vLLM quantised {name} ({quantised})") for n in names})
            continue
        if layout is None:
            group = " over a group of its own" if getattr(module, "parallel_group", None) is not None else ""
            out.update({n: _not_checkable(f"{name} ({type(module).__name__}) is split over {tp} tensor-parallel "
                                          f"ranks{group}, in a layout areal cannot put back together")
                        for n in names})
            continue
        split = is_split(layout, attr)
        if split and (gather is None or gather.size != tp):
            group = "no tensor-parallel group" if gather is None else f"a tensor-parallel group of {gather.size}"
            out.update({n: _not_checkable(f"{name} is split over {tp} tensor-parallel ranks, and this worker has "
                                          f"{group} to gather it over") for n in names})
            continue
        live = params[attr].data if attr in params else None
        recorded = (loaded or {}).get(attr)
        if recorded and mode not in recorded["digests"]:
            out.update({n: _not_checkable(f"the load hook digested {name}.{attr} in mode "
                                          f"{'/'.join(recorded['digests'])} only (${LOAD_MODES_ENV}), not {mode}")
                        for n in names})
            continue
        sizes = [] if len(names) == 1 else list(getattr(module, "output_partition_sizes", []))
        if recorded and (live is None or not live.numel() or live.is_meta or recorded["dtype"] != _dtype_name(live)):
            # the live parameter is gone (repacked for a CPU kernel) or was cast (a bias made float32 for the
            # SGL kernel): what the loader wrote is what the hook digested
            digests = recorded["digests"][mode]
            if digests is None:  # split: the group's first rank reports it
                continue
        elif live is None or live.numel() == 0 or live.is_meta:
            out.update({n: _not_checkable(f"vLLM repacked {name}.{attr} for its kernel before areal's load "
                                          "hook digested it") for n in names})
            continue
        elif split:
            gathered = gathered_digests(module, layout, live, sizes, (mode,), gather)
            if gathered is None:  # not the group's first rank
                continue
            digests = gathered[mode]
        else:
            t = live
            vocab = getattr(module, "org_vocab_size", None)
            if vocab is not None and t.dim() and t.shape[0] > vocab:
                t = t[:vocab]  # the padding rows vLLM adds past the vocabulary
            digests = [tensor_digest(p, mode) for p in split_rows(t, sizes)]
        if len(digests) != len(names):
            out.update({n: _not_checkable(f"{name}.{attr} holds {len(digests)} part(s), the model's packing "
                                          f"names {len(names)}") for n in names})
            continue
        out.update(zip(names, digests))
    return out


def model_digests(model: Any, mode: str = "on", loaded: Any = None, gather: Any = None) -> dict[str, str]:
    """The digests of every weight of a vLLM model, under the trainer's (Hugging Face) names. ``gather``: the
    tensor-parallel gather (default :func:`tp_gather`, None at tp 1); every rank of the group must call this
    at once (``/collective_rpc`` does): a split parameter is gathered to the first rank, which alone reports
    it."""
    if mode not in MODES:
        raise ValueError(f"weight digest mode {mode!r}: choose 'on' or 'sample'")
    loaded = LOADED if loaded is None else loaded
    gather = tp_gather() if gather is None else gather
    elsewhere = gather is not None and gather.rank != 0  # split parameters are reported by the first rank
    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    out: dict[str, str] = {}
    owners: dict[int, str] = {}  # id of a parameter -> the name digested first (tied weights)
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        mine = {attr: p for attr, p in own.items() if id(p) not in owners}
        for attr, p in own.items():
            if id(p) in owners:  # a tied weight (lm_head = embed_tokens): the tensor vLLM uses under this name
                if owners[id(p)] in out:
                    out[f"{name}.{attr}"] = out[owners[id(p)]]
                elif not elsewhere:
                    out[f"{name}.{attr}"] = _not_checkable(f"tied to {owners[id(p)]}")
        if not mine and module not in loaded:
            continue
        for attr, p in mine.items():
            owners[id(p)] = f"{name}.{attr}"
        shown = module_digests(name, module, mode, packed, loaded.get(module), gather)
        out.update({k: v for k, v in shown.items() if k not in out})
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "map_name"):
        vllm_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for hf in list(out):
            mapped = mapper.map_name(hf)
            if mapped is not None and mapped not in vllm_names and hf not in vllm_names:
                out[hf] = _not_checkable(f"vLLM's weight mapper sends {hf} to {mapped}, which the model lacks")
    return out


class ArealWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); its methods are called through
    ``/collective_rpc`` by name. Names start with ``areal_`` (vLLM refuses an extension that shadows a worker
    attribute)."""

    def areal_extension_version(self) -> str:
        """Answers when the extension is installed (the plugin asks at start; a server without it is not digested)."""
        return EXTENSION_VERSION

    def areal_weight_digest(self, mode: str = "on") -> dict[str, str]:
        """Per trainer tensor name, the digest of what this worker holds (:func:`model_digests`)."""
        return model_digests(self.model_runner.get_model(), mode)


install_load_hook()
