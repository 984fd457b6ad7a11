"""``areal run`` with the fsdp train engine and the embedded inference engine, weights handed over as tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_core.testing import requires_plugin, scaled, wait_until

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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(300))
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


class KilledRun:
    """``areal run`` with the fsdp trainer and the embedded engine, weights as tensors through /dev/shm with the
    integrity gate on, whose trainer a test SIGKILLs at a moment it picks (:meth:`kill_when`); then
    :meth:`check_stopped` and :meth:`check_resumed` check the documented outcome."""

    STEPS = 8

    def __init__(self, tmp_path: Path, trial: str, *overrides: str) -> None:
        from areal_core.testing import tiny_model

        model = tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, layers=4)  # an export of ~1 ms, not ~0.1
        (tmp_path / "t5_parity_reward.py").write_text(REWARD_MODULE)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
                    "OMP_NUM_THREADS": "1"}
        runs = tmp_path / "runs"
        self.run_dir = runs / "kill" / trial
        self.cmd = [AREAL, "run", f"output_dir={runs}", "experiment=kill", f"trial={trial}",
                    "allocation=local:cpu+fsdp:cpu", f"model.path={model}", "rollout.weight_sync=tensors",
                    "rollout.weight_check=on", f"trainer.total_steps={self.STEPS}", "trainer.save_every=2",
                    "rollout.batch_size=2", "rollout.group_size=4", "rollout.sampling.max_new_tokens=8", "eval.size=0",
                    "rollout.max_head_offpolicyness=1", "reward.name=function",
                    "reward.target=t5_parity_reward:score", *overrides]
        self.trainer: int | None = None

    def kill_when(self, ready: Any, moment: Any, what: str) -> Any:
        """Start the run; once ``ready(trainer_pid)`` gives something (polled every 0.05 s) and then
        ``moment(that)`` does (polled as fast as it goes), SIGKILL the trainer; both's results. Fails if the run
        ends first or ``scaled(180)`` s pass."""
        import signal
        import time

        from areal_core.testing.processes import launched_pids

        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        try:
            limit = scaled(180)
            deadline = time.monotonic() + limit
            got = None
            while got is None:
                assert self.proc.poll() is None, self.proc.communicate()[0][-4000:]
                assert time.monotonic() < deadline, f"waited {limit:.0f} s for the run's trainer ({what})"
                pids = launched_pids("areal_core.trainer", str(self.run_dir))
                if pids:
                    self.trainer = pids[0]
                    got = ready(self.trainer)
                time.sleep(0.05)
            caught = None
            while caught is None:
                assert self.proc.poll() is None, self.proc.communicate()[0][-4000:]
                assert time.monotonic() < deadline, f"waited {limit:.0f} s for {what} to catch"
                caught = moment(got)
            os.kill(self.trainer, signal.SIGKILL)
            self.out, _ = self.proc.communicate(timeout=scaled(60))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        return got, caught

    def check_stopped(self) -> None:
        """The run stopped naming the rank, and nothing of it outlives the killed trainer."""
        from areal_core.testing.processes import processes_mentioning

        assert self.proc.returncode == 1 and "actor-rank0 was killed by signal 9" in self.out, self.out[-4000:]
        wait_until(lambda: processes_mentioning(str(self.run_dir)) == [], 20,
                   "the processes of the run to end after the killed trainer", 0.1)

    def check_resumed(self) -> list[dict]:
        """``--resume`` finishes every step once, the gate checking every update, and nothing of the dead trainer
        is left in /dev/shm; the metrics."""
        from areal_core.testing.processes import read_jsonl

        resumed = subprocess.run(self.cmd + ["--resume"], env=self.env, capture_output=True, text=True,
                                 timeout=scaled(300))
        assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(1, self.STEPS + 1))
        assert all(m["time/weight_digest_s"] > 0 for m in metrics)  # the gate checked every update, resumed ones too
        assert "resume: the inference engines serve the restored weights" in \
            (self.run_dir / "logs" / "actor-rank0.log").read_text()
        left = [p.name for p in Path("/dev/shm").iterdir()
                if p.name.startswith(("areal-weights-", "areal-delta-")) and f"-{self.trainer}-" in p.name]
        assert left == [], left
        return metrics


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
    from safetensors import safe_open

    from areal_core.testing.processes import read_jsonl

    run = KilledRun(tmp_path, "export", "model.dtype=float32", "rollout.weight_delta=off", "actor.optimizer.lr=1e-3")

    def stage_after_step_2(trainer: int) -> Path | None:  # rank 0 holds the stage
        found = sorted(Path("/dev/shm").glob(f"areal-weights-{trainer}-*"))
        return found[0] if found and len(read_jsonl(run.run_dir / "metrics.jsonl")) >= 2 else None

    def being_written(folder: Path) -> Path | None:  # a stage file whose header length is zero
        return next((file for file, head in _stage_headers(folder).items() if head == bytes(8)), None)

    folder, caught = run.kill_when(stage_after_step_2, being_written, "an export into the stage")
    run.check_stopped()
    # The file the dead trainer was writing reads as incomplete to any safetensors reader, not as a version
    assert _stage_headers(folder)[caught] == bytes(8)
    with pytest.raises(Exception):
        with safe_open(str(caught), "pt") as f:
            list(f.keys())
    assert folder.exists()  # SIGKILL skips every cleanup: the next stage on this machine must sweep it
    run.check_resumed()
    assert not folder.exists()


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
    from areal_core.testing.processes import read_jsonl

    # lr 1e-5 on bf16 weights: few elements change bits per step, so the updates after the first go as deltas
    run = KilledRun(tmp_path, "delta", "model.dtype=bfloat16", "rollout.weight_delta=auto", "actor.optimizer.lr=1e-5")

    def after_step_1(trainer: int) -> str | None:
        return f"areal-delta-{trainer}-" if read_jsonl(run.run_dir / "metrics.jsonl") else None

    def a_delta_folder(prefix: str) -> Path | None:  # it exists only while a delta is written or applied
        return next((Path(e.path) for e in os.scandir("/dev/shm") if e.name.startswith(prefix)), None)

    _, caught = run.kill_when(after_step_1, a_delta_folder, "a delta update")
    run.check_stopped()
    assert caught.exists()  # SIGKILL skips every cleanup: the next stage on this machine must sweep it
    metrics = run.check_resumed()
    assert any(m.get("weight_sync/delta_bytes", 0) > 0 for m in metrics), \
        "no update went as a delta: the test did not exercise what it kills"
    assert not caught.exists()
