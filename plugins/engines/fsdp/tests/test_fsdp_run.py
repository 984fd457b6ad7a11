"""``areal run`` with the fsdp train engine and the embedded inference engine, weights handed over as tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing import requires_plugin

pytest.importorskip("areal_fsdp")
torch = pytest.importorskip("torch")

AREAL = str(Path(sys.executable).with_name("areal"))

# Rewards that differ within a group on a random model's text, so GRPO's advantages (and gradients) are not zero.
REWARD_MODULE = '''
def score(prompt, completion, item):
    return float(sum(map(ord, completion)) % 2)
'''


# What the run takes from other plugins, found by entry point as `areal run` finds it: the embedded
# inference engine, and the default algorithm, workflow and dataset.
@requires_plugin("areal.engines.inference", "local")
@requires_plugin("areal.algorithms", "grpo")
@requires_plugin("areal.workflows", "rlvr")
@requires_plugin("areal.datasets", "arithmetic")
@pytest.mark.parametrize(("actor", "lora"), [
    pytest.param("fsdp:cpu", False, id="full", marks=pytest.mark.slow),
    pytest.param("fsdp:cpu", True, id="lora", marks=pytest.mark.slow),
    # Four train ranks, tensor x data parallel: about 15 s on 2 CPU cores.
    pytest.param("fsdp:d2t2@cpu", False, id="d2t2"),
    # Two train ranks, context parallel (each holds half of every packed row): about 10 s.
    pytest.param("fsdp:c2@cpu", False, id="c2"),
    # Four train ranks, context x tensor parallel (half of every row, half of the heads each).
    pytest.param("fsdp:c2t2@cpu", False, id="c2t2"),
])
def test_a_run_syncs_weights_as_tensors_through_shared_memory(tmp_path, actor, lora):
    from safetensors.torch import load_file

    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    (tmp_path / "t5_parity_reward.py").write_text(REWARD_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    runs = tmp_path / "runs"
    cmd = [AREAL, "run", f"output_dir={runs}", "experiment=sync", "trial=tensors", f"allocation=local:cpu+{actor}",
           f"model.path={model}", "model.dtype=float32", "rollout.weight_sync=tensors", "trainer.total_steps=3",
           "rollout.batch_size=2", "rollout.group_size=4", "rollout.sampling.max_new_tokens=8", "eval.size=0",
           "rollout.max_head_offpolicyness=1", "actor.optimizer.lr=1e-3", "reward.name=function",
           "reward.target=t5_parity_reward:score", "rollout.dynamic_filtering=true"]
    if lora:  # adapters trained, merged weights sent
        cmd += ["actor.lora_rank=4", "actor.lora_target_modules=[q_proj,v_proj]", "actor.optimizer.lr=1e-2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = runs / "sync" / "tensors"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    assert all(m["time/weight_sync_s"] > 0 for m in metrics)
    # No weight folder in the run: each version went through /dev/shm, and the server took every one.
    assert not (run_dir / "weights").exists()
    if actor == "fsdp:d2t2@cpu":  # the launcher started d x t ranks and the engine built the (dp, tp) mesh
        assert "rank 3/4 on cpu, tensor parallel t2 x FSDP data parallel d2" in (
            run_dir / "logs" / "actor-rank3.log").read_text()
    if actor == "fsdp:c2@cpu":  # two ranks, one context group, FSDP over both
        assert "rank 1/2 on cpu, context parallel c2 (FSDP shards over d1 x c2), float32, attention areal_cp_sdpa" in (
            run_dir / "logs" / "actor-rank1.log").read_text()
    if actor == "fsdp:c2t2@cpu":  # one (cp, tp) block of four ranks, FSDP over the cp ranks beside tp
        assert "rank 3/4 on cpu, tensor parallel t2 x context parallel c2 (FSDP shards over d1 x c2), float32, " \
               "attention areal_cp_sdpa" in (run_dir / "logs" / "actor-rank3.log").read_text()
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    # The first version goes whole; later ones may go as deltas (rollout.weight_delta=auto) when under half the
    # elements changed: with LoRA only the adapted q/v matrices change, so they must.
    assert "weights v1 from /dev/shm/areal-weights-" in server_log, server_log[-2000:]
    for version in (2, 3):
        kinds = ("areal-delta-",) if lora else ("areal-weights-", "areal-delta-")
        assert any(f"weights v{version} from /dev/shm/{kind}" in server_log for kind in kinds), server_log[-2000:]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    trained = load_file(latest / "actor" / "model.safetensors")
    initial = load_file(Path(model) / "model.safetensors")
    moved = max((trained[k] - initial[k]).abs().max().item() for k in initial)
    if lora:  # the checkpoint keeps the frozen base and the trained adapters beside it
        assert moved == 0.0
        adapters = load_file(latest / "actor" / "adapter" / "adapter_model.safetensors")
        assert any(".lora_B." in n and t.abs().max() > 0 for n, t in adapters.items())
    else:
        assert moved > 1e-4


def test_tensor_sync_with_an_engine_that_cannot_take_tensors_names_the_key_and_the_fix():
    from types import SimpleNamespace

    from areal_core.config.schema import RunConfig
    from areal_core.trainer import Trainer

    cfg = RunConfig()
    cfg.rollout.weight_sync, cfg.rollout.backend = "tensors", "disk_only"
    fake = SimpleNamespace(cfg=cfg, actor=SimpleNamespace(capabilities=frozenset({"export_tensors"})))
    engines = [SimpleNamespace(capabilities=frozenset({"update_weights_from_disk"}))]
    with pytest.raises(ValueError, match="rollout.weight_sync: 'tensors' cannot be used: rollout.backend "
                                         "'disk_only' does not declare 'update_weights_from_tensors'.*"
                                         "rollout.weight_sync=disk"):
        Trainer._check_weight_sync(fake, engines)
    fake.actor = SimpleNamespace(capabilities=frozenset())
    engines = [SimpleNamespace(capabilities=frozenset({"update_weights_from_tensors"}))]
    with pytest.raises(ValueError, match="actor.backend 'fsdp' does not declare 'export_tensors'"):
        Trainer._check_weight_sync(fake, engines)
    cfg.rollout.weight_sync = "disk"
    Trainer._check_weight_sync(fake, [])  # the default needs neither


def _stage_headers(folder: Path) -> dict[Path, bytes]:
    """The first 8 bytes (the safetensors header length) of each stage file in ``folder``."""
    out = {}
    for file in sorted(folder.glob("slot*/model.safetensors")):
        with open(file, "rb") as f:
            out[file] = f.read(8)
    return out


@requires_plugin("areal.engines.inference", "local")
@requires_plugin("areal.algorithms", "grpo")
@requires_plugin("areal.workflows", "rlvr")
@requires_plugin("areal.datasets", "arithmetic")
@pytest.mark.slow
def test_a_trainer_killed_while_it_exports_into_the_stage_resumes_and_leaves_no_shared_memory(tmp_path):
    """The /dev/shm stage under a real kill (issue 26): the fsdp trainer exports each version straight into a
    stage file (``export_into``), whose header length is zeroed while its bytes change. The trainer is SIGKILLed
    at such a moment, found by watching the files' first bytes. Then: the half-written file is refused by an
    independent safetensors reader, the run stops naming the rank, nothing of the run outlives it, and
    ``--resume`` finishes every step once with the integrity gate on, its first stage sweeping the dead
    trainer's folder, and nothing is left in /dev/shm after it."""
    import signal
    import time

    from safetensors import safe_open

    from areal_core.testing import tiny_model
    from areal_core.testing.processes import launched_pids, processes_mentioning, read_jsonl

    model = tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, layers=4)  # an export of ~1 ms, not ~0.1
    (tmp_path / "t5_parity_reward.py").write_text(REWARD_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    runs, steps = tmp_path / "runs", 8
    run_dir = runs / "kill" / "export"
    cmd = [AREAL, "run", f"output_dir={runs}", "experiment=kill", "trial=export", "allocation=local:cpu+fsdp:cpu",
           f"model.path={model}", "model.dtype=float32", "rollout.weight_sync=tensors", "rollout.weight_delta=off",
           "rollout.weight_check=on", f"trainer.total_steps={steps}", "trainer.save_every=2", "rollout.batch_size=2",
           "rollout.group_size=4", "rollout.sampling.max_new_tokens=8", "eval.size=0",
           "rollout.max_head_offpolicyness=1", "actor.optimizer.lr=1e-3", "reward.name=function",
           "reward.target=t5_parity_reward:score"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        trainer, folder = None, None
        while folder is None:  # the trainer (rank 0 holds the stage) and its stage folder, after step 2
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "waited 180 s for the run's trainer, its stage and step 2"
            pids = launched_pids("areal_core.trainer", str(run_dir))
            if pids and len(read_jsonl(run_dir / "metrics.jsonl")) >= 2:
                trainer = pids[0]
                found = sorted(Path("/dev/shm").glob(f"areal-weights-{trainer}-*"))
                folder = found[0] if found else None
            time.sleep(0.05)
        caught = None
        while caught is None:  # a stage file whose header length is zero: a version is being written into it
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "waited 180 s for an export into the stage to catch"
            caught = next((file for file, head in _stage_headers(folder).items() if head == bytes(8)), None)
        os.kill(trainer, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1 and "actor-rank0 was killed by signal 9" in out, out[-4000:]
    # The file the dead trainer was writing reads as incomplete to any safetensors reader, not as a version
    assert _stage_headers(folder)[caught] == bytes(8)
    with pytest.raises(Exception):
        with safe_open(str(caught), "pt") as f:
            list(f.keys())
    deadline = time.monotonic() + 20
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == [], "processes of the run outlived the killed trainer"
    assert folder.exists()  # SIGKILL skips every cleanup: the next stage on this machine must sweep it

    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["time/weight_digest_s"] > 0 for m in metrics)  # the gate checked every update, resumed ones too
    assert "resume: the inference engines serve the restored weights" in \
        (run_dir / "logs" / "actor-rank0.log").read_text()
    assert not folder.exists()
    left = [p.name for p in Path("/dev/shm").iterdir()
            if p.name.startswith(("areal-weights-", "areal-delta-")) and f"-{trainer}-" in p.name]
    assert left == [], left


@requires_plugin("areal.engines.inference", "local")
@requires_plugin("areal.algorithms", "grpo")
@requires_plugin("areal.workflows", "rlvr")
@requires_plugin("areal.datasets", "arithmetic")
@pytest.mark.slow
def test_a_trainer_killed_during_a_delta_update_resumes_and_leaves_no_shared_memory(tmp_path):
    """A delta update under a real kill (issue 26): with bf16 weights and ``rollout.weight_delta: auto`` the
    trainer hands each version after the first over as a delta, a safetensors file in a folder of its own in
    /dev/shm (``areal-delta-<pid>-...``) that lives while it is written and the server applies it. The trainer
    is SIGKILLed as soon as such a folder appears. Then the run stops naming the rank, nothing of the run
    outlives it, the folder is still there (SIGKILL skips every cleanup), and ``--resume`` finishes every step
    once with the integrity gate on, sweeping the dead trainer's folders: nothing of it is left in /dev/shm."""
    import signal
    import time

    from areal_core.testing import tiny_model
    from areal_core.testing.processes import launched_pids, processes_mentioning, read_jsonl

    model = tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, layers=4)
    (tmp_path / "t5_parity_reward.py").write_text(REWARD_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    runs, steps = tmp_path / "runs", 8
    run_dir = runs / "kill" / "delta"
    # lr 1e-5 on bf16 weights: few elements change bits per step, so every update after the first is a delta
    cmd = [AREAL, "run", f"output_dir={runs}", "experiment=kill", "trial=delta", "allocation=local:cpu+fsdp:cpu",
           f"model.path={model}", "model.dtype=bfloat16", "rollout.weight_sync=tensors", "rollout.weight_delta=auto",
           "rollout.weight_check=on", f"trainer.total_steps={steps}", "trainer.save_every=2", "rollout.batch_size=2",
           "rollout.group_size=4", "rollout.sampling.max_new_tokens=8", "eval.size=0",
           "rollout.max_head_offpolicyness=1", "actor.optimizer.lr=1e-5", "reward.name=function",
           "reward.target=t5_parity_reward:score"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        trainer = None
        while trainer is None:  # the trainer (rank 0 hands the weights over), after its first step
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "waited 180 s for the run's trainer and its step 1"
            pids = launched_pids("areal_core.trainer", str(run_dir))
            if pids and read_jsonl(run_dir / "metrics.jsonl"):
                trainer = pids[0]
            time.sleep(0.05)
        prefix, caught = f"areal-delta-{trainer}-", None
        while caught is None:  # a delta being written or applied: its folder exists only meanwhile
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "waited 180 s for a delta update to catch"
            caught = next((Path(e.path) for e in os.scandir("/dev/shm") if e.name.startswith(prefix)), None)
        os.kill(trainer, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1 and "actor-rank0 was killed by signal 9" in out, out[-4000:]
    deadline = time.monotonic() + 20
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == [], "processes of the run outlived the killed trainer"
    assert caught.exists()  # SIGKILL skips every cleanup: the next stage on this machine must sweep it

    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["time/weight_digest_s"] > 0 for m in metrics)  # the gate checked every update, resumed ones too
    assert any(m.get("weight_sync/delta_bytes", 0) > 0 for m in metrics), \
        "no update went as a delta: the test did not exercise what it kills"
    assert not caught.exists()
    left = [p.name for p in Path("/dev/shm").iterdir()
            if p.name.startswith(("areal-weights-", "areal-delta-")) and f"-{trainer}-" in p.name]
    assert left == [], left
