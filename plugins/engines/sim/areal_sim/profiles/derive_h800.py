"""Build the shipped H800 profiles from kernel timings measured on an H100 and the H800's published links.

    python -m areal_sim.profiles.derive_h800            # rewrites the *-h800.yaml files beside this script
    python -m areal_sim.profiles.derive_h800 --check    # exit 1 if a shipped file differs from what this derives

Where each number comes from:

- **Compute, measured** (``measured/h100-*.json``, by ``measure_gpu.py`` on one
  H100 80GB HBM3 SXM lent to a session on 2026-11-26, PyTorch 2.11 + CUDA 13,
  bfloat16). The H800 SXM5 is the same GH100 chip with the same SMs, clocks and
  80 GB of HBM3 at 3.35 TB/s; it differs in NVLink (400 GB/s instead of 900) and
  FP64. So the decode step (a CUDA graph of every layer of the server's shard
  and the LM head; per cell the faster of attention over the whole context and
  attention split along it, both measured), prefill per token and training per
  token (forward and backward of a layer over 8,192 tokens times the layers,
  plus the LM head and loss; with activation recomputation, the usual setting
  for these sizes) are the H100's.
- **Links, from NVIDIA's H800 datasheet and the AReaL paper's cluster**: nodes of
  8 GPUs with NVLink at 400 GB/s per GPU (we take 150 GB/s of it for a
  server's tensor-parallel all-reduces, 2 per layer per step, 10 us each at
  least), 400 Gbit/s per GPU between nodes (8 x 400G NICs), which the training
  all-reduce (at 80 %) and the weight transfer run at.
- **Assumed, not measured**: 2 ms of the serving engine's CPU-side work per
  decode step (scheduling, sampling, detokenising; CUDA graphs hide the kernel
  launches); the optimizer step and FSDP's parameter gathers overlapped with
  compute (only the gradient all-reduce is charged); KV capacity of 90 % of the
  HBM left after the BF16 weights.
- **Models** (their Hugging Face configs): the Qwen2.5 bases of the
  DeepSeek-R1-Distill-Qwen models the AReaL paper trains, 1.5B / 7B / 14B / 32B,
  one server per 1 / 1 / 2 / 4 GPUs.
- **Response lengths** (assumed for long reasoning traces): log-normal with
  median 5,000 and sigma 0.8, cut at 32,768 tokens (the AReaL paper's generation
  limit is of that order; mean about 6,800, 1 % at the cap); prompts of 400 tokens.

``roofline_decode_s`` is the datasheet bound (weights and KV cache read once per
step at 3.35 TB/s): no measured step may beat it, which a test checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
MEASURED = [HERE / "measured" / "h100-unsplit.json", HERE / "measured" / "h100-split.json"]
GPU = {"name": "H800-SXM5-80GB", "bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12, "hbm_bytes": 80e9,
       "link_gbps": 400.0}
ASSUMED = {"step_cpu_s": 0.002, "tp_allreduce_bytes_per_s": 150e9, "tp_allreduce_latency_s": 10e-6,
           "allreduce_link": 0.80, "kv_fraction": 0.90, "pipeline_microbatches": 8}
# name: (parameters, layers, hidden, kv_heads, head_dim, tensor parallel of one server)
MODELS = {
    "qwen2.5-1.5b": (1.54e9, 28, 1536, 2, 128, 1),
    "qwen2.5-7b": (7.62e9, 28, 3584, 4, 128, 1),
    "qwen2.5-14b": (14.7e9, 48, 5120, 8, 128, 2),
    "qwen2.5-32b": (32.8e9, 64, 5120, 8, 128, 4),
}
LENGTHS = {"median": 5000, "sigma": 0.8, "cap": 32768, "prompt": 400}


def measured() -> dict:
    """Per model: the decode table (the faster of the two attention variants per cell), prefill and training."""
    runs = [json.loads(path.read_text()) for path in MEASURED]
    out = {}
    for name in MODELS:
        decodes = [run["models"][name]["decode"] for run in runs]
        seconds = [[min(d["seconds"][i][j] for d in decodes) for j in range(len(decodes[0]["context"]))]
                   for i in range(len(decodes[0]["batch"]))]
        out[name] = {"batch": decodes[0]["batch"], "context": decodes[0]["context"], "decode": seconds,
                     "prefill": min(run["models"][name]["prefill_s_per_token"] for run in runs),
                     "train": min(run["models"][name]["train"]["s_per_token_recompute"] for run in runs)}
    return out


def tp_allreduce_s(tp: int, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` across a server's ``tp`` GPUs over NVLink (ring: 2 (tp - 1) / tp of the bytes)."""
    if tp <= 1:
        return 0.0
    return ASSUMED["tp_allreduce_latency_s"] + 2 * (tp - 1) / tp * nbytes / ASSUMED["tp_allreduce_bytes_per_s"]


def roofline_decode_s(name: str, batch: int, context: int) -> float:
    """The datasheet's bound on one decode step: the shard's weights and every request's KV cache read once at the
    full HBM bandwidth, nothing else."""
    params, layers, _, kv_heads, head_dim, tp = MODELS[name]
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2
    return (2 * params + batch * context * kv_bytes_per_token) / tp / GPU["hbm_bytes_per_s"]


def derive(name: str, data: dict | None = None) -> str:
    params, layers, hidden, kv_heads, head_dim, tp = MODELS[name]
    m = (data or measured())[name]
    weight_bytes = 2 * params
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2

    def decode_step(i: int, batch: int, j: int) -> float:
        # the GPU's part; the CPU's (ASSUMED["step_cpu_s"]) is the profile's inference.step_cpu_s, added on load
        return m["decode"][i][j] + 2 * layers * tp_allreduce_s(tp, batch * hidden * 2)

    rows = "\n".join(f"      - [{', '.join(f'{decode_step(i, b, j):.6g}' for j in range(len(m['context'])))}]"
                     f"  # batch {b}" for i, b in enumerate(m["batch"]))
    # prefill: the all-reduces' bytes per token (their latency spreads over a chunk of thousands of tokens)
    prefill = m["prefill"] + (2 * layers * 2 * (tp - 1) / tp * hidden * 2 / ASSUMED["tp_allreduce_bytes_per_s"]
                              if tp > 1 else 0.0)
    kv_capacity = int((GPU["hbm_bytes"] * tp - weight_bytes) * ASSUMED["kv_fraction"] / kv_bytes_per_token)
    link = GPU["link_gbps"]
    return f"""# Generated by derive_h800.py (python -m areal_sim.profiles.derive_h800); edit that, not this.
name: {name}-h800
gpu: {GPU["name"]}
source: >-
  Compute measured, links from the datasheet: decode steps, prefill and training timed on an H100 80GB HBM3
  (the H800's chip, SMs and memory) by measure_gpu.py on 2026-11-26 (measured/h100-*.json; training with
  activation recomputation); one server on {tp} GPU(s), its tensor-parallel all-reduces over NVLink
  ({ASSUMED["tp_allreduce_bytes_per_s"] / 1e9:g} GB/s, {ASSUMED["tp_allreduce_latency_s"] * 1e6:g} us each) and
  {ASSUMED["step_cpu_s"] * 1e3:g} ms of CPU-side work per decode step assumed; {link:g} Gbit/s per GPU between
  nodes (all-reduce at {ASSUMED["allreduce_link"]:.0%}); a training pipeline fed {ASSUMED["pipeline_microbatches"]}
  micro-batches a step; the model's Hugging Face config ({params / 1e9:g}B
  parameters, {layers} layers, {kv_heads} KV heads of {head_dim}). Every input is listed in derive_h800.py.
params: {params:g}
inference:
  tp: {tp}
  prefill_s_per_token: {prefill:.6g}
  kv_capacity_tokens: {kv_capacity}
  step_cpu_s: {ASSUMED["step_cpu_s"]:g}  # assumed; areal simulate sim.step_cpu_ms=... replaces it
  decode_step_s:
    batch: {m["batch"]}
    context: {m["context"]}
    seconds:
{rows}
train:
  s_per_token_per_gpu: {m["train"]:.6g}
  grad_bytes: {weight_bytes:g}
  allreduce_gbps: {link * ASSUMED["allreduce_link"]:g}
  allreduce_latency_s: 1.0e-05
  layers: {layers}
  hidden: {hidden}
  tp_link_gbps: {ASSUMED["tp_allreduce_bytes_per_s"] * 8 / 1e9:g}
  tp_latency_s: {ASSUMED["tp_allreduce_latency_s"]:.1e}
  pipeline_microbatches: {ASSUMED["pipeline_microbatches"]}
weights:
  bytes: {weight_bytes:g}
  link_gbps: {link:g}
  latency_s: 0.05
lengths: {{median: {LENGTHS["median"]}, sigma: {LENGTHS["sigma"]}, cap: {LENGTHS["cap"]}, prompt: {LENGTHS["prompt"]}}}
"""


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    data = measured()
    for name in MODELS:
        path = HERE / f"{name}-h800.yaml"
        text = derive(name, data)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"differ from what derive_h800.py derives: {', '.join(stale)}; run python -m areal_sim.profiles."
              f"derive_h800 to rewrite them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
