"""`areal eval`: a checkpoint scored as the trainer scored it, a base model, and what it refuses.

The end-to-end test trains a tiny model for two steps through `areal run` (the demo config: embedded engine
server, FSDP trainer, the arithmetic dataset), with a reward that scores each completion by its exact text
(tests/doubles/eval_doubles.py): the same mean reward then means the same completions, greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.processes import read_jsonl
from areal_core.testing.waits import scaled

AREAL = str(Path(sys.executable).with_name("areal"))
DOUBLES = Path(__file__).parent / "doubles"
# What decides the scores, for the run and for the evaluations of its checkpoint and its base model alike.
EVAL_KEYS = ["eval.size=8", "eval.success=0.5", "reward.name=function",
             "reward.target=eval_doubles:text_digest_reward_double"]
COMPARED = ("eval/accuracy", "eval/mean_at_k", "eval/reward_mean", "eval/completion_tokens_mean", "eval/items")


def areal(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`areal *args` in ``cwd``, finished within scaled ``timeout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(DOUBLES), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([AREAL, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=scaled(timeout))


def short_run(tmp_path: Path, *overrides: str) -> tuple[Path, Path, dict[int, dict], str]:
    """A tiny model trained 2 steps by `areal run` (the demo config): (the model, the run folder, the trainer's
    evaluations by the step whose weights they scored, the seed's override: the validation items depend on it).

    The reward reads the completions' text, so when the trained and the initial weights score apart, equal figures
    in the tests come from the checkpoint's weights, not the base model's. Two steps do not always move a greedy
    completion (which samples were trained at eta 2 depends on timing, so on the machine's load): a run whose two
    evaluations coincide proves nothing and is made again with another seed, 3 times at most."""
    pytest.importorskip("areal_fsdp")
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    seen = []
    for seed in range(3):
        runs = tmp_path / f"runs-{seed}"
        trained = areal("run", f"output_dir={runs}", f"model.path={model}", "model.dtype=float32",
                        "trainer.total_steps=2", "rollout.batch_size=2", "rollout.group_size=2",
                        "rollout.max_head_offpolicyness=2", "actor.optimizer.lr=1e-2",
                        "rollout.dynamic_filtering=false", f"trainer.seed={seed}", *EVAL_KEYS, *overrides,
                        cwd=tmp_path)
        assert trained.returncode == 0, trained.stdout + trained.stderr
        run_dir = runs / "demo" / "run0"
        logged = {int(r["eval/after_step"]): r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in r}
        assert sorted(logged) == [0, 2]
        if logged[0]["eval/reward_mean"] != logged[2]["eval/reward_mean"]:
            return model, run_dir, logged, f"trainer.seed={seed}"
        seen.append((seed, logged[0]["eval/reward_mean"]))
    raise AssertionError(f"in 3 runs the trained weights' evaluation never differed from the initial one's "
                         f"((seed, mean reward) of each: {seen}): nothing here can tell the two weights apart")


def scores(metrics: dict) -> dict:
    return {key: metrics[key] for key in COMPARED}


def test_areal_eval_of_a_checkpoint_equals_the_trainers_own_evaluation_of_that_step(tmp_path):
    _, run_dir, logged, _ = short_run(tmp_path)

    # The run folder: its latest checkpoint (step 2), with the run's own config.yaml.
    scored = areal("eval", str(run_dir), cwd=tmp_path)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    report = json.loads((checkpoint / "eval.json").read_text())
    assert report["evaluated"]["kind"] == "checkpoint" and report["evaluated"]["step"] == 2
    assert report["evaluated"]["path"] == str(checkpoint) and not report["evaluated"]["lora"]
    assert report["config"] == {"file": str(run_dir / "config.yaml"), "overrides": [],
                                "sha256": report["config"]["sha256"]} and len(report["config"]["sha256"]) == 64
    assert scores(report["metrics"]) == scores(logged[2])
    assert report["metrics"]["eval/after_step"] == 2
    assert (report["k"], report["pass@k"], report["mean@k"], report["reward_mean"], report["items"]) == \
        (1, logged[2]["eval/accuracy"], logged[2]["eval/mean_at_k"], logged[2]["eval/reward_mean"], 8)
    assert "pass@1" in scored.stdout and "mean reward" in scored.stdout
    # per item: what the model wrote and how it scored, the same items and verdicts as the trainer's evaluation
    per_item = report["per_item"]
    assert [r["index"] for r in per_item] == list(range(8))
    assert sum(r["passed"] for r in per_item) / 8 == report["pass@k"]
    assert all(len(r["samples"]) == 1 and isinstance(r["samples"][0]["completion"], str) for r in per_item)
    assert all(r["prompt"].endswith("=") and "answer" in r for r in per_item)
    trainer_items = [r for r in read_jsonl(run_dir / "eval_samples.jsonl") if r["step"] == 2]
    assert [(r["passed"], r["samples"]) for r in trainer_items] == [(r["passed"], r["samples"]) for r in per_item]
    assert not list(checkpoint.glob(".eval.json*"))
    assert (run_dir / "logs" / "eval-rollout-0.log").exists()


@pytest.mark.slow
def test_areal_eval_of_the_base_model_equals_the_evaluation_before_training_and_samples_give_pass_and_mean_at_k(
        tmp_path):
    model, run_dir, logged, seed = short_run(tmp_path)
    # The base model with the demo config (the default for a model) and the same keys: the step-0 evaluation.
    base = areal("eval", str(model), "model.dtype=float32", seed, *EVAL_KEYS, "--out", str(tmp_path / "base.json"),
                 cwd=tmp_path)
    assert base.returncode == 0, base.stdout + base.stderr
    report = json.loads((tmp_path / "base.json").read_text())
    assert report["evaluated"]["kind"] == "model" and report["evaluated"]["step"] == 0
    assert report["evaluated"]["model"] == str(model)
    assert scores(report["metrics"]) == scores(logged[0])

    # Sampled, 4 samples per item: pass@4 >= mean@4, and the overrides are recorded.
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    sampled = areal("eval", str(checkpoint), "eval.samples=4", "eval.temperature=1.0", "--out",
                    str(tmp_path / "sampled.json"), cwd=tmp_path)
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr
    report = json.loads((tmp_path / "sampled.json").read_text())
    assert report["k"] == 4 and report["config"]["overrides"] == ["eval.samples=4", "eval.temperature=1.0"]
    assert 0.0 <= report["mean@k"] <= report["pass@k"] <= 1.0 and "pass@4" in sampled.stdout


@pytest.mark.slow
def test_areal_eval_of_a_lora_checkpoint_merges_its_adapters_as_the_trainer_exports_them(tmp_path):
    pytest.importorskip("peft")
    _, run_dir, logged, _ = short_run(tmp_path, "actor.lora_rank=4", "actor.optimizer.lr=3e-1")
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    assert (checkpoint / "actor" / "adapter").is_dir()
    scored = areal("eval", str(checkpoint), cwd=tmp_path)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    report = json.loads((checkpoint / "eval.json").read_text())
    assert report["evaluated"]["lora"] and "LoRA merged" in scored.stdout
    assert scores(report["metrics"]) == scores(logged[2])


def assert_refused(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


def test_bad_input_is_refused_naming_the_argument_and_the_fix_and_writes_nothing(tmp_path):
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "readme.txt").write_text("hello")
    run_without_checkpoint = tmp_path / "runs" / "x" / "run0"
    run_without_checkpoint.mkdir(parents=True)
    (run_without_checkpoint / "config.yaml").write_text("{}\n")

    assert_refused(areal("eval", str(tmp_path / "missing"), cwd=tmp_path),
                   f"CHECKPOINT_OR_MODEL '{tmp_path / 'missing'}' does not exist", "Fix: pass a checkpoint folder")
    assert_refused(areal("eval", str(not_a_model), cwd=tmp_path),
                   f"CHECKPOINT_OR_MODEL '{not_a_model}' is a folder, but not a checkpoint", "Fix: pass")
    assert_refused(areal("eval", str(run_without_checkpoint), cwd=tmp_path),
                   "is a run folder without a complete checkpoint", "Fix: let the run save one")
    assert_refused(areal("eval", str(model), "eval.size=0", cwd=tmp_path),
                   "eval.size is 0: there is nothing to evaluate. Fix: eval.size=64")
    assert_refused(areal("eval", str(model), "eval.size=-1", cwd=tmp_path), "eval.size")
    assert_refused(areal("eval", str(model), f"model.path={model}", cwd=tmp_path),
                   "model.path: the model evaluated is CHECKPOINT_OR_MODEL", "Fix: drop the model.path override")
    assert_refused(areal("eval", str(model), "--out", str(tmp_path / "nowhere" / "eval.json"), cwd=tmp_path),
                   "--out: the folder", "does not exist", "Fix: pass --out")
    assert not list(tmp_path.rglob("eval.json")) and not list(tmp_path.rglob(".eval.json*"))
