"""The integrity gate on weight updates (``rollout.weight_check``): does each engine serve what the trainer sent?

Two checks, both on by default:

- **Digests**, after every update. The trainer digests each tensor it sends
  (:func:`digest_named` over the tensors handed over, :func:`digest_folder`
  over the safetensors folder written); every engine that declares the
  ``weight_digest`` capability digests the tensors it holds once the update
  has landed, after whatever layout change it made (fused, transposed, cast
  weights mapped back to the names, shapes and dtype the trainer sent), with
  the same function (an engine whose server hashes only its own layout
  computes instead, from what is sent, what its server will report:
  ``InferenceEngine.sent_digests``). The controller compares the two before the engine takes
  traffic again (:func:`compare_digests`).
- **The parity probe**, at the first update and every
  ``rollout.weight_probe_every``-th: a fixed short prompt is sampled by each
  engine at temperature 1 and the sampled tokens are scored by the trainer;
  the per-token logprobs must agree within a tolerance set by the dtype
  (:func:`probe_tolerance`). It catches what a digest of the stored weights
  cannot see: a kernel that reads them in the wrong dtype or layout.

The digest of one tensor (:func:`tensor_digest`) is ``"<dtype>[<shape>]:<hash>"``
where ``<hash>`` is the 16 hex digits of XXH3-64 (seed 0) over the tensor's
bytes in row-major order (native byte order, little-endian on every platform
areal runs on). XXH3 hashes at memory speed: 17.7 GB/s on one core of the
2-core test machine, as fast as a ``memcpy`` of the same bytes (blake2b: 0.8
GB/s, sha1 1.7, crc32 3.6), so a full digest of SmolLM2-135M in bf16 (270 MB)
takes ~15 ms per side. ``sample`` hashes 16 evenly spaced 4 KiB blocks of each
tensor larger than 64 KiB (the whole of smaller ones): a tensor skipped,
permuted or overwritten is still caught, a few flipped elements may not be.

Torch is imported only by the functions that need it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

WEIGHT_CHECK_MODES = ("on", "sample", "off")
SAMPLE_BLOCK_BYTES = 4096
SAMPLE_BLOCKS = 16
# The parity probe: a fixed prompt (ids below 100 exist in every vocabulary areal runs), sampled at temperature 1
# with a fixed seed, this many tokens.
PROBE_PROMPT_IDS = (17, 42, 7, 99, 3, 61, 28, 5, 64, 11)
PROBE_NEW_TOKENS = 8
PROBE_SEED = 20261126
# The probe's request id starts so (the version follows): an engine that serves its first steps after a load from
# something other than what it will serve later (the embedded engine, rebuilding its packed copies in the
# background) finishes that before it answers the probe, so the probe checks what it serves from then on.
PROBE_RID_PREFIX = "areal-weight-probe-v"
# What an engine reports, as ``"not checkable: <why>"``, for a tensor it holds in a form it cannot map back to what
# was sent (quantised, split over ranks, repacked before it could be read): skipped by :func:`compare_digests`,
# named in the run log (:func:`not_checkable`).
NOT_CHECKABLE = "not checkable"


class WeightCheckError(RuntimeError):
    """An inference engine does not serve the weights the trainer sent (a digest or the parity probe differs)."""

    def __init__(self, engine: str, version: int, what: str, differences: list[str]) -> None:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        super().__init__(
            f"inference server {engine} does not serve the weights of version {version} the trainer sent "
            f"({what}): {shown}. It was taken out of routing. The engine changed the weights on the way in "
            "(a layout or dtype bug in its loader, a bucket it skipped); see its log. rollout.elastic.enabled=true "
            "drops and reloads such a server instead of stopping the run; rollout.weight_check=off turns the check "
            "off (not advised)")
        self.engine, self.version, self.what, self.differences = engine, version, what, differences


@dataclass
class SentDigests:
    """What the trainer sent for one version: per tensor name, its :func:`tensor_digest`."""

    version: int
    mode: str
    digests: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # the trainer's time to compute them


def check_mode(mode: str) -> str:
    if mode not in ("on", "sample"):
        raise ValueError(f"weight digest mode {mode!r}: choose 'on' (every byte) or 'sample' "
                         f"({SAMPLE_BLOCKS} blocks of {SAMPLE_BLOCK_BYTES} bytes per tensor)")
    return mode


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _digest_bytes(data: Any, dtype: str, shape: Iterable[int], mode: str) -> str:
    """The digest of a tensor given as its raw bytes (a buffer: numpy array, memoryview)."""
    import xxhash

    nbytes = memoryview(data).nbytes
    if check_mode(mode) == "on" or nbytes <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
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
    """``"<dtype>[<shape>]:<xxh3-64 hex>"`` of a torch tensor's bytes in row-major order (see the module)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return _digest_bytes(data, _dtype_name(t.dtype), t.shape, mode)


def digest_named(named_tensors: Iterable[tuple[str, Any]], mode: str = "on", workers: int = 1) -> dict[str, str]:
    """:func:`tensor_digest` of every (name, tensor); a tensor given under several names is hashed once.

    ``workers`` > 1: hashed on that many threads (xxhash releases the GIL while it hashes), for a machine whose
    one core reads memory well below what several do (a 16-core server VM: ~5.5 GB/s on one thread)."""
    named = list(named_tensors)
    keys = [(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) if tensor.numel()
            else ("empty", name) for name, tensor in named]
    first = {}  # key -> the first tensor under it
    for key, (_, tensor) in zip(keys, named):
        first.setdefault(key, tensor)
    if workers > 1 and len(first) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(workers, len(first)), thread_name_prefix="areal-digest") as pool:
            digests = dict(zip(first, pool.map(lambda t: tensor_digest(t, mode), first.values())))
    else:
        digests = {key: tensor_digest(tensor, mode) for key, tensor in first.items()}
    return {name: digests[key] for key, (name, _) in zip(keys, named)}


# safetensors' dtype codes, as torch names them
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def digest_folder(path: str | Path, mode: str = "on") -> dict[str, str]:
    """:func:`tensor_digest` of every tensor in the ``*.safetensors`` files of folder ``path``, hashed straight
    from the memory-mapped file (no copy, no torch): the same digests as of the tensors loaded."""
    import json
    import mmap
    import struct

    out: dict[str, str] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                (length,) = struct.unpack("<Q", view[:8])
                header = json.loads(bytes(view[8:8 + length]))
                for name, info in header.items():
                    if name == "__metadata__":
                        continue
                    begin, end = info["data_offsets"]
                    dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
                    out[name] = _digest_bytes(view[8 + length + begin:8 + length + end], dtype, info["shape"], mode)
            finally:
                view.release()
    return out


def digest_weights(weights: str | Path | Iterable[tuple[str, Any]], mode: str = "on") -> dict[str, str]:
    """The trainer's digests of what it sends: :func:`digest_folder` of a folder's path, :func:`digest_named` of
    (name, tensor) pairs. What :meth:`InferenceEngine.sent_digests
    <areal_core.api.inference.InferenceEngine.sent_digests>` returns unless an engine overrides it."""
    if isinstance(weights, (str, Path)):
        return digest_folder(weights, mode)
    return digest_named(weights, mode)


def compare_digests(sent: dict[str, str], held: dict[str, str]) -> list[str]:
    """Each tensor the trainer sent that the engine does not hold as sent, as ``"name: why"``. Tensors the engine
    holds beyond those sent (buffers, a tied alias the trainer left out) are not judged, nor those either side
    marks :data:`NOT_CHECKABLE` (the engine: held in a form it cannot map back; the trainer's side, an engine's
    ``sent_digests``: sent in a form it cannot say what the server will report for) (:func:`not_checkable`
    lists them)."""
    differences = []
    for name, digest in sent.items():
        got = held.get(name)
        if digest.startswith(NOT_CHECKABLE) or (isinstance(got, str) and got.startswith(NOT_CHECKABLE)):
            continue
        if got is None:
            differences.append(f"{name}: sent {digest}, the engine reports no such tensor")
        elif not isinstance(got, str):
            differences.append(f"{name}: sent {digest}, the engine reports {got!r}, not a digest")
        elif got != digest:
            differences.append(f"{name}: sent {digest}, the engine holds {got}")
    return differences


def not_checkable(sent: dict[str, str], held: dict[str, str]) -> dict[str, str]:
    """The tensors sent that either side marks :data:`NOT_CHECKABLE`, each with its reason (the trainer side's
    first)."""
    out = {}
    for name, digest in sent.items():
        marked = digest if digest.startswith(NOT_CHECKABLE) else held.get(name, "")
        if isinstance(marked, str) and marked.startswith(NOT_CHECKABLE):
            out[name] = marked.partition(":")[2].strip() or marked
    return out


# ------------------------------------------------------------------ the parity probe
def probe_tolerance(dtype: str) -> tuple[float, float]:
    """(largest per-token difference, largest mean difference) of logprobs allowed between an engine and the
    trainer, in nats, when the engine computes in ``dtype``. Measured on SmolLM2-135M (12 probes of 8 tokens): the
    embedded engine in bf16 (packed linears, lean decode) against the HF model in float32 differs by at most
    0.30 nats on a token and 0.077 on a probe's mean; in float32 by under 1e-4. The bounds leave a 3x margin
    for larger models; a loader or kernel bug moves logprobs by whole nats."""
    if dtype in ("bfloat16", "float16"):
        return 1.0, 0.25
    return 0.05, 0.01


def _logprob(value: Any) -> float | None:
    """A logprob as a float; None for what is none (null, NaN, text, +inf: no logprob is positive)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) or value == math.inf else value


def compare_probe(tokens: list[int], engine_logprobs: list[Any], trainer_logprobs: list[Any],
                  dtype: str) -> list[str]:
    """The probe tokens whose logprobs differ past :func:`probe_tolerance`, as ``"token i (id t): engine x,
    trainer y"``; when only the mean is past its bound, one line saying so.

    A logprob that is missing, null, NaN or +inf on either side is a difference, named as such (a model that
    gives NaN serves nothing, and NaN compares as no gap). -inf on both sides (a token both call impossible)
    agrees; -inf on one side only is a difference."""
    if len(engine_logprobs) != len(tokens) or len(trainer_logprobs) != len(tokens):
        return [f"{len(tokens)} probe tokens but {len(engine_logprobs)} engine and {len(trainer_logprobs)} "
                "trainer logprobs"]
    per_token, mean_bound = probe_tolerance(dtype)
    out, gaps = [], []
    for i, (t, a_raw, b_raw) in enumerate(zip(tokens, engine_logprobs, trainer_logprobs)):
        a, b = _logprob(a_raw), _logprob(b_raw)
        if a is None or b is None:
            bad = " and ".join(side for side, v in (("engine", a), ("trainer", b)) if v is None)
            out.append(f"token {i} (id {t}): engine {a_raw!r}, trainer {b_raw!r} (the {bad} gave no finite "
                       f"logprob)")
            continue
        if a == b:  # equal, -inf included
            gaps.append(0.0)
            continue
        gap = abs(a - b)  # inf when one side only is -inf
        gaps.append(gap)
        if gap > per_token:
            out.append(f"token {i} (id {t}): engine {a:.4f}, trainer {b:.4f}")
    finite = [g for g in gaps if math.isfinite(g)]
    mean = sum(finite) / len(finite) if finite else 0.0
    if not out and mean > mean_bound:
        out.append(f"mean difference {mean:.4f} nats over {len(gaps)} tokens (at most {mean_bound} in {dtype})")
    elif out:
        out.append(f"allowed per token in {dtype}: {per_token} nats")
    return out


def probe_due(update: int, every: int) -> bool:
    """The parity probe runs at the first update of a run (``update`` 1) and every ``every``-th after."""
    return every > 0 and (update == 1 or update % every == 0)
