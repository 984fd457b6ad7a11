"""Training tokens/s of the megatron engine against the fsdp engine, on the same RL-shaped batch, one process.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/megatron_training.py [--model small|demo|DIR]
                                            [--groups 4] [--group-size 8] [--mb-max-tokens 2048] [--steps 2]

Model and batch as ``benchmarks/training.py`` (whose helpers this imports):
``small`` is a random Llama of 4 layers, hidden 256, vocab 8,192 (9.5 M
parameters); the batch has ``--groups`` prompts x ``--group-size``
long-tailed completions. float32 (the megatron engine refuses bfloat16 on
CPU). Both engines start from the same weights and take the same loss
(``-advantage * logprob``, token mean over completion tokens) and AdamW step:

- fsdp: ``FSDPEngine.train_batch`` (packed rows, attention per sequence,
  logprobs at loss tokens only).
- megatron: ``MegatronEngine.train_batch`` at t1 (packed rows with a
  block-diagonal mask over the whole row in Megatron's local attention,
  vocab-parallel log-softmax at every position).

Prints each side's median step time over ``--steps`` (after one warm-up),
real tokens/s, the first-step losses (they agree: the same function) and the
share of this machine's float32 compute limit (6 x parameters FLOP per token
at ~200 GFLOP/s, ../shared/FEASIBILITY.md). No pass / fail.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from training import model_folder, packed_side, pg_loss, rl_batch, timed  # noqa: E402

GEMM_GFLOPS_FP32 = 200.0


def megatron_side(folder: Path, mb_max_tokens: int, lr: float):
    from areal_core.api import Context
    from areal_core.config.allocation import parse_allocation
    from areal_core.config.schema import RunConfig
    from areal_megatron.engine import MegatronEngine, MegatronEngineConfig

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(folder), "float32"
    cfg.actor.mb_max_tokens = mb_max_tokens
    cfg.actor.optimizer.lr = lr
    (placement,) = parse_allocation("megatron:cpu").components
    engine = MegatronEngine.create(Context(config=cfg, options=MegatronEngineConfig(), placement=placement,
                                           extras={"role": "actor"}))
    engine.initialize()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--mb-max-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(folder).vocab_size
        batch = rl_batch(args.groups, args.group_size, vocab)
        tokens = len(batch["input_ids"])
        print(f"batch: {len(batch['seq_lens'])} sequences, {tokens} tokens, "
              f"{sum(batch['loss_mask'])} loss tokens; float32; mb_max_tokens {args.mb_max_tokens}")
        results = {}
        for name, build in (("fsdp", lambda: packed_side(folder, "float32", args.mb_max_tokens, 1e-5)),
                            ("megatron", lambda: megatron_side(folder, args.mb_max_tokens, 1e-5))):
            engine = build()
            params = sum(p.numel() for p in (engine._parameters() if name == "megatron" else engine.lm.parameters()))
            median, warm_up = timed(lambda: engine.train_batch(batch, pg_loss), args.steps)
            first = warm_up["loss"]
            engine.close()
            limit = tokens * 6 * params / (GEMM_GFLOPS_FP32 * 1e9)
            results[name] = median
            print(f"{name:9s} step {median:7.3f} s  {tokens / median:8.0f} tokens/s  first loss {first:+.6f}  "
                  f"limit share {limit / median:5.1%}")
        print(f"megatron / fsdp step time: {results['megatron'] / results['fsdp']:.2f}x")


if __name__ == "__main__":
    main()
