"""The embedded engine's packed-weight rebuild after a weight load, and the decode steps that run on it.

    nice -n 19 .venv/bin/python benchmarks/repack.py [--dtype float32|bfloat16|both] [--repeats 7] [--steps 24]

Model: a random Llama with SmolLM2-135M's shapes (``weight_sync.SMOLLM2_135M``), in memory. Torch runs on one
thread and so does the rebuild (the server spreads it over ``areal_local.server.LOAD_WORKERS`` threads of one
torch thread each, which ``benchmarks/weight_sync.py`` times; decoding on one thread keeps the comparison
steady on a shared machine), after ``areal_core.allocator.retain_freed_memory`` (as the server).

Two ways to rebuild the derived copies (``Generator._refresh_derived``: every linear's oneDNN-packed copy and
the lean decoder's fused q/k/v):

- baseline: ``packed.copy_(weight.to_mkldnn())``, what ``areal_local.packed.repack`` did before: mkldnn
  ``copy_`` gives the destination the source's plain layout, so the "packed" copies are no longer packed and
  every matmul reorders its weight again;
- ours: ``repack`` as it is, oneDNN's packed layout written in place by one strided copy.

Rows: the rebuild (median of ``--repeats`` after a warm-up; ours' first rebuild also checks its layout plans
against oneDNN, once per process and shape), a libc-style ``copy_`` of the same bytes, and greedy decoding of
16 requests for ``--steps`` tokens after a rebuild (ms per step), with whether both ways produced the same
tokens. The two ways alternate twice on one generator (each row: the median of its two rounds; the first
rebuild after the baseline's plain copies is a fresh packing). No pass / fail.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from areal_core.allocator import retain_freed_memory
from weight_sync import SMOLLM2_135M, timed


def plain_copy_repack(packed, weight):
    """The rebuild before: a plain-layout copy (see the module docstring)."""
    if packed is not None and packed.shape == weight.shape and packed.dtype == weight.dtype:
        packed.copy_(weight.to_mkldnn())
        return packed
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def decode_ms(gen, steps: int) -> tuple[float, list]:
    from areal_core.api.inference import SamplingParams

    for r in range(16):
        gen.add(f"r{r}", [1 + r, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=steps, temperature=0.0))
    gen.step()  # prefill
    began, n, done = time.perf_counter(), 0, []
    while gen.num_running or gen.num_waiting:
        done += gen.step()
        n += 1
    return (time.perf_counter() - began) / n * 1e3, sorted((f.rid, tuple(f.output_ids)) for f in done)


def run(dtype: torch.dtype, repeats: int, steps: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import areal_local.lean_decode as lean_decode
    import areal_local.packed as packed
    from areal_local.generator import Generator

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(dtype).eval()
    gen = Generator(model, eos_token_ids=[])
    if gen._packed is None:
        print(f"{dtype}: no oneDNN packing on this CPU (packing_available is False); nothing to compare")
        return
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    source = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    memcpy = timed(lambda: target.copy_(source), repeats)
    ours = packed.repack
    rows, tokens = {"ours": [], "baseline": []}, {}
    for name, repack in [("ours", ours), ("baseline", plain_copy_repack)] * 2:  # alternated: load drifts
        packed.repack = lean_decode.repack = repack
        try:
            with torch.no_grad():
                began = time.perf_counter()
                gen._refresh_derived()
                first = time.perf_counter() - began
                rebuild = timed(gen._refresh_derived, repeats)
                gen._refresh_derived()
            ms, tokens[name] = decode_ms(gen, steps)
        finally:
            packed.repack = lean_decode.repack = ours
        rows[name].append((first, rebuild, ms))
    rows = {name: [statistics.median(column) for column in zip(*runs)] for name, runs in rows.items()}
    print(f"{dtype}: parameters {nbytes / 2**20:.0f} MiB, copy_ of those bytes {memcpy:.3f} s (one thread)")
    for name, (first, rebuild, ms) in rows.items():
        print(f"  {name:8s} rebuild {rebuild:.3f} s = {rebuild / memcpy:.1f}x copy_ (first {first:.2f} s); "
              f"decode batch 16: {ms:.1f} ms/step")
    print(f"  decode ours / baseline {rows['ours'][2] / rows['baseline'][2]:.2f}; "
          f"rebuild ours / baseline {rows['ours'][1] / rows['baseline'][1]:.2f}; "
          f"same tokens: {tokens['ours'] == tokens['baseline']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    print(retain_freed_memory())
    torch.set_num_threads(1)
    for name in (["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]):
        run(getattr(torch, name), args.repeats, args.steps)


if __name__ == "__main__":
    main()
