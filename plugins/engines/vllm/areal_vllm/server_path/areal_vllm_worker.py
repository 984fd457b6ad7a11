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
models, tensor parallel 1):

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
- What cannot be mapped back is reported as ``"not checkable: <why>"`` (the
  trainer's side skips it and says which in the run log): quantised layers,
  tensor-parallel shards (tp > 1), a linear layer repacked before the hook
  saw it, a name vLLM's weight mapper would not send to the parameter found.
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


# ------------------------------------------------------------------ the load hook
# layer -> {"weight"/"bias": {mode: [digest per fused part]}}, written as the layer's weights are loaded
LOADED: "weakref.WeakKeyDictionary[Any, dict[str, dict[str, list[str]]]]" = weakref.WeakKeyDictionary()


def record_loaded(layer: Any) -> None:
    """Digest a linear layer's weight and bias as the loader left them (before any kernel repacking)."""
    modes = load_modes()
    sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    entry = {}
    for attr in ("weight", "bias"):
        t = getattr(layer, attr, None)
        if modes and t is not None and t.numel() and not t.is_meta:
            entry[attr] = fused_digests(t.data, sizes, modes)
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
                   loaded: dict[str, dict[str, list[str]]] | None) -> dict[str, str]:
    """The digests of one module's own parameters under the trainer's names (see the module docstring).

    ``packed``: the model's ``packed_modules_mapping`` (fused module -> the trainer's module names);
    ``loaded``: what the load hook recorded for this module, if anything."""
    out: dict[str, str] = {}
    prefix, _, short = name.rpartition(".")
    parts = packed.get(short)
    trainer_modules = [f"{prefix}.{p}" if prefix else p for p in parts] if parts else [name]
    params = dict(module.named_parameters(recurse=False))
    quantised = _quantised(module)
    tp = int(getattr(module, "tp_size", 1) or 1)
    for attr in sorted(set(params) | set(loaded or {})):
        names = [f"{m}.{attr}" for m in trainer_modules]
        if quantised:
            out.update({n: _not_checkable(f"vLLM quantised {name} ({quantised})") for n in names})
            continue
        if tp > 1:
            out.update({n: _not_checkable(f"{name} is split over {tp} tensor-parallel ranks; areal digests "
                                          "tensor parallel 1 only") for n in names})
            continue
        live = params[attr].data if attr in params else None
        recorded = (loaded or {}).get(attr)
        if recorded and mode not in recorded:
            out.update({n: _not_checkable(f"the load hook digested {name}.{attr} in mode {'/'.join(recorded)} "
                                          f"only (${LOAD_MODES_ENV}), not {mode}") for n in names})
            continue
        if recorded and (live is None or not live.numel() or live.is_meta
                         or not recorded[mode][0].startswith(str(live.dtype).removeprefix("torch.") + "[")):
            # the live parameter is gone (repacked for a CPU kernel) or was cast (a bias made float32 for the
            # SGL kernel): what the loader wrote is what the hook digested
            digests = recorded[mode]
        else:
            t = live
            if t is None or t.numel() == 0 or t.is_meta:
                out.update({n: _not_checkable(f"vLLM repacked {name}.{attr} for its kernel before areal's load "
                                              "hook digested it") for n in names})
                continue
            vocab = getattr(module, "org_vocab_size", None)
            if vocab is not None and t.dim() and t.shape[0] > vocab:
                t = t[:vocab]  # the padding rows vLLM adds past the vocabulary
            digests = [tensor_digest(p, mode) for p in split_rows(t, [] if len(names) == 1 else
                                                                  list(getattr(module, "output_partition_sizes", [])))]
        if len(digests) != len(names):
            out.update({n: _not_checkable(f"{name}.{attr} holds {len(digests)} part(s), the model's packing "
                                          f"names {len(names)}") for n in names})
            continue
        out.update(zip(names, digests))
    return out


def model_digests(model: Any, mode: str = "on", loaded: Any = None) -> dict[str, str]:
    """The digests of every weight of a vLLM model, under the trainer's (Hugging Face) names."""
    if mode not in MODES:
        raise ValueError(f"weight digest mode {mode!r}: choose 'on' or 'sample'")
    loaded = LOADED if loaded is None else loaded
    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    out: dict[str, str] = {}
    owners: dict[int, str] = {}  # id of a parameter -> the name digested first (tied weights)
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        mine = {attr: p for attr, p in own.items() if id(p) not in owners}
        for attr, p in own.items():
            if id(p) in owners:  # a tied weight (lm_head = embed_tokens): the tensor vLLM uses under this name
                out[f"{name}.{attr}"] = out.get(owners[id(p)], _not_checkable(f"tied to {owners[id(p)]}"))
        if not mine and module not in loaded:
            continue
        for attr, p in mine.items():
            owners[id(p)] = f"{name}.{attr}"
        shown = module_digests(name, module, mode, packed, loaded.get(module))
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
