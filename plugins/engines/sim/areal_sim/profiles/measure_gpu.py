"""Measure the compute side of a latency profile on the GPU at hand, with plain PyTorch.

    python -m areal_sim.profiles.measure_gpu --out measured.json [--models qwen2.5-1.5b,...] [--tiny]

What it times, for each model shard (the Qwen2.5 shapes below; a tensor-parallel
server's shard has heads and MLP columns divided by its ``tp``):

- **decode step**: every layer of the shard (its own weights: RMSNorm, fused QKV
  GEMM, attention of one new token per request over the request's KV cache
  (split along the context into chunks merged by log-sum-exp when the batch
  alone would leave multiprocessors idle, as flash-decoding kernels do),
  output GEMM, SwiGLU MLP) plus the LM head and a greedy pick, for a running
  batch ``B`` whose requests each hold ``C`` tokens of context. On CUDA the step
  is captured once as a CUDA graph and replayed, as serving engines run decode
  (launch overhead gone); elsewhere it runs eagerly. GQA decode is attention of
  the group's query heads as a length-``g`` query against the shared KV head,
  the usual trick, so PyTorch's fused attention kernels apply. All layers read
  one KV buffer (memory: one layer's cache, not all); a layer's cache past the
  L2 size is read from HBM each time as it would be.
- **prefill**: a forward pass of every layer over 8,192 prompt tokens (two causal
  sequences of 4,096), per token.
- **training**: forward and backward of one full-width layer over 8,192 tokens,
  times the layers, plus the LM head with its cross-entropy loss, per token.
  Reported both without and with activation recomputation (a second forward).

Not measured here and stated as assumptions by whoever builds a profile from
the output: the tensor-parallel all-reduces inside a server, the serving
engine's CPU-side scheduling per step, the optimizer step, and everything
between GPUs and nodes.

The output is JSON (every timing in seconds, with the GPU's name, PyTorch and
CUDA versions and the date), the data ``build_measured`` turns into profiles.
``--tiny`` runs toy shapes so the script itself can be tested on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """A Qwen2.5 model's shapes (from its Hugging Face config) and the tensor parallelism one server uses."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tp: int


MODELS = {
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 128, 151936, 1),
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 128, 152064, 1),
    "qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 128, 152064, 2),
    "qwen2.5-32b": Shape(5120, 27648, 64, 40, 8, 128, 152064, 4),
}
TINY = {"tiny": Shape(64, 160, 2, 4, 2, 16, 500, 1), "tiny-tp2": Shape(64, 160, 2, 4, 2, 16, 500, 2)}
BATCH = [1, 8, 32, 64, 128, 256, 512]
CONTEXT = [512, 2048, 8192, 16384, 32768]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, min_s: float = 0.2, min_reps: int = 3, max_reps: int = 50) -> float:
    """Mean seconds of ``fn()`` after two warm-up calls, repeated until ``min_s`` has passed (bounded)."""
    for _ in range(2):
        fn()
    _sync(device)
    reps, start = 0, time.perf_counter()
    while reps < min_reps or (time.perf_counter() - start < min_s and reps < max_reps):
        fn()
        reps += 1
        if reps >= min_reps:
            _sync(device)
    _sync(device)
    return (time.perf_counter() - start) / reps


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention that also returns the log-sum-exp of each query's scores."""
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out[0], out[1]


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int) -> torch.Tensor:
    """Decode attention with the context cut into ``splits`` chunks attended in parallel and merged by their
    log-sum-exps (flash-decoding, what serving engines do so that a small batch at a long context still fills
    the GPU). q [B, kv, g, d], k and v [B, kv, C, d] with C divisible by ``splits``."""
    if splits == 1:
        return F.scaled_dot_product_attention(q, k, v)
    B, kv, g, d = q.shape
    chunk = k.shape[2] // splits
    # [B, kv, C, d] is [B, kv * splits, chunk, d] without a copy: each chunk becomes a head of its own
    ks, vs = k.view(B, kv * splits, chunk, d), v.view(B, kv * splits, chunk, d)
    qs = q.unsqueeze(2).expand(B, kv, splits, g, d).reshape(B, kv * splits, g, d)
    out, lse = _flash(qs, ks, vs)
    out, lse = out.view(B, kv, splits, g, d), lse.view(B, kv, splits, g)
    weight = torch.softmax(lse, dim=2).unsqueeze(-1).to(out.dtype)
    return (out * weight).sum(dim=2)


def splits_for(batch: int, kv: int, context: int, blocks: int) -> int:
    """Enough chunks for ``blocks`` parallel (request, head, chunk) pieces, each chunk at least 256 tokens."""
    splits = 1
    while batch * kv * splits < blocks and context // (splits * 2) >= 256 and context % (splits * 2) == 0:
        splits *= 2
    return splits


class Shard:
    """The weights of one server's shard of every layer, and the decode / prefill passes over them."""

    def __init__(self, s: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = s, device, dtype
        self.q_heads, self.kv = s.heads // s.tp, max(1, s.kv_heads // s.tp)
        qkv = (self.q_heads + 2 * self.kv) * s.head_dim
        mlp = s.intermediate // s.tp

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.layers = [dict(norm1=torch.ones(s.hidden, device=device, dtype=dtype), qkv=w(qkv, s.hidden),
                            o=w(s.hidden, self.q_heads * s.head_dim), norm2=torch.ones(s.hidden, device=device,
                                                                                        dtype=dtype),
                            gate_up=w(2 * mlp, s.hidden), down=w(s.hidden, mlp)) for _ in range(s.layers)]
        self.head = w(s.vocab // s.tp, s.hidden)

    def _mlp(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(F.rms_norm(x, (self.s.hidden,), L["norm2"]), L["gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, L["down"])

    splits = 1  # chunks of the context attended in parallel (set per batch and context by measure_decode)

    def decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One decode step: ``x`` [B, hidden], caches [B, kv, C, d] (shared by every layer); a token id per row."""
        s, B = self.s, x.shape[0]
        g = self.q_heads // self.kv
        for L in self.layers:
            qkv = F.linear(F.rms_norm(x, (s.hidden,), L["norm1"]), L["qkv"])
            q = qkv[:, : self.q_heads * s.head_dim].view(B, self.kv, g, s.head_dim)
            attn = split_kv_attention(q, k_cache, v_cache, self.splits)
            x = x + F.linear(attn.reshape(B, -1), L["o"])
            x = self._mlp(L, x)
        return F.linear(x, self.head).argmax(dim=-1)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of every layer over ``x`` [sequences, T, hidden], causal attention."""
        s = self.s
        n, T = x.shape[0], x.shape[1]
        g = self.q_heads // self.kv
        for L in self.layers:
            qkv = F.linear(F.rms_norm(x, (s.hidden,), L["norm1"]), L["qkv"])
            q, k, v = qkv.split([self.q_heads * s.head_dim, self.kv * s.head_dim, self.kv * s.head_dim], dim=-1)
            q = q.view(n, T, self.q_heads, s.head_dim).transpose(1, 2)
            k = k.view(n, T, self.kv, s.head_dim).transpose(1, 2).repeat_interleave(g, dim=1)
            v = v.view(n, T, self.kv, s.head_dim).transpose(1, 2).repeat_interleave(g, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(n, T, -1), L["o"])
            x = self._mlp(L, x)
        return x


def measure_decode(shard: Shard, kv_budget_bytes: float, split: bool = True) -> dict:
    """Seconds of one decode step at every (batch, context) whose shared per-layer cache fits the budget."""
    s, device, dtype = shard.s, shard.device, shard.dtype
    per_token = 2 * shard.kv * s.head_dim * torch.finfo(dtype).bits // 8
    batches, contexts = (BATCH, CONTEXT) if s.vocab > 1000 else ([1, 4, 8], [16, 64, 128])
    biggest = max(b * c for b in batches for c in contexts if b * c * per_token <= kv_budget_bytes)
    k_all = torch.randn(biggest * shard.kv * s.head_dim, device=device, dtype=dtype)
    v_all = torch.randn_like(k_all)
    table: list[list[float | None]] = []
    # twice the multiprocessors: the (request, head, chunk) pieces a step needs to fill the GPU
    blocks = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    for b in batches:
        row: list[float | None] = []
        for c in contexts:
            if b * c * per_token > kv_budget_bytes:
                row.append(None)
                continue
            n = b * shard.kv * c * s.head_dim
            k = k_all[:n].view(b, shard.kv, c, s.head_dim)
            v = v_all[:n].view(b, shard.kv, c, s.head_dim)
            x = torch.randn(b, s.hidden, device=device, dtype=dtype)
            shard.splits = splits_for(b, shard.kv, c, blocks) if split else 1
            if device.type == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    shard.decode(x, k, v)  # warm the kernels' choices before capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    shard.decode(x, k, v)
                row.append(_timed(graph.replay, device))
                del graph
            else:
                row.append(_timed(lambda: shard.decode(x, k, v), device))
        table.append(row)
        print(f"  decode batch {b}: {['-' if t is None else f'{t * 1e3:.2f}ms' for t in row]}", flush=True)
    del k_all, v_all
    return {"batch": batches, "context": contexts, "seconds": table, "kv_bytes_per_token_per_layer": per_token}


def measure_prefill(shard: Shard, tokens: int) -> float:
    seqs = 2
    x = torch.randn(seqs, tokens // seqs, shard.s.hidden, device=shard.device, dtype=shard.dtype)
    with torch.no_grad():
        return _timed(lambda: shard.prefill(x), shard.device) / tokens


def measure_train(s: Shape, device: torch.device, dtype: torch.dtype, tokens: int) -> dict:
    """Forward and backward of one full-width layer (no tensor parallelism: FSDP trains the whole width) and of
    the LM head with its loss, per token; the per-token figures for the whole model."""
    full = Shard(Shape(s.hidden, s.intermediate, 1, s.heads, s.kv_heads, s.head_dim, s.vocab, 1), device, dtype)
    params = [p.requires_grad_() for p in full.layers[0].values()] + [full.head.requires_grad_()]
    seqs = 2
    x = torch.randn(seqs, tokens // seqs, s.hidden, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, s.vocab, (tokens,), device=device)

    def layer_forward() -> torch.Tensor:
        return full.prefill(x)

    def layer_both() -> None:
        layer_forward().float().pow(2).mean().backward()
        for p in params:
            p.grad = None
        x.grad = None

    h = torch.randn(tokens, s.hidden, device=device, dtype=dtype, requires_grad=True)

    def head_both() -> None:
        F.cross_entropy(F.linear(h, full.head).float(), labels).backward()
        full.head.grad = None
        h.grad = None

    with torch.no_grad():
        forward = _timed(layer_forward, device)
    both = _timed(layer_both, device)
    head = _timed(head_both, device)
    per_token = (both * s.layers + head) / tokens
    recompute = ((both + forward) * s.layers + head) / tokens
    return {"layer_forward_s": forward, "layer_forward_backward_s": both, "head_forward_backward_s": head,
            "tokens": tokens, "s_per_token": per_token, "s_per_token_recompute": recompute}


def params_of(s: Shape) -> float:
    """Parameters of the whole model (embedding and head untied, as in Qwen2.5 7B and up; close enough below)."""
    attn = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    return s.layers * (attn + 3 * s.hidden * s.intermediate) + 2 * s.vocab * s.hidden


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tiny", action="store_true", help="toy shapes, to test the script on a CPU")
    parser.add_argument("--kv-budget-gb", type=float, default=40.0)
    parser.add_argument("--no-split", action="store_true", help="decode attention without splitting the context")
    parser.add_argument("--tokens", type=int, default=8192, help="prefill / training tokens per measurement")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else {name: MODELS[name] for name in args.models.split(",")}
    tokens = 64 if args.tiny else args.tokens
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": datetime.date.today().isoformat(), "dtype": str(dtype).replace("torch.", ""),
              "decode_graphs": device.type == "cuda",
              "attention_split": not args.no_split, "models": {}}
    for name, s in shapes.items():
        start = time.perf_counter()
        print(f"{name} (tp {s.tp})", flush=True)
        with torch.no_grad():
            shard = Shard(s, device, dtype)
            decode = measure_decode(shard, args.kv_budget_gb * 1e9, split=not args.no_split)
            prefill = measure_prefill(shard, tokens)
        del shard
        train = measure_train(s, device, dtype, tokens)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["models"][name] = {"shape": asdict(s), "params": params_of(s), "decode": decode,
                                  "prefill_s_per_token": prefill, "train": train}
        print(f"  prefill {prefill * 1e6:.2f} us/token; train {train['s_per_token'] * 1e6:.2f} us/token "
              f"({train['s_per_token_recompute'] * 1e6:.2f} with recompute); {time.perf_counter() - start:.0f} s",
              flush=True)
        if not all(math.isfinite(t) for row in decode["seconds"] for t in row if t is not None):
            raise SystemExit(f"{name}: a decode timing is not finite")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
