"""Training tokens/s: the fsdp engine's packed micro-batches vs a padded Hugging Face forward/backward.

    .venv/bin/python benchmarks/training.py [--model small|demo|DIR] [--dtype float32|bfloat16]
                                            [--groups 4] [--group-size 8] [--mb-max-tokens 2048]
                                            [--hf-micro-batch 8] [--steps 1]

Model: ``small`` (default), a random Llama of 4 layers, hidden 256, vocab
8,192 (5.0 M parameters), built in a temporary folder; ``demo``, SmolLM2-135M
from ``areal_core.models.resolve_model_path("")`` (converted once by
``areal-plugin-local``, ~30 s); or an HF model folder.

The batch is RL-shaped: ``--groups`` prompts of 24 to 64 tokens, each with
``--group-size`` completions whose lengths are long-tailed (log-normal, median
48 tokens, capped at 512: most are short, a few are long), random token ids
(seeded). Both sides train on exactly these sequences with the same loss
(token mean over completion tokens of ``-advantage * logprob``) and the same
AdamW step, from the same initial weights, in ``--dtype`` (float32 master
weights; bfloat16 computes under ``torch.autocast``):

- packed: ``FSDPEngine.train_batch`` at world size 1: sequences packed into
  one-row micro-batches of at most ``--mb-max-tokens`` tokens (no padding
  token), logprobs computed only at completion tokens.
- padded: the layout of TRL's GRPO trainer: micro-batches of
  ``--hf-micro-batch`` sequences in batch order, prompts left-padded and
  completions right-padded to the longest in the micro-batch, one HF
  ``model(input_ids, attention_mask, logits_to_keep=...)`` call each, the
  completion logits' log-softmax gathered at the next tokens, gradients
  accumulated, one optimizer step.

Each step's time is wall clock (median of ``--steps`` after one warm-up);
tokens/s counts the batch's real tokens (prompt + completion). "padding" is
the share of the token slots a side computes that are padding. "limit" is
the share of this machine's compute limit (``../shared/FEASIBILITY.md``):
6 x parameters FLOP per trained token at the square-GEMM rate of the dtype
(2 threads: fp32 ~200, bf16 ~600 GFLOP/s). The first-step losses of the two
sides are printed: they agree (same function, different layout). No pass / fail.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

GEMM_GFLOPS = {"float32": 200.0, "bfloat16": 600.0}  # FEASIBILITY.md, square GEMM, 2 threads
SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=True)


def model_folder(arg: str, tmp: Path) -> Path:
    if arg == "small":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp / "small")
        return tmp / "small"
    if arg == "demo":
        from areal_core.models import resolve_model_path

        return Path(resolve_model_path(""))
    if not Path(arg).is_dir():
        sys.exit(f"training.py: --model {arg!r} is not 'small', 'demo' or a model folder")
    return Path(arg)


def rl_batch(groups: int, group_size: int, vocab: int, seed: int = 0) -> dict:
    """Packed like ``areal_core.rollout.pack_groups``: prompts repeated per group, long-tailed completions."""
    rng = random.Random(seed)
    out: dict = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "advantages", "seq_lens", "prompt_lens")}
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(24, 65))]
        for _ in range(group_size):
            n = min(512, max(4, int(rng.lognormvariate(math.log(48), 0.9))))
            ids = prompt + [rng.randrange(3, vocab) for _ in range(n)]
            adv = rng.uniform(-1, 1)
            out["input_ids"] += ids
            out["position_ids"] += list(range(len(ids)))
            out["loss_mask"] += [0] * len(prompt) + [1] * n
            out["advantages"] += [adv] * len(ids)
            out["seq_lens"].append(len(ids))
            out["prompt_lens"].append(len(prompt))
    out["cu_seqlens"] = [0]
    for n in out["seq_lens"]:
        out["cu_seqlens"].append(out["cu_seqlens"][-1] + n)
    return out


def pg_loss(logprobs, entropy, mb):
    mask = mb["loss_mask"].float()
    return -(mb["advantages"] * logprobs * mask).sum() / mask.sum(), {}


def packed_side(folder: Path, dtype: str, mb_max_tokens: int, lr: float):
    from areal_core.api import Context
    from areal_core.config.schema import RunConfig
    from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(folder), dtype
    cfg.actor.mb_max_tokens = mb_max_tokens
    cfg.actor.optimizer.lr = lr
    engine = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(), extras={"role": "actor"}))
    engine.initialize()
    return engine


class PaddedHF:
    """The padded baseline: TRL-style left-padded prompts, right-padded completions, plain HF forward."""

    def __init__(self, folder: Path, dtype: str, micro_batch: int, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        self.model.config.use_cache = False
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.micro_batch = micro_batch
        self.autocast = dtype == "bfloat16"
        self.slots = 0

    def micro_batches(self, batch: dict):
        cu, P = batch["cu_seqlens"], batch["prompt_lens"]
        seqs = [(batch["input_ids"][a:b], p, batch["advantages"][a]) for a, b, p in zip(cu[:-1], cu[1:], P)]
        for i in range(0, len(seqs), self.micro_batch):
            chunk = seqs[i:i + self.micro_batch]
            pmax = max(p for _, p, _ in chunk)
            cmax = max(len(ids) - p for ids, p, _ in chunk)
            ids = torch.zeros(len(chunk), pmax + cmax, dtype=torch.long)
            attn = torch.zeros_like(ids)
            cmask = torch.zeros(len(chunk), cmax)
            for r, (s, p, _) in enumerate(chunk):
                c = len(s) - p
                ids[r, pmax - p:pmax + c] = torch.tensor(s)
                attn[r, pmax - p:pmax + c] = 1
                cmask[r, :c] = 1
            adv = torch.tensor([a for _, _, a in chunk])
            yield ids, attn, cmask, adv, pmax, cmax

    def step(self, batch: dict) -> float:
        n_loss = sum(batch["loss_mask"])
        total, self.slots = 0.0, 0
        self.optimizer.zero_grad(set_to_none=True)
        for ids, attn, cmask, adv, pmax, cmax in self.micro_batches(batch):
            self.slots += ids.numel()
            # Position ids count real tokens only, as HF generation gives them to a left-padded prompt.
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else torch.autocast("cpu", enabled=False)
            with ctx:
                logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                                    logits_to_keep=cmax + 1).logits[:, :-1].float()
            logp = logits.log_softmax(-1).gather(-1, ids[:, pmax:, None]).squeeze(-1)
            loss = -(adv[:, None] * logp * cmask).sum() / n_loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return total


def timed(fn, steps: int) -> tuple[float, float]:
    first = fn()  # warm-up; its value (the loss) is reported
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="small | demo | an HF model folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--mb-max-tokens", type=int, default=2048)
    parser.add_argument("--hf-micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    lr = 1e-6  # small: the weights stay near their start, so both sides time the same function

    with tempfile.TemporaryDirectory(prefix="areal-train-bench-") as tmp:
        folder = model_folder(args.model, Path(tmp))
        engine = packed_side(folder, args.dtype, args.mb_max_tokens, lr)
        vocab = engine.lm.config.vocab_size
        batch = rl_batch(args.groups, args.group_size, vocab)
        T = len(batch["input_ids"])
        n_params = sum(p.numel() for p in engine.lm.parameters())
        lens = sorted(n - p for n, p in zip(batch["seq_lens"], batch["prompt_lens"]))
        print(f"model: {args.model} ({n_params / 1e6:.1f} M parameters), {args.dtype}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; batch: {len(lens)} sequences, {T} tokens "
              f"({sum(batch['loss_mask'])} completion tokens; completion lengths min {lens[0]}, "
              f"median {lens[len(lens) // 2]}, max {lens[-1]}); median of {args.steps} steps after a warm-up")
        limit = GEMM_GFLOPS[args.dtype] * 1e9 / (6 * n_params)

        stats_box: dict = {}

        def packed_step() -> float:
            stats = engine.train_batch(batch, pg_loss)
            stats_box.update(stats)
            return stats["loss"]

        t_packed, loss_packed = timed(packed_step, args.steps)
        n_micro = int(stats_box["n_micro_batches"])
        engine.close()
        hf = PaddedHF(folder, args.dtype, args.hf_micro_batch, lr)
        t_hf, loss_hf = timed(lambda: hf.step(batch), args.steps)

        for name, t, pad, note in (
                ("packed (fsdp engine)", t_packed, 0.0, f"{n_micro} micro-batch(es) <= {args.mb_max_tokens} tok"),
                ("padded (HF, TRL layout)", t_hf, 1 - T / hf.slots,
                 f"{math.ceil(len(lens) / args.hf_micro_batch)} micro-batch(es) of {args.hf_micro_batch}")):
            print(f"  {name:24s} {T / t:9.0f} tok/s  step {t:6.2f} s  padding {pad:5.1%}  "
                  f"limit {T / t / limit:5.1%}  ({note})")
        print(f"  packed / padded: {t_hf / t_packed:.2f}x tokens/s; first-step loss {loss_packed:.6f} vs "
              f"{loss_hf:.6f}")


if __name__ == "__main__":
    main()
