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
