"""The simulator calibrated to this machine, checked against the real demo run side by side.

    .venv/bin/python benchmarks/calibrate_cpu.py [--steps 16] [--skip-measure] [--skip-runs FILE] [--sim-seeds 5]

Three parts, in one session on an otherwise idle machine:

1. **Measure** the parts of the demo on their own (no run involved), at 1 and at 2 torch threads, in a child
   process each: the embedded engine's ``Generator`` on SmolLM2-135M (the demo's model and dtype) with the
   demo's prompts (``dataset.name: arithmetic``), a decode step at batches 1-16 and the prefill; the ``fsdp``
   engine at world size 1, a training step (forward, backward, AdamW) of 8 and of 16 sequences and a logprob
   forward of 16; handing the weights out (``export_tensors``) and loading them into the generator. From these
   it writes the profile ``smollm2-135m-cpu`` (plugins/engines/sim/areal_sim/profiles/), its ``cpu`` section
   holding the measured 2-thread speedups, so the simulator shares the two cores as the local launcher does
   (eta 0: in turns, both cores each; eta > 0: one core each).
2. **Run** the demo for real: ``areal run`` (eta 4) and ``areal run examples/demo_sync.yaml`` (eta 0), each
   ``trainer.total_steps=--steps`` with evaluation off, and read each step's ``time/step_s``, the share of
   groups dynamic filtering dropped, the mean reward and the completions' length; and, from ``/proc``, the
   trainer process's CPU outside its main thread per generated sample (its controller, HTTP client, rewards, and
   at eta 4 the exports beside training). The eta 4 run's figure, less the exports' share (``weights.export_s``
   a step), becomes the profile's ``cpu.controller_s_per_sample``: CPU seconds are the work itself, whatever the
   contention; at eta 0 torch's second thread would count too.
3. **Simulate** the same two configs with ``areal simulate`` on the profile (``sim.token_scale=1``, each with its
   own real run's workload: the items' success rates a Beta with that run's mean reward and the concentration
   that gives its drop rate), ``--sim-seeds`` times each, and print predicted beside measured seconds per step
   (the mean over steps 3..N on both sides) and the eta 0 / eta 4 ratio.

The workload (drop rate, reward, lengths) is read from the real runs: it is the task's, not the machine's.
Every time the simulator spends comes from part 1, except the controller's CPU per sample (from the eta 4 run).
No pass / fail: it prints the figures and the errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "plugins/engines/sim/areal_sim/profiles/smollm2-135m-cpu.yaml"
BATCHES = (1, 2, 4, 8, 16)
NEW_TOKENS = 16  # the demo's rollout.sampling.max_new_tokens
CORES = 2


# ----------------------------------------------------------------------------------------------- 1. measure
def _prompts(n: int) -> list[str]:
    """The demo's first ``n`` training prompts, from its own dataset as the run builds it."""
    from areal_core.config.validate import validate_run
    from areal_core.trainer import build

    run = validate_run(str(ROOT / "cli/areal_cli/demo.yaml"), [])
    return [item["prompt"] for _, item in zip(range(n), build(run, "dataset"))]


def measure(threads: int, mode: str = "all") -> dict:
    """Times of the demo's parts on ``threads`` torch threads (runs in a child process). ``mode``: ``all``;
    ``decode`` or ``train`` alone (measured while another process loads the other core); ``load-decode`` /
    ``load-train``: that work in a loop until killed (the other process's load), "READY" once warm."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_core.api import Context
    from areal_core.api.inference import SamplingParams
    from areal_core.config.dtype import resolve_dtype
    from areal_core.config.schema import RunConfig
    from areal_core.models import resolve_model_path
    from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig
    from areal_local.generator import Generator

    torch.set_num_threads(threads)
    dtype = resolve_dtype("auto")
    folder = resolve_model_path("", dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in _prompts(16)]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa").eval()
    generator = Generator(model, eos_token_ids=[], max_batch=64)
    out: dict = {"threads": threads, "dtype": dtype, "prompt_tokens": statistics.mean(len(p) for p in prompts),
                 "decode_s": {}, "prefill_s": {}}
    if mode == "load-decode":
        for n in itertools.count():
            for i in range(8):
                generator.add(f"load-{n}-{i}", prompts[i], SamplingParams(max_new_tokens=NEW_TOKENS, seed=i))
            while generator.num_running or generator.num_waiting:
                generator.step()
            if n == 1:
                print("READY", flush=True)
    for batch in BATCHES if mode in ("all", "decode") else ():
        if mode == "decode" and batch < 8:
            continue
        firsts, steps = [], []
        for repeat in range(4):  # the first is a warm-up
            for i in range(batch):
                generator.add(f"{batch}-{repeat}-{i}", prompts[i],
                              SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=i))
            began = time.perf_counter()
            generator.step()  # prefill + the first decode step
            first = time.perf_counter() - began
            times = []
            while generator.num_running:
                began = time.perf_counter()
                generator.step()
                times.append(time.perf_counter() - began)
            if repeat:
                firsts.append(first)
                steps += times
        decode = statistics.median(steps)
        out["decode_s"][batch] = decode
        out["prefill_s"][batch] = [sum(len(p) for p in prompts[:batch]), max(statistics.median(firsts) - decode, 0.0)]
    out["context"] = out["prompt_tokens"] + NEW_TOKENS / 2
    if mode == "decode":
        return out

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(folder), dtype
    cfg.actor.optimizer.lr = 1e-7
    engine = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(), extras={"role": "actor"}))
    engine.initialize()
    vocab = engine.lm.config.vocab_size

    def batch_of(groups: int) -> dict:
        """The demo's batch shape: ``groups`` prompts x 8 completions of 16 tokens, packed as the trainer packs
        (``group_index``: the fsdp engine computes a group's shared prompt once)."""
        b: dict = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs",
                                   "seq_lens", "group_index")}
        for i in range(groups * 8):
            prompt = prompts[i // 8]
            ids = prompt + [(7 * i + j) % vocab for j in range(NEW_TOKENS)]
            b["input_ids"] += ids
            b["position_ids"] += list(range(len(ids)))
            b["loss_mask"] += [0] * len(prompt) + [1] * NEW_TOKENS
            b["advantages"] += [(-1) ** i * 0.5] * len(ids)
            b["logprobs"] += [-1.0] * len(ids)
            b["seq_lens"].append(len(ids))
            b["group_index"].append(i // 8)
        b["cu_seqlens"] = [0]
        for n_ in b["seq_lens"]:
            b["cu_seqlens"].append(b["cu_seqlens"][-1] + n_)
        return b

    def loss(logprobs, entropy, mb):
        mask = mb["loss_mask"].float()
        return -(mb["advantages"] * logprobs * mask).sum() / mask.sum(), {}

    def timed(fn, repeats: int = 4) -> float:
        fn()
        runs = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - began)
        return statistics.median(runs)

    small, large = batch_of(1), batch_of(2)
    if mode == "load-train":
        for n in itertools.count():
            engine.train_batch(large, loss)
            if n == 1:
                print("READY", flush=True)
    if mode == "train":
        out["train_s"] = [None, timed(lambda: engine.train_batch(large, loss), 3)]
        return out
    # tokens computed: each group's prompt once, and its completions
    out["train_tokens"] = [len(prompts[0]) + 8 * NEW_TOKENS, len(prompts[0]) + len(prompts[1]) + 16 * NEW_TOKENS]
    out["train_s"] = [timed(lambda: engine.train_batch(small, loss)), timed(lambda: engine.train_batch(large, loss))]
    out["forward_s"] = timed(lambda: engine.forward_logprobs(large))

    def export() -> list:
        return [(name, t.clone()) for bucket in engine.export_tensors(1 << 26) for name, t in bucket]

    out["export_s"] = timed(export, 3)
    named = export()
    out["weight_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    out["load_s"] = timed(lambda: generator.load_state_dict(dict(named), strict=False), 3)
    out["params"] = sum(t.numel() for _, t in named)
    engine.close()
    return out


def _child(threads: int, mode: str) -> dict:
    env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
    proc = subprocess.run([sys.executable, __file__, "--child", str(threads), "--mode", mode], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"measuring {mode} at {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("AREAL_MEASURED ")][-1]
    return json.loads(line.split(" ", 1)[1])


def measure_all() -> dict:
    results: dict = {}
    for threads in (1, CORES):
        results[threads] = _child(threads, "all")
        print(f"measured at {threads} thread(s): decode {results[threads]['decode_s']}, "
              f"train {results[threads]['train_s']}, export {results[threads]['export_s']:.3f} s, "
              f"load {results[threads]['load_s']:.3f} s", flush=True)
    # At eta > 0 the two roles run at once, one core each: each measured again while the other's work loads the
    # other core (memory bandwidth and caches are shared; the trainer process's own threads add to it).
    contended = {}
    for role, other in (("decode", "train"), ("train", "decode")):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        load = subprocess.Popen([sys.executable, __file__, "--child", "1", "--mode", f"load-{other}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            began = time.monotonic()
            for line in load.stdout:  # its warm-up: until it prints READY
                if line.startswith("READY"):
                    break
                if time.monotonic() - began > 600:
                    raise SystemExit(f"the {other} load process did not warm up in 600 s")
            else:
                raise SystemExit(f"the {other} load process exited before it was ready (rc {load.wait()})")
            contended[role] = _child(1, role)
        finally:
            load.kill()
            load.wait(timeout=30)
    alone = results[1]
    results["contention"] = {
        "inference": round(statistics.mean(contended["decode"]["decode_s"][b] / alone["decode_s"][b]
                                           for b in contended["decode"]["decode_s"]), 3),
        "train": round(contended["train"]["train_s"][1] / alone["train_s"][1], 3)}
    print(f"contention (time beside the other role / alone, 1 thread each): {results['contention']}", flush=True)
    return results


def write_profile(m: dict[int, dict], lengths: dict) -> None:
    one, many = m["1"] if "1" in m else m[1], m[str(CORES)] if str(CORES) in m else m[CORES]
    decode = [[one["decode_s"][str(b)] if str(b) in one["decode_s"] else one["decode_s"][b]] * 2 for b in BATCHES]
    t_small, t_large = one["train_s"]
    n_small, n_large = one["train_tokens"]
    per_token = max((t_large - t_small) / (n_large - n_small), 1e-9)
    per_step = max(t_large - per_token * n_large, 0.0)
    # prefill = fixed + per token, through the measured (prompt tokens, seconds) of batches 1..16
    points = [tuple(v) for v in one["prefill_s"].values()]
    mx, my = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    prefill = max(sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points), 1e-7)
    prefill_fixed = max(my - prefill * mx, 0.0)

    def speedup(key: str) -> float:
        # at the batches the demo runs (a group of 8 and two of them): at batch 1-4 a decode step is too small for
        # a second thread to help, and the simulated engine is never there for long
        return round(statistics.mean(one[key][b] / many[key][b] for b in one[key] if int(b) >= 8), 3)


    train_speedup = round(one["train_s"][1] / many["train_s"][1], 3)
    ctx = round(one["context"])
    profile = {
        "name": "smollm2-135m-cpu",
        "gpu": f"this project's {CORES}-core CPU machine (roles share its cores)",
        "source": (f"Measured by benchmarks/calibrate_cpu.py on {time.strftime('%Y-%m-%d')}: the embedded engine's "
                   f"Generator and the fsdp engine (world size 1) on SmolLM2-135M-Instruct ({one['dtype']}) with the "
                   f"demo's prompts, at 1 and {CORES} torch threads; response lengths and prompts from the demo's "
                   f"own runs (arithmetic, max_new_tokens {NEW_TOKENS})."),
        "params": float(one["params"]),
        "cpu": {"cores": CORES, "inference_speedup": [1.0, speedup("decode_s")], "train_speedup": [1.0, train_speedup],
                "contention": m["contention"]},
        "inference": {"tp": 1, "prefill_s_per_token": float(f"{prefill:.4g}"),
                      "prefill_s_fixed": float(f"{prefill_fixed:.4g}"), "shared_prompts": True,
                      "kv_capacity_tokens": 64 * 2048,
                      "decode_step_s": {"batch": list(BATCHES), "context": [max(ctx - 8, 1), ctx + 8],
                                        "seconds": [[float(f"{x:.4g}") for x in row] for row in decode]}},
        "train": {"s_per_token_per_gpu": float(f"{per_token:.4g}"), "s_per_step": float(f"{per_step:.4g}"),
                  "forward_share": float(f"{one['forward_s'] / (per_token * n_large):.4g}"), "shared_prompts": True,
                  "grad_bytes": float(one["weight_bytes"]), "allreduce_gbps": 10.0, "allreduce_latency_s": 0.0},
        "weights": {"bytes": float(one["weight_bytes"]),
                    "link_gbps": float(f"{one['weight_bytes'] * 8 / 1e9 / one['load_s']:.4g}"),
                    "latency_s": 0.0, "export_s": float(f"{one['export_s']:.4g}")},
        "lengths": lengths,
    }
    import yaml

    header = ("# Written by benchmarks/calibrate_cpu.py (the simulator calibrated to this project's CPU machine); "
              "rerun it rather than edit this.\n")
    PROFILE.write_text(header + yaml.safe_dump(profile, sort_keys=False, width=118, default_flow_style=None))
    print(f"wrote {PROFILE.relative_to(ROOT)}", flush=True)


def set_controller_cost(seconds: float) -> None:
    """Write ``cpu.controller_s_per_sample`` into the profile (the rest of it as it is)."""
    import yaml

    lines = PROFILE.read_text().splitlines(keepends=True)
    header = "".join(x for x in lines if x.startswith("#"))
    profile = yaml.safe_load("".join(lines))
    profile["cpu"]["controller_s_per_sample"] = float(f"{seconds:.4g}")
    PROFILE.write_text(header + yaml.safe_dump(profile, sort_keys=False, width=118, default_flow_style=None))
    print(f"the controller's CPU beside training, per generated sample (eta 4 run): {seconds * 1000:.1f} ms "
          f"-> cpu.controller_s_per_sample in {PROFILE.relative_to(ROOT)}", flush=True)


# ----------------------------------------------------------------------------------------------- 2. run
GROUP = 8  # the demo's rollout.group_size: samples per episode


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process (its exited threads included) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _trainer_pid(launcher: int) -> int | None:
    """The demo's trainer process (``python -m areal_core.trainer``) among the launcher's descendants (the
    launcher starts it through a trampoline, ``areal_core.processes.child``, whose command line also names it)."""
    todo = [launcher]
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[1:3] == [b"-m", b"areal_core.trainer"]:
                return pid
            todo += map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        except OSError:
            continue
    return None


def real_run(config: str | None, steps: int, folder: Path) -> dict:
    """The demo for real; besides its metrics, the trainer process's CPU per generated sample outside its main
    thread, over steps 3..N (the controller's loop, its HTTP client, the rewards; at eta 4 also the exports)."""
    argv = [str(Path(sys.executable).parent / "areal"), "run", *([config] if config else []),
            f"trainer.total_steps={steps}", "eval.size=0", f"output_dir={folder}", "trainer.save_every=0"]
    began = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    errors = (folder / "stderr.txt").open("w+")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors, text=True, cwd=ROOT)
    first = last = None  # (side CPU seconds, episodes started) at step 2 and at the newest step seen
    trainer = None
    while proc.poll() is None:
        if time.perf_counter() - began > 1800:
            proc.kill()
            raise SystemExit(f"{' '.join(argv)} ran past 1800 s")
        time.sleep(0.5)
        trainer = trainer or _trainer_pid(proc.pid)
        metrics = next(folder.rglob("metrics.jsonl"), None)
        if trainer is None or metrics is None:
            continue
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"time/step_s"' in x]
        try:
            side = _cpu_s(trainer) - _cpu_s(trainer, trainer)
        except OSError:  # the trainer has exited
            continue
        # at each new step (within the poll): the side CPU so far, and the episodes started by that step
        if len(rows) >= 2 and (last is None or len(rows) > last[2]):
            last = (side, rows[-1].get("rollout/started", 0.0), len(rows))
            first = first or last
    errors.seek(0)
    stderr = errors.read()
    errors.close()
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{stderr[-3000:]}")
    out = summarize(next(folder.rglob("metrics.jsonl")), time.perf_counter() - began)
    if first and last and last[1] > first[1]:
        out["controller_s_per_sample"] = (last[0] - first[0]) / ((last[1] - first[1]) * GROUP)
    return out


def summarize(metrics: Path, wall: float | None = None) -> dict:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    last = rows[-1]
    later = rows[2:]
    started, rejected = last.get("rollout/started", 0.0), last.get("rollout/rejected", 0.0)
    return {"steps": len(rows), "s_per_step": statistics.mean(r["time/step_s"] for r in later),
            "s_per_step_all": [round(r["time/step_s"], 3) for r in rows],
            "parts_s": {k.split("/")[1]: round(statistics.mean(r.get(k, 0.0) for r in later), 3)
                        for k in ("time/wait_batch_s", "time/train_s", "time/weight_sync_s")},
            "drop_rate": rejected / started if started else 0.0,
            "reward": statistics.mean(r.get("reward/mean", 0.0) for r in rows),
            "generated_tokens": last.get("rollout/generated_tokens", 0.0), "episodes": started,
            "wall_s": wall}


# ----------------------------------------------------------------------------------------------- 3. simulate
def drop_rate(mean: float, concentration: float, group: int = 8) -> float:
    """P(a group of ``group`` samples all agree) for success rates ~ Beta(mean c, (1 - mean) c)."""
    a, b = mean * concentration, (1 - mean) * concentration
    ones = math.prod((a + i) / (a + b + i) for i in range(group))
    zeros = math.prod((b + i) / (a + b + i) for i in range(group))
    return ones + zeros


def concentration_for(mean: float, target: float) -> float:
    lo, hi = 0.01, 1000.0  # the drop rate falls as the concentration grows
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if drop_rate(mean, mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


def simulate(config: str | None, steps: int, mean: float, concentration: float, folder: Path, seed: int = 1) -> dict:
    from areal_sim.simulate import run_simulation

    config_path = config or str(ROOT / "cli/areal_cli/demo.yaml")
    report = run_simulation(config_path, [f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"sim.profile={PROFILE}",
                                          "sim.token_scale=1", f"sim.success_mean={mean}",
                                          f"sim.success_concentration={concentration}"], str(folder))
    out = summarize(folder / "metrics.jsonl")
    out["threads"] = report.get("threads")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip-measure", action="store_true", help="keep the profile already written")
    parser.add_argument("--skip-runs", help="a JSON file of earlier real-run results to reuse")
    parser.add_argument("--sim-seeds", type=int, default=5, help="simulations per config, averaged")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("AREAL_MEASURED " + json.dumps(measure(args.child, args.mode)), flush=True)
        return
    measured = None if args.skip_measure else measure_all()
    with tempfile.TemporaryDirectory(prefix="areal-calibrate-") as tmp:
        if args.skip_runs:
            runs = json.loads(Path(args.skip_runs).read_text())
        else:
            runs = {}
            for eta, config in ((4, None), (0, str(ROOT / "examples/demo_sync.yaml"))):
                runs[str(eta)] = real_run(config, args.steps, Path(tmp, f"real-eta{eta}"))
                print(f"real demo eta {eta}: {runs[str(eta)]['s_per_step']:.3f} s/step ({runs[str(eta)]})", flush=True)
            Path(tmp, "runs.json").write_text(json.dumps(runs))
            Path("/tmp/areal_calibrate_runs.json").write_text(json.dumps(runs))
        episodes = sum(r["episodes"] for r in runs.values())
        tokens_per_sample = sum(r["generated_tokens"] for r in runs.values()) / max(episodes * 8, 1)
        if measured is not None:
            prompt = round(measured[1]["prompt_tokens"])
            # completions that mostly run to max_new_tokens: a narrow log-normal around the measured mean, cut there
            write_profile(measured, {"median": float(f"{max(tokens_per_sample, 1.0):.4g}"), "sigma": 0.1,
                                     "cap": NEW_TOKENS, "prompt": prompt})
        # The controller's CPU per sample, from the eta 4 run: there torch trains on one thread, so the trainer
        # process's other threads are the controller's loop, its HTTP client, the rewards and the exports beside
        # training. The exports are modelled apart (weights.export_s a step), so their share comes off. (At eta 0
        # torch's second thread would count as side work: 71 ms a sample instead of 18 on 2026-11-26.)
        side = runs["4"].get("controller_s_per_sample")
        if side is not None:
            import yaml

            export_s = yaml.safe_load(PROFILE.read_text())["weights"]["export_s"]
            per_sample = runs["4"]["steps"] / max(runs["4"]["episodes"] * GROUP, 1)  # steps a sample, whole run
            set_controller_cost(max(side - export_s * per_sample, 0.0))
        # Each run is simulated with its own workload (groups dropped, reward): the simulator models time, not
        # learning, and over a few dozen steps the two runs' drop rates differ by chance as much as their timings
        # do (a pooled workload moved the ratio by ~7 %). Each simulation is the mean over --sim-seeds seeds
        # (trainer.seed: other items and rewards), so its own sampling error is small beside the real runs'.
        sims = {}
        for eta, config in (("4", None), ("0", str(ROOT / "examples/demo_sync.yaml"))):
            mean, drop = runs[eta]["reward"], runs[eta]["drop_rate"]
            conc = concentration_for(mean, drop)
            print(f"workload of the real eta {eta} run: mean reward {mean:.3f}, groups dropped {drop:.1%} -> success "
                  f"rates Beta(mean {mean:.3f}, concentration {conc:.2f}); {tokens_per_sample:.1f} tokens per "
                  f"completion", flush=True)
            seeds = [simulate(config, args.steps, mean, conc, Path(tmp, f"sim-eta{eta}-{seed}"), seed)
                     for seed in range(1, args.sim_seeds + 1)]
            sims[eta] = {"s_per_step": statistics.mean(x["s_per_step"] for x in seeds),
                         "s_per_step_seeds": [round(x["s_per_step"], 3) for x in seeds],
                         "drop_rate": statistics.mean(x["drop_rate"] for x in seeds),
                         "parts_s": {k: round(statistics.mean(x["parts_s"][k] for x in seeds), 3)
                                     for k in seeds[0]["parts_s"]},
                         "s_per_step_all": seeds[0]["s_per_step_all"]}
    print()
    print("| eta | real s/step | simulated s/step | error | real groups dropped | simulated |")
    print("|---|---|---|---|---|---|")
    for eta in ("0", "4"):
        r, s = runs[eta], sims[eta]
        print(f"| {eta} | {r['s_per_step']:.3f} | {s['s_per_step']:.3f} | {s['s_per_step'] / r['s_per_step'] - 1:+.1%} "
              f"| {r['drop_rate']:.1%} | {s['drop_rate']:.1%} |")
    real_ratio = runs["0"]["s_per_step"] / runs["4"]["s_per_step"]
    sim_ratio = sims["0"]["s_per_step"] / sims["4"]["s_per_step"]
    print(f"\neta 0 / eta 4 seconds per step: real {real_ratio:.3f}, simulated {sim_ratio:.3f} "
          f"({sim_ratio / real_ratio - 1:+.1%}); steps 3..{args.steps} on both sides")
    for eta in ("0", "4"):
        print(f"eta {eta}, mean of steps 3..N: real {runs[eta]['parts_s']}, simulated {sims[eta]['parts_s']}")
    print(f"per step, real:      {runs['0']['s_per_step_all']} / {runs['4']['s_per_step_all']}")
    print(f"per step, simulated (seed 1): {sims['0']['s_per_step_all']} / {sims['4']['s_per_step_all']}")
    print(f"simulated s/step per seed: eta 0 {sims['0']['s_per_step_seeds']}, eta 4 {sims['4']['s_per_step_seeds']}")


if __name__ == "__main__":
    main()
