"""areal against TRL's GRPOTrainer on the same model, task, prompts and budget, on CPU, side by side.

    .venv/bin/pip install "trl==1.16.0"          # once; not a dependency of areal
    .venv/bin/python benchmarks/vs_trl.py [--steps 30] [--eval-size 64] [--dtype auto|float32|bfloat16]
                                          [--trl-dtypes float32,bfloat16] [--seeds 1,2,3]
                                          [--areal-stop-at-newline] [--skip-trl] [--skip-sync]
                                          [--ppo 1x1,2x1,2x2]

What runs, one after the other in this invocation:

1. TRL ``GRPOTrainer`` (trl 1.16) configured the way its docs say for CPU:
   ``use_cpu=True``, no vLLM, fp32 (``bf16=False``), ``gradient_checkpointing=False``;
   and again with ``bf16=True`` (autocast over float32 weights), which is faster
   on CPUs with bf16 units (AMX / AVX512-BF16): ``--trl-dtypes`` picks which
   (default both). Ratios are taken against the faster TRL run, so areal is
   compared with TRL's best on this machine.
2. ``areal run`` with the built-in demo config at η = 4 (``rollout.max_head_offpolicyness=4``),
   in ``--dtype`` (default ``auto``, the demo's own: bfloat16 where the CPU has
   bf16 units, else float32).
3. The same at η = 0 (synchronous), unless ``--skip-sync``.
4. With ``--ppo KxE,...``: areal at η = 4 again for each pair, ``actor.ppo_minibatches=K``
   ``actor.ppo_epochs=E`` (K optimizer steps per pass over a batch, E passes: TRL's
   ``steps_per_generation`` / ``num_iterations`` mean the same); ``1x1`` is run 2's setting.
   A batch here is 2 prompt groups, so K is at most 2.

Matched settings (printed by the script): SmolLM2-135M-Instruct, the
few-shot addition task (``3+4=7\\n10+5=15\\n8+9=17\\n{a}+{b}=``, a, b in
0..20) from the ``arithmetic`` dataset with the same seed, so both see the
same prompts in the same order; reward 1 when the completion starts with the
sum (the ``arithmetic`` reward, used by both); 8 completions per prompt, 16
per step, 16 new tokens at temperature 1; learning rate 1e-5, AdamW, no
warmup, grad clip 1.0; loss: GRPO with group-std advantages, clip 0.2, no KL,
sequence-mean of token-mean (TRL ``loss_type="grpo"``, ``scale_rewards="group"``,
``beta=0``, ``num_iterations=1``; areal ``algorithm.name=grpo``).
Dynamic filtering is off on the areal side (TRL has none), so both generate exactly the
completions they train on. Completion length is matched too: TRL generates all 16 tokens (no stop string;
its reward reads only the start), so areal runs with ``dataset.stop_at_newline=false`` and does the same,
as its demo now does (``--areal-stop-at-newline`` ends each areal completion at its first newline instead:
~3 tokens, much less work per sample and a different loss, so not a like-for-like comparison).
The difference that remains: areal's decoupled PPO weights each token by pi_prox / pi_behav, the
trainer's probability over the inference engine's (1 up to the rounding of the engine's bf16 copy at η = 0).

Accuracy: greedy, the first ``--eval-size`` held-out problems of the task's
validation split, measured the same way for every model (HF ``generate`` on
the weights: the initial model, TRL's trained model, areal's final
checkpoint). Throughput: samples/s = completions trained / wall time of the
training loop (TRL ``trainer.train()``; areal: the ``areal run`` process,
which also starts the inference server and loads the model twice, so it is
reported both end to end and per step in steady state); generation tokens/s:
completion tokens / time spent generating (TRL: inside its generate call;
areal: the run's mean ``throughput/gen_tokens_per_s``).
No pass / fail: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
AREAL = str(Path(sys.executable).with_name("areal"))
GROUP, PER_STEP, NEW_TOKENS, LR = 8, 16, 16, 1e-5


def task_items(split: str, n: int, seed: int = 1) -> list[dict]:
    """The ``arithmetic`` dataset's items, exactly as an areal run with ``trainer.seed=seed`` sees them."""
    import itertools

    from areal_core.api import Context
    from areal_core.config.validate import validate_run

    run = validate_run(str(ROOT / "cli" / "areal_cli" / "demo.yaml"), [f"trainer.seed={seed}"])
    dataset = run.components["dataset"].create(Context(config=run.config, options=run.options.get("dataset"),
                                                       extras={"split": split}))
    return list(itertools.islice(iter(dataset), n))


def reward_fn():
    from areal_core.api import Context
    from areal_core.registry import resolve

    return resolve("reward", "arithmetic").create(Context())


def greedy_accuracy(model, tokenizer, items: list[dict], reward) -> float:
    """Greedy completions of every item's prompt (HF generate, left-padded batch); share scored 1."""
    tokenizer.padding_side = "left"
    prompts = [item["prompt"] for item in items]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = [reward(p, t, item) for p, t, item in zip(prompts, texts, items)]
    return sum(float(s["reward"] if isinstance(s, dict) else s) >= 1.0 for s in scores) / len(items)


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Accuracy is always measured in float32, the same way for every model.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


# --------------------------------------------------------------------- TRL
def run_trl(model_dir: Path, steps: int, val: list[dict], out_dir: Path, dtype: str, seed: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = reward_fn()
    train = task_items("train", steps * PER_STEP // GROUP, seed)
    data = Dataset.from_list([{"prompt": i["prompt"], "answer": i["answer"], "id": i["id"]} for i in train])

    def arithmetic_reward(prompts, completions, answer, **_):
        return [float(reward(p, c, {"answer": a, "style": "few_shot"})["reward"])
                for p, c, a in zip(prompts, completions, answer)]

    config = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=dtype == "bfloat16", fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=PER_STEP, gradient_accumulation_steps=1, num_generations=GROUP,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        loss_type="grpo", scale_rewards="group", beta=0.0, epsilon=0.2, num_iterations=1,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to=[], shuffle_dataset=False,
        seed=seed, dataloader_num_workers=0,
    )
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_args, **_kw):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=arithmetic_reward, args=config, train_dataset=data,
                          callbacks=[Stamp()])
    gen = {"s": 0.0, "tokens": 0}
    inner = trainer._generate_single_turn

    def timed(*a, **kw):
        began = time.perf_counter()
        result = inner(*a, **kw)
        gen["s"] += time.perf_counter() - began
        completion_ids = result[0]  # (completion ids, logprobs)
        gen["tokens"] += sum(len(c) for c in completion_ids)
        return result

    trainer._generate_single_turn = timed
    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    tokenizer = trainer.processing_class
    model = trainer.model.eval()
    return {"wall_s": wall, "step_s": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1),
            "gen_tok_s": gen["tokens"] / gen["s"] if gen["s"] else float("nan"),
            "gen_share": gen["s"] / wall, "acc_after": greedy_accuracy(model, tokenizer, val, reward)}


# --------------------------------------------------------------------- areal
def run_areal(eta: int, steps: int, val: list[dict], out_dir: Path, dtype: str, extra: list[str],
              seed: int, stop_at_newline: bool = False, ppo: tuple[int, int] = (1, 1)) -> dict:
    trial = f"eta{eta}-k{ppo[0]}e{ppo[1]}-seed{seed}"
    overrides = [f"output_dir={out_dir}", f"trial={trial}", f"model.dtype={dtype}",
                 f"rollout.max_head_offpolicyness={eta}", f"rollout.group_size={GROUP}",
                 f"rollout.batch_size={PER_STEP // GROUP}", f"rollout.sampling.max_new_tokens={NEW_TOKENS}",
                 "rollout.sampling.temperature=1.0", f"actor.optimizer.lr={LR}", "actor.optimizer.grad_clip=1.0",
                 "algorithm.name=grpo", "algorithm.eps_clip=0.2", "algorithm.kl_coef=0.0",
                 # TRL trains on every group, all-equal-reward ones included: so does areal here, so both
                 # generate exactly the samples they train on (the demo itself filters such groups out).
                 "rollout.dynamic_filtering=false", "rollout.weight_sync=tensors",
                 f"dataset.stop_at_newline={str(stop_at_newline).lower()}",
                 f"trainer.total_steps={steps}", "trainer.save_every=0", f"trainer.seed={seed}", "eval.size=0",
                 f"actor.ppo_minibatches={ppo[0]}", f"actor.ppo_epochs={ppo[1]}", *extra]
    began = time.perf_counter()
    proc = subprocess.run([AREAL, "run", *overrides], capture_output=True, text=True,
                          env={**os.environ, "TERM": "dumb"})
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"areal run (eta={eta}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = out_dir / "demo" / trial
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    times = [r["time"] for r in rows]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "actor"
    model, tokenizer = load(latest)
    return {"wall_s": wall, "step_s": (times[-1] - times[0]) / max(1, len(times) - 1),
            "gen_tok_s": statistics.mean(r["throughput/gen_tokens_per_s"] for r in rows[1:] or rows),
            "lag_max": max(r.get("staleness/token_lag_max", 0) for r in rows),
            "clip_frac": statistics.mean(r.get("train/clip_frac", 0.0) for r in rows),
            "acc_after": greedy_accuracy(model, tokenizer, val, reward_fn())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="areal's model.dtype (auto: the demo's choice for this CPU)")
    parser.add_argument("--trl-dtypes", default="float32,bfloat16",
                        help="TRL runs, comma-separated: float32 (its CPU docs), bfloat16 (bf16 autocast)")
    parser.add_argument("--areal", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override for the areal runs (repeatable), e.g. rollout.max_concurrent_rollouts=32")
    parser.add_argument("--seeds", default="1",
                        help="comma-separated seeds (train prompts, held-out problems, sampling): every run once per "
                             "seed, figures as mean +- std; single 30-step runs scatter by about +-0.15 in accuracy")
    parser.add_argument("--areal-stop-at-newline", action="store_true",
                        help="areal ends completions at their first newline instead of generating all 16 "
                             "tokens as TRL (and areal's demo) does")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-sync", action="store_true", help="skip areal at eta = 0")
    parser.add_argument("--ppo", default="", metavar="KxE,...",
                        help="extra areal eta=4 runs with actor.ppo_minibatches=K actor.ppo_epochs=E, e.g. 2x1,2x2")
    args = parser.parse_args()
    ppo_runs = _ppo(args.ppo)  # a bad --ppo stops here, before any model loads
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    from areal_core.models import resolve_model_path

    model_dir = resolve_model_path("", "float32")
    seeds = _seeds(args.seeds)
    samples = args.steps * PER_STEP
    from areal_core.config.dtype import resolve_dtype

    areal_dtype = resolve_dtype(args.dtype)
    trl_dtypes = [d.strip() for d in args.trl_dtypes.split(",") if d.strip()]
    unknown = [d for d in trl_dtypes if d not in ("float32", "bfloat16")]
    if unknown:
        raise SystemExit(f"vs_trl.py: --trl-dtypes {args.trl_dtypes!r} names {unknown}; use float32 and/or bfloat16")
    completions = "stops at the first newline" if args.areal_stop_at_newline else "generates all 16 tokens, as TRL"
    print(f"model {model_dir.name} (areal {areal_dtype}, TRL {' and '.join(trl_dtypes)}) | task few-shot a+b, "
          f"a,b in 0..20 | {args.steps} steps x {PER_STEP} "
          f"completions ({GROUP} per prompt), {NEW_TOKENS} new tokens, lr {LR}, GRPO seq-mean-token-mean, "
          f"clip 0.2, no KL | areal {completions} | greedy accuracy on {args.eval_size} held-out problems "
          f"of each seed's split | "
          f"seeds {seeds} | torch threads {torch.get_num_threads()}", flush=True)
    # results[run name][seed]; each seed has its own train prompts and held-out problems (the dataset's split
    # depends on the seed), shared by every run of that seed.
    results: dict[str, dict[int, dict]] = {}
    before: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="areal-vs-trl-") as tmp:
        for seed in seeds:
            val = task_items("validation", args.eval_size, seed)
            base, tokenizer = load(model_dir)
            before[seed] = greedy_accuracy(base, tokenizer, val, reward_fn())
            del base
            runs = [] if args.skip_trl else [(f"TRL {d}", lambda d=d: run_trl(
                model_dir, args.steps, val, Path(tmp) / f"trl-{d}-{seed}", d, seed)) for d in trl_dtypes]
            runs += [(f"areal eta={eta}", lambda eta=eta: run_areal(
                eta, args.steps, val, Path(tmp) / "areal", areal_dtype, args.areal, seed, args.areal_stop_at_newline))
                for eta in ([4] if args.skip_sync else [4, 0])]
            runs += [(f"areal eta=4 {k}x{e}", lambda k=k, e=e: run_areal(
                4, args.steps, val, Path(tmp) / "areal", areal_dtype, args.areal, seed, args.areal_stop_at_newline,
                (k, e))) for k, e in ppo_runs]
            for name, run in runs:
                results.setdefault(name, {})[seed] = run()
                r = results[name][seed]
                clip = f", clip fraction {r['clip_frac']:.4f}" if "clip_frac" in r else ""
                print(f"seed {seed}: {name} done: {r['wall_s']:.1f} s, {r['step_s']:.2f} s/step, accuracy "
                      f"{before[seed]:.3f} -> {r['acc_after']:.3f}{clip}", flush=True)
    print(f"\nmean over seeds {seeds} (+- sample std where more than one)")
    print(f"{'':<16} {'wall s':>8} {'s/step':>12} {'samples/s':>10} {'gen tok/s':>10} {'acc before':>10} "
          f"{'acc after':>14}  per seed")
    acc_before = statistics.fmean(list(before.values()))
    for name, by_seed in results.items():
        rs = list(by_seed.values())
        wall, step = statistics.fmean([r["wall_s"] for r in rs]), statistics.fmean([r["step_s"] for r in rs])
        after = [r["acc_after"] for r in rs]
        print(f"{name:<16} {wall:>8.1f} {_pm([r['step_s'] for r in rs]):>12} {samples / wall:>10.2f} "
              f"{statistics.fmean([r['gen_tok_s'] for r in rs]):>10.1f} {acc_before:>10.3f} {_pm(after):>14}  "
              f"{' '.join(f'{a:.3f}' for a in after)}")

    def ratio(a: str, b: str) -> None:
        if a in results and b in results:
            x, y = (list(results[k].values()) for k in (a, b))
            print(f"{a} / {b}: samples/s {statistics.fmean([r['wall_s'] for r in y]) / statistics.fmean([r['wall_s'] for r in x]):.2f}x "
                  f"end to end, {statistics.fmean([r['step_s'] for r in y]) / statistics.fmean([r['step_s'] for r in x]):.2f}x per step "
                  f"in steady state; accuracy after {_pm([r['acc_after'] for r in x])} vs "
                  f"{_pm([r['acc_after'] for r in y])}")

    print()
    trl_runs = [name for name in results if name.startswith("TRL")]
    best_trl = min(trl_runs, key=lambda name: statistics.fmean([r["wall_s"] for r in results[name].values()]), default=None)
    if best_trl:
        print(f"TRL's faster run here: {best_trl}; areal is compared with it")
        ratio("areal eta=4", best_trl)
        ratio("areal eta=0", best_trl)
    ratio("areal eta=4", "areal eta=0")
    for k, e in ppo_runs:
        ratio(f"areal eta=4 {k}x{e}", "areal eta=4")
    for name in trl_runs:
        share = statistics.fmean([r["gen_share"] for r in results[name].values()])
        print(f"{name} spent {share:.0%} of its wall time generating")


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"vs_trl.py: --seeds {text!r} must be distinct integers separated by commas, e.g. 1,2,3")
    return seeds


def _ppo(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, e = part.partition("x")
        if not (k.isdigit() and e.isdigit() and int(k) >= 1 and int(e) >= 1):
            raise SystemExit(f"vs_trl.py: --ppo {text!r}: {part!r} is not KxE (mini-batches x epochs), e.g. 2x1")
        pairs.append((int(k), int(e)))
    return pairs


def _pm(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f}" + (f" +- {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


if __name__ == "__main__":
    main()
