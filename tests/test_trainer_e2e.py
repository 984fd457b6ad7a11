"""A whole run through `areal run`: the local launcher, the trainer subprocess,
the controller, checkpoints, metrics, and resume after a real kill."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_core.testing.processes import launched_pids, process_name, processes_mentioning, read_jsonl
from areal_core.testing.waits import scaled, timeout_scale, wait_until

AREAL = str(Path(sys.executable).with_name("areal"))


@pytest.fixture
def rl_run(tmp_path, rl_doubles_env):
    """Installs the RL doubles; yields a function running `areal run` in a subprocess."""
    config, env = rl_doubles_env

    def start(*overrides: str, extra_env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", *overrides],
                                env={**env, **(extra_env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    yield start, tmp_path / "runs" / "areal"


def finish(proc: subprocess.Popen, timeout: float | None = None) -> str:
    """The run's output once it ended with 0 (within ``timeout``, by default scaled 120 s)."""
    out, _ = proc.communicate(timeout=scaled(120) if timeout is None else timeout)
    assert proc.returncode == 0, out
    return out


def test_a_run_trains_every_step_and_writes_its_outputs(rl_run):
    start, runs = rl_run
    out = finish(start("trial=plain"))
    run_dir = runs / "plain"
    assert "areal run finished" in out
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2, 3, 4, 5, 6]
    assert [s["items"] for s in samples] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["staleness/token_lag_max"] == 0 for m in metrics)  # eta = 0: synchronous
    assert {"reward/mean", "time/weight_sync_s", "rollout/rejected", "train/loss"} <= set(metrics[0])
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert json.loads((run_dir / "checkpoints" / latest / "actor" / "state.json").read_text())["version"] == 6
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000005", "v000006"]


def test_async_run_respects_the_staleness_bound(rl_run):
    start, runs = rl_run
    finish(start("trial=async", "rollout.max_head_offpolicyness=2", "rollout.batch_size=2"))
    metrics = read_jsonl(runs / "async" / "metrics.jsonl")
    assert len(metrics) == 6 and all(m["staleness/token_lag_max"] <= 2 for m in metrics)
    items = [i for s in read_jsonl(runs / "async" / "samples.jsonl") for i in s["items"]]
    assert len(items) == len(set(items)) == 12


def test_at_eta_above_0_the_trainer_trains_on_while_the_engines_load_weights(rl_run):
    """Loading takes 0.6 s and a train step 1 s: at eta = 2 the trainer hands the weights over and trains its
    next batch meanwhile (waiting only for the load before the next hand-over, the final checkpoint and the
    last step), where at eta = 0 each step waits for the load. Every duration is times AREAL_TEST_TIMEOUT_SCALE,
    so on a slow machine the hand-over still takes a small share of the load it must not wait for."""
    start, runs = rl_run
    k = timeout_scale()
    slow_load = {"AREAL_TEST_WEIGHT_LOAD_S": str(0.6 * k)}
    finish(start("trial=overlap", "rollout.max_head_offpolicyness=2", f"actor.step_s={1.0 * k}",
                 "trainer.total_steps=4", extra_env=slow_load))
    finish(start("trial=waits", f"actor.step_s={1.0 * k}", "trainer.total_steps=4", extra_env=slow_load))
    overlap = read_jsonl(runs / "overlap" / "metrics.jsonl")
    waits = read_jsonl(runs / "waits" / "metrics.jsonl")
    assert all(m["time/weight_sync_s"] >= 0.6 * k for m in waits)
    assert all(m["time/weight_sync_s"] < 0.4 * k for m in overlap[:-1]), [m["time/weight_sync_s"] for m in overlap]
    # Each update's pause is still reported: the previous one's at the next step, the last one at its own.
    assert all(m["time/generation_paused_s"] >= 0.6 * k for m in overlap[1:]), [m["time/generation_paused_s"]
                                                                                 for m in overlap]
    # The last step waits for its own update too (the final checkpoint sees the engines at the final weights).
    assert overlap[-1]["time/generation_paused_s"] >= 1.2 * k
    assert all(m["staleness/token_lag_max"] <= 2 for m in overlap)


def test_resume_after_a_kill_matches_an_uninterrupted_run(rl_run):
    start, runs = rl_run
    finish(start("trial=reference", "actor.step_s=0.3", "trainer.save_every=1"))
    reference = read_jsonl(runs / "reference" / "samples.jsonl")

    # the step training version 4 waits for a file never written: the kill comes before the run could end
    proc = start("trial=killed", "actor.step_s=0.3", "trainer.save_every=1",
                 extra_env={"AREAL_TEST_HOLD_AT_VERSION": f"4:{runs / 'never'}"})
    samples = runs / "killed" / "samples.jsonl"
    wait_for_steps(samples, 3, proc)
    proc.send_signal(signal.SIGKILL)  # the launcher dies without cleanup; its children must follow
    proc.wait(scaled(30))
    assert (runs / "killed" / "logs" / "actor-rank0.log").exists()
    wait_until(lambda: not processes_mentioning(str(runs / "killed")), 15, "the run's processes to go")  # no orphan
    done_before = len(read_jsonl(samples))
    assert 3 <= done_before < 6

    finish(start("trial=killed", "actor.step_s=0.3", "trainer.save_every=1", "--resume"))
    assert "resume: continuing after step" in (runs / "killed" / "logs" / "actor-rank0.log").read_text()
    resumed = read_jsonl(samples)
    assert [s["step"] for s in resumed] == [1, 2, 3, 4, 5, 6]  # the final step, each step once
    assert [s["items"] for s in resumed] == [s["items"] for s in reference]  # no sample twice, none skipped
    assert [m["step"] for m in read_jsonl(runs / "killed" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def wait_for_steps(samples: Path, steps: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until ``samples`` records ``steps`` steps (scaled ``timeout_s``); the run must not end meanwhile."""
    wait_for_lines(samples, steps, proc, timeout_s)


def kill_when(proc: subprocess.Popen, samples: Path, steps: int, extra_s: float, run_dir: Path) -> None:
    """SIGKILL the launcher ``extra_s`` after ``steps`` steps are recorded; wait for its children to go. A run
    that could end meanwhile is held at a later step (AREAL_TEST_HOLD_AT_VERSION, the train engine double's)."""
    wait_for_steps(samples, steps, proc)
    time.sleep(extra_s)  # the moment of the kill, drawn by the test
    proc.send_signal(signal.SIGKILL)
    proc.wait(scaled(30))
    wait_until(lambda: not processes_mentioning(str(run_dir)), 15, f"the processes of {run_dir} to go")


@pytest.mark.parametrize("seed", [0, 1])
def test_resumed_runs_train_only_tokens_within_the_bound(rl_run, tmp_path, seed):
    """Killed at random moments and resumed twice: the engines restart from the base model, so the trainer must
    hand them the restored weights before anything is admitted. The train engine double records the lag of every
    loss token it is given (version at training minus the token's version), across all three processes."""
    import random

    start, runs = rl_run
    rng = random.Random(seed)
    lags = tmp_path / "lags.jsonl"
    args = ("trial=resumed", "rollout.max_head_offpolicyness=2", "rollout.batch_size=2", "actor.step_s=0.15",
            "trainer.save_every=2", "trainer.total_steps=10")
    env = {"AREAL_TEST_LAGS_FILE": str(lags)}
    samples = runs / "resumed" / "samples.jsonl"

    def held(steps: int) -> dict:
        """The run holds two steps after the kill's (at most the last, version 9), so it is killed mid-run."""
        return {**env, "AREAL_TEST_HOLD_AT_VERSION": f"{min(steps + 2, 9)}:{tmp_path / 'never'}"}

    steps = rng.randint(3, 5)
    kill_when(start(*args, extra_env=held(steps)), samples, steps, rng.random() * 0.3, runs / "resumed")
    steps = rng.randint(6, 8)
    kill_when(start(*args, "--resume", extra_env=held(steps)), samples, steps, rng.random() * 0.3, runs / "resumed")
    finish(start(*args, "--resume", extra_env=env))
    records = read_jsonl(lags)
    assert max(max(r["lags"]) for r in records) <= 2, [(r["version"], max(r["lags"])) for r in records]
    log = (runs / "resumed" / "logs" / "actor-rank0.log").read_text()
    assert "resume: the inference engines serve the restored weights" in log
    assert [m["step"] for m in read_jsonl(runs / "resumed" / "metrics.jsonl")] == list(range(1, 11))
    assert all(m["staleness/token_lag_max"] <= 2 for m in read_jsonl(runs / "resumed" / "metrics.jsonl"))


def teacher_forced_logprobs(model_dir: Path, record: dict) -> list[float]:
    """Each loss token's logprob under the HF model in ``model_dir`` (transformers, float32): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    out, cu, ids = [], record["cu_seqlens"], record["input_ids"]
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            seq = torch.tensor(ids[a:b])[None]
            logp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1).gather(1, seq[0, 1:, None])[:, 0]
            out += [0.0] + logp.tolist()
    return [lp for lp, m in zip(out, record["loss_mask"]) if m]


def test_the_first_resumed_batch_is_sampled_from_the_restored_weights(rl_run, tmp_path):
    """Real weights: the embedded engine serves a tiny model, fsdp trains it. After a kill, the first batch
    the resumed trainer gets was generated by the checkpoint's weights (teacher-forced by transformers), not by
    the base model the server restarted with."""
    pytest.importorskip("areal_fsdp")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    batches = tmp_path / "batches.jsonl"
    args = ("trial=real-resume", "allocation=local:cpu+fsdp:cpu", "rollout.backend=local", "actor.backend=fsdp",
            "algorithm.name=rl_recording_pg_double", f"model.path={model}", "model.dtype=float32",
            "actor.optimizer.lr=3e-2", "rollout.max_head_offpolicyness=1", "trainer.total_steps=5",
            "rollout.dynamic_filtering=true", "trainer.save_every=1")
    env = {"AREAL_TEST_BATCHES_FILE": str(batches)}
    run_dir = runs / "real-resume"
    kill_when(start(*args, extra_env=env), run_dir / "samples.jsonl", 3, 0.0, run_dir)
    checkpoints = run_dir / "checkpoints"
    restored = checkpoints / (checkpoints / "latest").read_text().strip()
    kept = shutil.copytree(restored / "actor", tmp_path / "restored")  # later saves prune it
    batches.unlink()
    finish(start(*args, "--resume", extra_env=env), timeout=scaled(600))
    first = read_jsonl(batches)[0]
    behaviour = [lp for lp, m in zip(first["logprobs"], first["loss_mask"]) if m]
    assert len(behaviour) > 4
    restored_lp = teacher_forced_logprobs(kept, first)
    base_lp = teacher_forced_logprobs(model, first)
    gap = max(abs(a - b) for a, b in zip(behaviour, restored_lp))
    base_gap = max(abs(a - b) for a, b in zip(behaviour, base_lp))
    assert gap < 1e-3, f"behaviour logprobs differ from the restored weights' by {gap}"
    assert base_gap > 1e-2, f"the base model gives the same logprobs ({base_gap}): the test could not tell"


def test_two_train_ranks_share_batches_and_checkpoints(rl_run):
    start, runs = rl_run
    finish(start("trial=ranks", "allocation=rl_infer_double:d2@cpu+rl_train_double:d2@cpu",
                 "trainer.total_steps=3", "trainer.save_every=1"))
    run_dir = runs / "ranks"
    assert [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")] == [1, 2, 3]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in latest.iterdir()) == ["actor", "controller.json", "manifest.json", "meta.json",
                                                          "rng-rank0.json", "rng-rank1.json"]
    assert "resume" not in (run_dir / "logs" / "actor-rank1.log").read_text()


def test_dynamic_filtering_rejects_groups_without_signal(rl_run):
    start, runs = rl_run
    finish(start("trial=filtered", "rollout.dynamic_filtering=true"))
    metrics = read_jsonl(runs / "filtered" / "metrics.jsonl")
    assert metrics[-1]["rollout/rejected"] > 0
    assert all(m["reward/std"] > 0 or m["reward/min"] != m["reward/max"] for m in metrics)


def test_evaluation_runs_before_beside_and_after_training(rl_run):
    start, runs = rl_run
    finish(start("trial=eval", "eval.size=5", "eval.every=2", "eval.samples=3"))
    evals = [m for m in read_jsonl(runs / "eval" / "metrics.jsonl") if "eval/accuracy" in m]
    after = [m["eval/after_step"] for m in evals]
    assert after[0] == 0 and after[-1] == 6 and evals[0]["step"] == 0 and evals[-1]["step"] == 6
    assert set(after[1:-1]) & {2, 4}, after  # started beside training, logged when it finished
    assert all(m["eval/items"] == 5 and 0 <= m["eval/accuracy"] <= 1 for m in evals)


def test_a_run_whose_groups_are_all_filtered_out_stops_with_the_fix(rl_run):
    start, runs = rl_run
    proc = start("trial=no-signal", "rollout.dynamic_filtering=true", "rollout.max_filtered_in_a_row=1")
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 1, out
    assert "dynamic filtering (rollout.dynamic_filtering) dropped 1 groups in a row" in out
    assert "rollout.dynamic_filtering=false" in out
    assert "Traceback" not in out


def test_a_crashing_trainer_is_reported_with_its_last_lines(rl_run):
    start, runs = rl_run
    proc = start("trial=crash", "actor.step_s=-1")  # time.sleep(-1) raises inside the train engine
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 1
    assert "areal run failed: actor-rank0 exited with code 1" in out
    assert "ValueError: sleep length must be non-negative" in out


def test_a_killed_trainer_is_reported_with_the_way_to_resume(rl_run):
    """SIGKILL of the trainer rank (as the out-of-memory killer does) after a checkpoint: the launcher's message
    says so and tells how to continue from it."""
    start, runs = rl_run
    # the step training version 3 waits for a file never written: the trainer is killed before the run could end
    proc = start("trial=oom", "actor.step_s=0.3", "trainer.save_every=1",
                 extra_env={"AREAL_TEST_HOLD_AT_VERSION": f"3:{runs / 'never'}"})
    samples = runs / "oom" / "samples.jsonl"
    wait_for_steps(samples, 2, proc)
    trainers = [pid for pid in processes_mentioning(str(runs / "oom")) if pid in processes_mentioning("areal_core.trainer")]
    assert trainers
    os.kill(trainers[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 1
    from areal_core.processes.supervisor import oom_kill_count

    if oom_kill_count() is not None:  # the cgroup's counter tells a kill from outside from the OOM killer
        assert "actor-rank0 was killed by signal 9 (SIGKILL) from outside the run: no process of this cgroup was " \
               "killed for memory meanwhile" in out, out
    else:
        assert "actor-rank0 was killed by signal 9 (SIGKILL) (sent by another process, or by the kernel's " \
               "out-of-memory killer" in out, out
    assert "The checkpoint of step" in out and "--resume" in out


def test_a_run_with_the_real_embedded_engine(rl_run, tmp_path):
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    finish(start("trial=embedded", "allocation=local:cpu+rl_train_double:cpu", "rollout.backend=local",
                 f"model.path={model}", "model.dtype=float32", "rollout.max_head_offpolicyness=1",
                 "trainer.total_steps=4"), timeout=scaled(300))
    run_dir = runs / "embedded"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["staleness/token_lag_max"] <= 1 for m in metrics)
    assert max(m["throughput/gen_tokens_per_s"] for m in metrics) > 0
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "areal_local.server" in server_log and "weights v4" in server_log


@pytest.mark.parametrize(("placement", "steps"), [
    ("fsdp:cpu", 3),
    # two ranks: the launcher starts both, the trainer hands the engine its placement, the weights are split
    # over them (the engine's own tests compare the numbers with one process)
    pytest.param("fsdp:t2@cpu", 2, marks=pytest.mark.slow),
], ids=["d1", "t2"])
def test_fsdp_trains_against_the_embedded_engine(rl_run, tmp_path, placement, steps):
    pytest.importorskip("areal_fsdp")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    trial = "fsdp-" + placement.split(":")[1].split("@")[0]
    finish(start(f"trial={trial}", f"allocation=local:cpu+{placement}", "rollout.backend=local",
                 "actor.backend=fsdp", "algorithm.name=rl_pg_double", f"model.path={model}", "model.dtype=float32",
                 "actor.optimizer.lr=1e-3", "rollout.max_head_offpolicyness=1", f"trainer.total_steps={steps}",
                 # every group carries reward signal, so no step has all-zero advantages (and gradient)
                 "rollout.dynamic_filtering=true", "trainer.save_every=1",
                 # the integrity gate: digests (on by default) and the parity probe at every update, which
                 # must pass with a real trainer and a real engine
                 "rollout.weight_probe_every=1"), timeout=scaled(600))
    run_dir = runs / trial
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    assert all(m["time/weight_digest_s"] > 0 and m["time/weight_digest_engines_s"] > 0 for m in metrics)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "model.safetensors").exists()
    assert f"weights v{steps}" in (run_dir / "logs" / "rollout-0.log").read_text()
    if "t2" in placement:
        assert "tensor parallel t2" in (run_dir / "logs" / "actor-rank1.log").read_text()


def test_a_critic_is_built_trained_saved_and_resumed_when_the_algorithm_asks_for_values(rl_run):
    start, runs = rl_run
    args = ("trial=critic", "algorithm.name=rl_value_double", "trainer.total_steps=4", "trainer.save_every=1")
    out = finish(start(*args))
    assert "areal run finished" in out
    run_dir = runs / "critic"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(m["critic/loss"] > 0 for m in metrics)
    values = [m["critic/value_mean"] for m in metrics]
    assert values[0] == 0.0 and values[-1] > 0.05  # from 0 towards the rewards (1/3 of them are 1)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    critic = json.loads((latest / "critic" / "state.json").read_text())
    assert critic["value_steps"] == 4 and critic["a"] != 0.0
    assert "value_steps" not in json.loads((latest / "actor" / "state.json").read_text())  # two engines

    finish(start(*args, "--resume"))
    log = (run_dir / "logs" / "actor-rank0.log").read_text()
    assert "critic double: loaded after 4 value steps" in log


@pytest.mark.slow
def test_grpo_with_decoupled_ppo_trains_fsdp_against_the_embedded_engine(rl_run, tmp_path):
    """The PPO plugin's grpo, proximal logprobs recomputed, on the real FSDP and embedded engines."""
    pytest.importorskip("areal_fsdp")
    pytest.importorskip("areal_ppo")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    finish(start("trial=grpo", "allocation=local:cpu+fsdp:cpu", "rollout.backend=local", "actor.backend=fsdp",
                 "algorithm.name=grpo", "algorithm.decoupled=true", "algorithm.prox_approx=recompute",
                 f"model.path={model}", "model.dtype=float32", "actor.optimizer.lr=1e-3",
                 "rollout.max_head_offpolicyness=1", "trainer.total_steps=3", "rollout.dynamic_filtering=true"),
           timeout=scaled(600))
    metrics = read_jsonl(runs / "grpo" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/grad_norm"] > 0 and math.isfinite(m["train/loss"]) for m in metrics)
    # Decoupled PPO ran: the behaviour weight pi_prox / pi_behav was measured on every step.
    assert all(0.0 < m["train/behav_weight_mean"] < 5.0 for m in metrics)
    assert all(m["train/behav_kept_frac"] > 0.5 for m in metrics)


def test_grpo_in_minibatches_and_epochs_clips_through_areal_run(rl_run, tmp_path):
    """actor.ppo_minibatches=2 x ppo_epochs=2 on the real FSDP and embedded engines: four optimizer steps per
    step, one version per step (the staleness bound and the hand-over count steps), and from the second
    optimizer step on the clip against the proximal policy (here loglinear) acts."""
    pytest.importorskip("areal_fsdp")
    pytest.importorskip("areal_ppo")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    finish(start("trial=minibatches", "allocation=local:cpu+fsdp:cpu", "rollout.backend=local", "actor.backend=fsdp",
                 "algorithm.name=grpo", "algorithm.eps_clip=0.001", f"model.path={model}", "model.dtype=float32",
                 "actor.optimizer.lr=1e-2", "actor.ppo_minibatches=2", "actor.ppo_epochs=2", "rollout.batch_size=2",
                 "rollout.max_head_offpolicyness=1", "trainer.total_steps=3", "rollout.dynamic_filtering=true"),
           timeout=scaled(600))
    run_dir = runs / "minibatches"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/n_optimizer_steps"] == 4 for m in metrics)
    assert all(m["staleness/token_lag_max"] <= 1 for m in metrics)
    assert max(m["train/clip_frac"] for m in metrics) > 0, [m["train/clip_frac"] for m in metrics]
    assert "weights v3" in (run_dir / "logs" / "rollout-0.log").read_text()


@pytest.mark.slow
def test_ppo_with_a_critic_trains_fsdp_against_the_embedded_engine(rl_run, tmp_path):
    """The PPO plugin's ppo: the fsdp engine builds the critic (value head), GAE advantages, a clipped value loss;
    the critic is checkpointed beside the actor (exact resume: plugins/engines/fsdp/tests/test_fsdp_critic.py)."""
    pytest.importorskip("areal_fsdp")
    pytest.importorskip("areal_ppo")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    args = ("trial=ppo", "allocation=local:cpu+fsdp:cpu", "rollout.backend=local", "actor.backend=fsdp",
            "algorithm.name=ppo", f"model.path={model}", "model.dtype=float32", "actor.optimizer.lr=1e-3",
            "rollout.max_head_offpolicyness=1", "trainer.save_every=1", "rollout.dynamic_filtering=true")
    finish(start(*args, "trainer.total_steps=2"), timeout=scaled(600))
    metrics = read_jsonl(runs / "ppo" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["critic/loss"]) and m["critic/grad_norm"] > 0 for m in metrics)
    latest = runs / "ppo" / "checkpoints" / (runs / "ppo" / "checkpoints" / "latest").read_text().strip()
    assert (latest / "critic" / "model.safetensors").exists()
    from safetensors.torch import load_file

    head = load_file(str(latest / "critic" / "model.safetensors"))["lm_head.weight"]
    assert tuple(head.shape)[0] == 1  # the value head, not the vocabulary projection


def test_groups_the_algorithm_drops_count_toward_max_filtered_in_a_row():
    """dapo's dynamic sampling drops groups through Algorithm.should_accept: those count like dynamic
    filtering's, so a task with no signal stops with the fix instead of waiting out the request timeout."""
    from types import SimpleNamespace

    from areal_core.trainer import FilteredOutError, Trainer

    verdicts: list[bool] = []
    algorithm = SimpleNamespace(should_accept=lambda group: verdicts.pop(0))
    cfg = SimpleNamespace(rollout=SimpleNamespace(dynamic_filtering=False, max_filtered_in_a_row=3),
                          algorithm=SimpleNamespace(name="dapo"))
    trainer = SimpleNamespace(cfg=cfg, algorithm=algorithm, _filtered_in_a_row=0)
    group = SimpleNamespace(rewards=[1.0, 1.0])
    verdicts += [False, False, True, False, False]
    assert [Trainer._should_accept(trainer, group) for _ in range(5)] == [False, False, True, False, False]
    assert trainer._filtered_in_a_row == 2  # the accepted group reset the count
    verdicts.append(False)
    with pytest.raises(FilteredOutError, match=r"the algorithm's filter \(dapo\) dropped 3 groups in a row.*"
                                                r"algorithm.dynamic_sampling=false"):
        Trainer._should_accept(trainer, group)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until ``path`` has ``n`` complete lines (within scaled ``timeout_s``); the run must not end meanwhile."""
    wait_until(lambda: proc.poll() is not None or (path.exists() and path.read_text().count("\n") >= n),
               timeout_s, f"{n} lines in {path}", 0.05)
    assert proc.poll() is None, proc.communicate()[0]


def real_server_pids(marker: str) -> list[int]:
    """Pids of embedded servers (``python -m areal_local.server``, not their trampolines) whose command line
    mentions ``marker``, in the order of their names (rollout-0 first)."""
    return launched_pids("areal_local.server", marker)


@pytest.mark.parametrize("sync", ["tensors", "disk"])
def test_elastic_restarts_a_killed_server_and_it_rejoins_with_the_current_weights(rl_run, tmp_path, sync):
    """Issue 21, item 1: SIGKILL one of two real embedded servers mid-run with rollout.elastic on. The launcher
    must not stop the run: the trainer drops the server (its requests continue on the other), the launcher
    restarts it on a new port, and it rejoins at the current version; every step is trained, lags stay bounded,
    the terminal says what happened, and nothing outlives the run."""
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    lags = tmp_path / f"lags-{sync}.jsonl"
    release = tmp_path / f"release-{sync}"
    proc = start(f"trial=elastic-{sync}", "allocation=local:d2@cpu+rl_train_double:cpu", "rollout.backend=local",
                 f"model.path={model}", "model.dtype=float32", f"rollout.weight_sync={sync}",
                 "rollout.max_head_offpolicyness=1", "trainer.total_steps=20", "actor.step_s=0.3",
                 "rollout.elastic.enabled=true", "rollout.elastic.interval_s=0.5",
                 "rollout.elastic.failure_threshold=2", "rollout.elastic.cooldown_s=0", "rollout.elastic.restarts=1",
                 # the step training version 15 waits for the test: the run outlasts the replacement's rejoining
                 # (a torch import and a model load) however slow the machine, and trains 5 versions after it
                 extra_env={"AREAL_TEST_LAGS_FILE": str(lags), "AREAL_TEST_HOLD_AT_VERSION": f"15:{release}"})
    run_dir = runs / f"elastic-{sync}"
    wait_for_lines(lags, 3, proc)
    victims = real_server_pids(str(model))
    assert [process_name(pid) for pid in victims] == ["rollout-0", "rollout-1"]
    os.kill(victims[1], signal.SIGKILL)
    wait_for_lines(run_dir / "events.jsonl", 2, proc, timeout_s=300)  # "left", then "joined"
    release.touch()
    out = finish(proc, timeout=scaled(300))
    assert "restarting it (restart 1 of 1, rollout.elastic.restarts)" in out
    assert "is back on 127.0.0.1:" in out
    assert "left routing" in out and "joined routing" in out  # the trainer's topology events, on the terminal
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in events] == ["left", "joined"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 21))
    trained = [json.loads(line) for line in lags.read_text().splitlines()]
    assert [t["version"] for t in trained] == list(range(20))
    assert max(max(t["lags"]) for t in trained) <= 1
    # The replacement loaded the trainer's weights when it joined and every version after (its own log): it
    # stayed in routing, where only routed servers get updates.
    restarted = (run_dir / "logs" / "rollout-1-restart1.log").read_text()
    joined_at = events[1]["step"]
    loads = [(int(v), int(n)) for v, n in re.findall(r"weights v(\d+) from .* \((\d+) requests continued\)",
                                                      restarted)]
    assert len(loads) >= 2 and loads[0][0] >= joined_at - 1 and loads == sorted(loads)
    assert not real_server_pids(str(model))  # nothing outlives the run


def test_elastic_without_restarts_left_goes_on_with_the_servers_left(rl_run, tmp_path):
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    proc = start("trial=elastic-norestart", "allocation=local:d2@cpu+rl_train_double:cpu", "rollout.backend=local",
                 f"model.path={model}", "model.dtype=float32", "rollout.max_head_offpolicyness=1",
                 "trainer.total_steps=10", "actor.step_s=0.3", "rollout.elastic.enabled=true",
                 "rollout.elastic.interval_s=0.5", "rollout.elastic.failure_threshold=2",
                 "rollout.elastic.restarts=0")
    metrics_file = runs / "elastic-norestart" / "metrics.jsonl"
    wait_for_lines(metrics_file, 2, proc)
    victims = real_server_pids(str(model))
    assert [process_name(pid) for pid in victims] == ["rollout-0", "rollout-1"]
    os.kill(victims[0], signal.SIGKILL)
    out = finish(proc, timeout=300)
    assert "no restarts left (rollout.elastic.restarts=0)" in out and "left routing" in out
    assert [m["step"] for m in read_jsonl(metrics_file)] == list(range(1, 11))
    assert not (runs / "elastic-norestart" / "logs" / "rollout-0-restart1.log").exists()


def test_a_run_torn_down_by_a_server_kill_leaves_no_weights_in_shared_memory(rl_run, tmp_path):
    """Issue 21, item 5: without elastic a killed server stops the run; the trainer's /dev/shm weights stage
    (hundreds of MB for a real model) must go with it, not wait for the next run's sweep. The launcher stops
    the trainer with SIGTERM, which the trainer turns into a normal exit so its cleanup runs."""
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    start, runs = rl_run
    lags = tmp_path / "lags.jsonl"
    proc = start("trial=shm", "allocation=local:d2@cpu+rl_train_double:cpu", "rollout.backend=local",
                 f"model.path={model}", "model.dtype=float32", "rollout.weight_sync=tensors",
                 "rollout.max_head_offpolicyness=1", "trainer.total_steps=200", "actor.step_s=0.3",
                 extra_env={"AREAL_TEST_LAGS_FILE": str(lags)})
    wait_for_lines(lags, 3, proc)
    trainers = [pid for pid in processes_mentioning(str(runs / "shm")) if pid in processes_mentioning("areal_core.trainer")]
    stages = [p for pid in trainers for p in Path("/dev/shm").glob(f"areal-weights-{pid}-*")]
    assert stages, "the trainer stages its weights in /dev/shm"
    os.kill(real_server_pids(str(model))[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 1 and "rollout-0 was killed by signal 9" in out
    assert not [p for p in stages if p.exists()]
