"""A short version of the default run (`areal run` with the built-in demo config) on a tiny model.

Everything real but the model's size: the demo YAML, the embedded engine in
its own process, the FSDP trainer, GRPO with decoupled PPO, the rlvr workflow,
the arithmetic dataset and reward, evaluation before and after, checkpoints
and `areal plot`. Whether the demo *learns* is shown by benchmarks/vs_trl.py
on the real model, not here.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.waits import scaled

AREAL = str(Path(sys.executable).with_name("areal"))


def test_a_short_default_run_writes_a_complete_run_folder(tmp_path):
    pytest.importorskip("areal_fsdp")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    overrides = [f"output_dir={tmp_path / 'runs'}", f"model.path={model}", "model.dtype=float32",
                 "trainer.total_steps=3", "trainer.save_every=2", "eval.size=6", "rollout.batch_size=2",
                 "rollout.group_size=2", "rollout.max_head_offpolicyness=2", "actor.optimizer.lr=1e-3",
                 # a random model scores 0 on (nearly) every group: the demo's filter would reject them all
                 "rollout.dynamic_filtering=false"]
    proc = subprocess.run([AREAL, "run", *overrides], capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "demo" / "run0"

    config = (run_dir / "config.yaml").read_text()
    for expected in ("name: grpo", "name: rlvr", "name: arithmetic", "max_head_offpolicyness: 2", "decoupled: true",
                     "weight_sync: tensors", "pacing: true"):
        assert expected in config

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/items"] == 6 and rows[0]["eval/after_step"] == 0
    assert rows[-1]["eval/items"] == 6 and rows[-1]["eval/after_step"] == 3
    for row in rows:
        assert all(v is None or math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert all(v is not None for k, v in row.items() if k != "time"), row  # null = non-finite
    for row in rows[1:]:
        for key in ("reward/mean", "train/loss", "train/grad_norm", "staleness/token_lag_max",
                    "throughput/gen_tokens_per_s", "rollout/lead"):
            assert key in row, (key, sorted(row))
        assert row["staleness/token_lag_max"] <= 2 and 1 <= row["rollout/lead"] <= 2
    # Every version reached the server through shared memory, exported beside the next step's training: the
    # first whole, the others whole or as deltas (rollout.weight_delta: auto sends one where it is smaller)
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "weights v1 from /dev/shm/areal-weights-" in server_log, server_log[-2000:]
    for version in (2, 3):
        assert re.search(rf"weights v{version} from /dev/shm/areal-(weights|delta)-", server_log), server_log[-2000:]
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0
    assert list((run_dir / "tensorboard").iterdir())

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(latest / "actor")  # plain HF safetensors
    assert trained.config.vocab_size > 0

    # What the model wrote, as text, for every step (2 groups of 2 a step: all 4 samples, under the cap of 8)
    from areal_core.completions import read_records
    from areal_core.models import load_tokenizer

    written = read_records(run_dir / "completions.jsonl")
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["item"]) for r in written] == \
        [(s["step"], item) for s in samples for item in s["items"] for _ in range(2)]
    tokenizer = load_tokenizer(str(model))
    for r in written:
        assert r["prompt"].endswith("=") and "3+4=7" in r["prompt"], r  # the few-shot arithmetic prompt
        assert isinstance(r["completion"], str) and r["completion_tokens"] > 0
        assert len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) >= 1
        assert r["reward"] in (0.0, 1.0) and r["version"] == r["step"] - 1
        assert 0 <= r["staleness"] <= 2 and r["versions"][1] - r["versions"][0] <= 2
    # the step's length metrics agree with the completions written, counted independently per sample
    for row in rows[1:]:
        step_records = [r for r in written if r["step"] == row["step"]]
        lengths = [r["completion_tokens"] for r in step_records]
        assert row["train/samples"] == len(step_records) == 4
        assert row["length/mean"] == pytest.approx(sum(lengths) / len(lengths))
        assert (row["length/min"], row["length/max"]) == (min(lengths), max(lengths))
        truncated = [r["reward_info"]["stop_reason"] == "length" for r in step_records]
        assert row["length/truncated_frac"] == pytest.approx(sum(truncated) / len(truncated))
    shown = subprocess.run([AREAL, "samples", str(run_dir), "-n", "2"], capture_output=True, text=True,
                           timeout=scaled(60))
    assert shown.returncode == 0 and shown.stdout.count("step 3 · item ") == 2, shown.stdout + shown.stderr
    first = written[0]
    by_item = subprocess.run([AREAL, "samples", str(run_dir), "--item", str(first["item"]), "--json"],
                             capture_output=True, text=True, timeout=scaled(60))
    assert [json.loads(line) for line in by_item.stdout.splitlines()] == \
        [r for r in written if r["item"] == first["item"]][:4]

    plotted = subprocess.run([AREAL, "plot", str(run_dir)], capture_output=True, text=True, timeout=scaled(120))
    assert plotted.returncode == 0, plotted.stderr
    png = run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_names_what_is_missing(tmp_path):
    proc = subprocess.run([AREAL, "plot", str(tmp_path)], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 1
    assert f"{tmp_path} has no metrics.jsonl. Fix: pass the run folder" in proc.stderr
    assert "Traceback" not in proc.stderr
