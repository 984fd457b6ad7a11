"""The integrity gate for SGLang servers: what SGLang's ``/weights_checker`` will report, computed from the
weights the trainer sends.

SGLang 0.5 answers ``POST /weights_checker {"action": "checksum"}`` with, per
tensor-parallel rank, a checksum of every parameter and buffer of the model
it holds (non-persistent buffers such as rotary caches skipped), IN ITS OWN
LAYOUT, hashed by ``sglang.srt.managers.mm_utils.tensor_hash``. It cannot map
them back to the names the trainer sends, so areal computes the other side:
the tensors sent, laid out as SGLang lays them out, hashed as SGLang hashes.

The layout, for the Llama family SGLang loads with its stacked-params mapping
(:data:`LLAMA_FAMILY`: Llama, Mistral, Qwen2, Qwen3), on rank ``r`` of ``t``:

- ``q_proj``, ``k_proj``, ``v_proj`` (weight and bias) -> ``qkv_proj``: rank
  ``r``'s q heads (``heads / t`` of them), then its k heads, then its v heads,
  stacked along the output dim. With ``t`` >= the kv heads each rank holds
  one kv head, head ``r // (t / kv_heads)`` (replicated);
- ``gate_proj``, ``up_proj`` -> ``gate_up_proj``: rank ``r``'s rows of gate,
  then of up (``intermediate / t`` each);
- ``o_proj``, ``down_proj`` (row parallel): rank ``r``'s columns of the
  weight (``in / t``); a bias is whole on every rank;
- ``embed_tokens``, ``lm_head`` (vocab parallel): the vocabulary padded to a
  multiple of 64 (64 * t when that does not divide by t), rank ``r`` holding
  rows ``r * padded / t`` onwards, the padding rows zero. Tied embeddings: the
  server holds ``embed_tokens`` only (and drops an ``lm_head.weight`` sent);
- norms (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``,
  Qwen3's ``q_norm`` / ``k_norm``): whole on every rank.

Every weight is held in the server's dtype (``--dtype``; ``auto`` is the
config's, float32 models in float16, :func:`server_dtype`). The hash
(``tensor_hash`` of one tensor): on a CPU tensor the first 8 bytes of SHA-256
of its bytes, big-endian (:func:`cpu_hash`); on a CUDA tensor SGLang's triton
kernel (``sglang/kernels/ops/memory/gpu_tensor_hash.py``), ported from its
algorithm in :func:`gpu_hash`: numpy on the CPU, torch on a GPU when the
trainer has one (both checked against the real kernel run by triton's
interpreter: ``tests/gpu_hash_vectors.py``). Checksums are written as
``"<hash>:<16 hex digits>"``, ``<hash>`` being ``sha256-8`` or ``gpu``; names as
SGLang's, with ``@tp<rank>`` appended when the server has more than one rank.

A tensor sent that this mapping cannot place (an architecture outside the
family, a name it does not know, a fused weight sent without all its parts)
is listed by :func:`expected_checksums` as not mapped; the engine's
``sent_digests`` marks it :data:`areal_core.weight_check.NOT_CHECKABLE`, which
the controller's check skips and the run log names.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

LLAMA_FAMILY = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
VOCAB_PADDING = 64  # sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
HASHES = ("sha256-8", "gpu")

_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW_PARALLEL = ("o_proj", "down_proj")
_REPLICATED = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
_LAYER = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.)([a-z_]+)\.(weight|bias)$")
_NORM = re.compile(r"^model\.(?:layers\.\d+\.(?:self_attn\.)?([a-z_]+)|(norm))\.weight$")
_FLOAT32_AUTO = "float16"  # sglang's _get_and_verify_dtype: dtype auto on a float32 model (not Gemma)


@dataclass(frozen=True)
class ModelShape:
    """What the layout needs from the model's ``config.json``."""

    architecture: str
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    config_dtype: str

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        architecture = (config.get("architectures") or ["?"])[0]
        heads = int(config.get("num_attention_heads") or 0)
        hidden = int(config.get("hidden_size") or 0)
        return cls(architecture, heads, int(config.get("num_key_value_heads") or heads),
                   int(config.get("head_dim") or (hidden // heads if heads else 0)),
                   int(config.get("vocab_size") or 0), bool(config.get("tie_word_embeddings", False)),
                   str(config.get("dtype") or config.get("torch_dtype") or "float32"))

    def unmappable(self, tp: int) -> str:
        """Why this model on ``tp`` ranks is outside the mapping ('' when inside)."""
        if self.architecture not in LLAMA_FAMILY:
            family = ", ".join(sorted(LLAMA_FAMILY))
            return f"architecture {self.architecture}: areal maps SGLang's layout of {family} only"
        if not (self.heads and self.head_dim and self.vocab):
            return "config.json lacks num_attention_heads, hidden_size or vocab_size"
        if self.heads % tp or (self.kv_heads % tp if self.kv_heads >= tp else tp % self.kv_heads):
            return f"{self.heads} heads / {self.kv_heads} kv heads do not split over {tp} tensor-parallel ranks"
        return ""


def read_config(path: str | Path) -> dict:
    """``path/config.json`` as a dict; {} when there is none."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def server_dtype(dtype: str, config: dict) -> str:
    """The torch dtype name an SGLang server holds the weights in, given its ``--dtype`` and the config."""
    dtype = (dtype or "auto").lower()
    if dtype != "auto":
        return {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    found = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return _FLOAT32_AUTO if found == "float32" else found


# ------------------------------------------------------------------ the hashes
def cpu_hash(tensor: Any) -> int:
    """``tensor_hash`` of a CPU tensor: the first 8 bytes of SHA-256 of its bytes, as a big-endian integer."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], "big")


_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
FMIX32_C1, FMIX32_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_C1, POS_C2 = 0x27D4EB2D, 0x165667B1
GPU_HASH_SEED = 0x243F6A88
TILE_WORDS = 8192
_CHUNK_TILES = 64  # tiles hashed at once (2 MiB of words): bounds the temporaries


def _fmix32(x: Any) -> Any:
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(FMIX32_C1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(FMIX32_C2)
    return x ^ (x >> np.uint32(16))


def _rotl32(x: Any, r: int) -> Any:
    import numpy as np

    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def gpu_hash(tensor: Any, seed: int = GPU_HASH_SEED, device: str | None = None) -> int:
    """``tensor_hash`` of a CUDA tensor, as SGLang's triton kernel computes it, on any device.

    ``device``: where to compute; None = on the GPU when this process has one (:func:`_gpu_hash_torch`, in
    chunks moved there), else on the CPU in numpy. numpy's 32-bit words beat torch's CPU kernels here (56 MB
    in 0.07 s against 0.30 s on the 2-core test machine, idle), but ~0.8 GB/s on one core would cost a 7B
    model's trainer tens of seconds per update, which a GPU does in about a second.

    The algorithm: the tensor's bytes, zero-padded to whole 32-bit little-endian words ``v[i]``; for each word
    two position keys ``p1 = (i * POS_C1 + s1) ^ rotl(i, 15)``, ``p2 = (i * POS_C2 + s2) ^ rotl(i, 13)`` (``s1``
    the seed, ``s2 = (seed * 0x9E3779B1) ^ 0xDEADBEEF``, all mod 2^32) and ``fmix32(v ^ p1)``, ``fmix32(v ^ p2)``
    (murmur3's finaliser); per tile of 8192 words, the sums of each mod 2^32, each xored with the tensor's byte
    count (padded, mod 2^32) and mixed by ``fmix32`` again, give ``h1 << 32 | h2``; the tiles' values summed mod
    2^64 and mixed by splitmix64's finaliser are the hash. An empty tensor hashes to 0."""
    import torch

    if device is None and torch.cuda.is_available():
        device = "cuda"
    if device is not None:
        return _gpu_hash_torch(tensor, torch.device(device), seed)
    return _gpu_hash_numpy(tensor, seed)


def _gpu_hash_numpy(tensor: Any, seed: int = GPU_HASH_SEED) -> int:
    """:func:`gpu_hash` in numpy on the CPU, 32-bit words throughout."""
    import numpy as np
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    pad = (-data.size) % 4
    if pad:
        data = np.concatenate([data, np.zeros(pad, np.uint8)])
    words = data.view("<u4")
    n = words.size
    if n == 0:
        return 0
    s1 = np.uint32(seed & _M32)
    s2 = np.uint32(((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32)
    nbytes = np.uint32((n * 4) & _M32)
    total = 0
    step = TILE_WORDS * _CHUNK_TILES
    for begin in range(0, n, step):
        v = words[begin:begin + step]
        i = np.arange(begin, begin + v.size, dtype=np.uint32)
        k1 = _fmix32(v ^ ((i * np.uint32(POS_C1) + s1) ^ _rotl32(i, 15)))
        k2 = _fmix32(v ^ ((i * np.uint32(POS_C2) + s2) ^ _rotl32(i, 13)))
        tail = (-v.size) % TILE_WORDS  # the last tile's words past the end count 0, as the kernel's mask does
        sums = [(np.pad(k, (0, tail)) if tail else k).reshape(-1, TILE_WORDS).sum(axis=1, dtype=np.uint64)
                .astype(np.uint32) for k in (k1, k2)]  # the low 32 bits: the kernel's sum mod 2^32
        h1, h2 = (_fmix32(h ^ nbytes) for h in sums)
        total += int(((h1.astype(np.uint64) << np.uint64(32)) | h2.astype(np.uint64)).sum(dtype=np.uint64))
    return _splitmix64(total & _M64)


def _fmix32_(x: Any) -> Any:
    """murmur3's finaliser on int64 tensors holding 32-bit values, in place (products wrap mod 2^64, masked)."""
    x ^= x >> 16
    x.mul_(FMIX32_C1).bitwise_and_(_M32)
    x ^= x >> 13
    x.mul_(FMIX32_C2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _gpu_hash_torch(tensor: Any, device: Any, seed: int = GPU_HASH_SEED, chunk_tiles: int = 1024) -> int:
    """:func:`gpu_hash` in torch on ``device``, ``chunk_tiles`` tiles (32 MiB of words by default) at a time.

    The 32-bit arithmetic runs on int64 holding values below 2^32: every product is masked back to 32 bits
    (int64 products wrap, so their low bits are exact); tile sums of 8192 such values stay below 2^45. Tested
    on the CPU against the known answers of SGLang's kernel, as the numpy path is."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    n = -(-nbytes // 4)
    if n == 0:
        return 0
    s1 = seed & _M32
    s2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    padded_bytes = (n * 4) & _M32
    total = 0
    step = TILE_WORDS * chunk_tiles
    for begin in range(0, n, step):
        end = min(n, begin + step)
        raw = data[begin * 4:min(nbytes, end * 4)].to(device)
        if raw.numel() != (end - begin) * 4 or raw.storage_offset() % 4:  # the zero-padded last word, or unaligned
            whole = torch.zeros((end - begin) * 4, dtype=torch.uint8, device=device)
            whole[:raw.numel()] = raw
            raw = whole
        v = raw.view(torch.int32).to(torch.int64).bitwise_and_(_M32)
        i = torch.arange(begin, end, dtype=torch.int64, device=device).bitwise_and_(_M32)
        k1 = _fmix32_(v ^ (((i * POS_C1 + s1) & _M32) ^ (((i << 15) | (i >> 17)) & _M32)))
        k2 = _fmix32_(v ^ (((i * POS_C2 + s2) & _M32) ^ (((i << 13) | (i >> 19)) & _M32)))
        tail = (-(end - begin)) % TILE_WORDS  # the last tile's words past the end count 0, as the kernel's mask does
        h1, h2 = (_fmix32_((torch.nn.functional.pad(k, (0, tail)) if tail else k).view(-1, TILE_WORDS).sum(1)
                           .bitwise_and_(_M32) ^ padded_bytes).tolist() for k in (k1, k2))
        total += sum((a << 32) | b for a, b in zip(h1, h2))
    return _splitmix64(total & _M64)


def _splitmix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def checksum(tensor: Any, hash_kind: str) -> str:
    """``"<hash_kind>:<16 hex digits>"`` of ``tensor`` (``hash_kind`` one of :data:`HASHES`)."""
    if hash_kind not in HASHES:
        raise ValueError(f"SGLang checksum hash {hash_kind!r}: choose one of {HASHES}")
    value = cpu_hash(tensor) if hash_kind == "sha256-8" else gpu_hash(tensor)
    return f"{hash_kind}:{value:016x}"


# ------------------------------------------------------------------ the layout
def _vocab_rows(tensor: Any, vocab: int, tp: int, rank: int) -> Any:
    """Rank ``rank``'s rows of a vocab-parallel weight, zero-padded as SGLang's VocabParallelEmbedding holds it."""
    import torch

    padding = VOCAB_PADDING
    if (-(-vocab // padding) * padding) % tp:
        padding *= tp
    per_rank = -(-vocab // padding) * padding // tp
    begin = rank * per_rank
    rows = tensor[begin:min(begin + per_rank, vocab)]
    out = torch.zeros((per_rank, *tensor.shape[1:]), dtype=tensor.dtype)
    out[:rows.shape[0]] = rows
    return out


def _shard(part: str, tensor: Any, shape: ModelShape, tp: int, rank: int) -> Any:
    """Rank ``rank``'s rows of one part of a fused column-parallel weight (or bias)."""
    if part == "q":
        size = shape.heads // tp * shape.head_dim
        return tensor[rank * size:(rank + 1) * size]
    if part in ("k", "v"):
        per_rank = max(1, shape.kv_heads // tp)
        replicas = tp // shape.kv_heads if tp >= shape.kv_heads else 1
        size = per_rank * shape.head_dim
        return tensor[rank // replicas * size:(rank // replicas + 1) * size]
    size = tensor.shape[0] // tp  # gate, up
    return tensor[rank * size:(rank + 1) * size]


def _place(name: str, shape: ModelShape) -> tuple[str, str] | None:
    """(SGLang's parameter name, how it is split) of a tensor sent as ``name``; None when it has no place."""
    match = _LAYER.match(name)
    if match:
        prefix, module, kind = match.groups()
        if module in _FUSED:
            return f"{prefix}{_FUSED[module][0]}.{kind}", _FUSED[module][1]
        if module in _ROW_PARALLEL:
            return name, "columns" if kind == "weight" else "whole"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return name, "vocab"
    match = _NORM.match(name)
    if match and (match.group(2) or match.group(1) in _REPLICATED):
        return name, "whole"
    return None


def expected_checksums(named: Iterable[tuple[str, Any]], config: dict, tp: int, dtype: str,
                       hash_kind: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the checksums an SGLang server of ``tp`` ranks holding the model in ``dtype`` reports for these tensors,
    per SGLang name, ``@tp<rank>`` appended when ``tp`` > 1; the tensors sent that have no place in its layout,
    each with why). See the module for the layout. A tensor may be given as a function that reads it
    (:func:`folder_tensors`): it is read when its SGLang parameter is hashed, and let go after."""
    shape = ModelShape.from_config(config)
    tensors = dict(named)
    why = shape.unmappable(tp)
    if why:
        return {}, {name: why for name in tensors}
    placed: dict[str, dict[str, Any]] = {}  # SGLang name -> split -> tensor
    unmapped: dict[str, str] = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and shape.tied:
            continue  # tied: the server keeps embed_tokens, checked under its own name
        where = _place(name, shape)
        if where is None:
            unmapped[name] = f"{name} has no place areal knows in SGLang's layout of {shape.architecture}"
            continue
        placed.setdefault(where[0], {})[where[1]] = tensor
    out: dict[str, str] = {}
    for target, parts in placed.items():
        fused = target.rsplit(".", 2)[-2]
        needed = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}.get(fused)
        if needed and set(parts) != set(needed):
            base = target.rsplit(".", 2)[0]
            for part in parts:
                source = f"{base}.{_PARTS[fused][needed.index(part)]}.{target.rsplit('.', 1)[1]}"
                unmapped[source] = (f"{target} fuses {', '.join(_PARTS[fused])}, but {len(parts)} of them were "
                                    "sent together")
            continue
        for rank, tensor in _rank_tensors(target, parts, needed, shape, tp, dtype):
            out[target if tp == 1 else f"{target}@tp{rank}"] = checksum(tensor, hash_kind)
    return out, unmapped


def _rank_tensors(target: str, parts: dict, needed: tuple | None, shape: ModelShape, tp: int,
                  dtype: str) -> Iterator[tuple[int, Any]]:
    import torch

    cast = getattr(torch, dtype)
    parts = {split: tensor() if callable(tensor) else tensor for split, tensor in parts.items()}
    for rank in range(tp):
        if needed:  # stacked along dim 0: the parts' bytes one after the other (numpy: no torch threads)
            import numpy as np

            yield rank, torch.from_numpy(np.concatenate([
                _shard(p, parts[p], shape, tp, rank).to(cast).contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                for p in needed]))
            continue
        (split, tensor), = parts.items()
        if split == "columns":
            size = tensor.shape[1] // tp
            tensor = tensor[:, rank * size:(rank + 1) * size]
        elif split == "vocab":
            tensor = _vocab_rows(tensor, shape.vocab, tp, rank)
        yield rank, tensor.to(cast)


def folder_tensors(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, a function that reads the tensor) of every tensor in the ``*.safetensors`` files of folder
    ``path``: a model is read a fused parameter at a time, not held whole."""
    from functools import partial

    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        opened = safe_open(str(file), framework="pt")
        for name in opened.keys():
            yield name, partial(opened.get_tensor, name)
