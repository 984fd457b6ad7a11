"""A short `areal run` with `actor.backend: megatron` against the embedded (local) inference engine."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from areal_core.testing import requires_plugin  # noqa: E402
from areal_core.testing import rl_doubles  # noqa: E402

# The rollout side is the embedded inference engine, another plugin: found by its entry point.
pytestmark = requires_plugin("areal.engines.inference", "local")

# The core's RL doubles (areal_core.testing.rl_doubles: dataset, workflow, reward, algorithm), installed as a
# fake distribution; the train engine is the real megatron one.

GRPO_WITH_KL = ("algorithm.name=grpo", "algorithm.decoupled=true", "algorithm.prox_approx=recompute",
                "algorithm.kl_coef=0.01")


@pytest.mark.slow
@pytest.mark.parametrize(("placement", "weight_sync", "algorithm"), [
    ("megatron:cpu", "disk", ("algorithm.name=rl_pg_double",)),
    ("megatron:t2@cpu", "tensors", ("algorithm.name=rl_pg_double",)),
    # the PPO plugin's grpo: proximal logprobs recomputed, KL to a megatron reference engine (role reference)
    pytest.param("megatron:t2@cpu", "disk", GRPO_WITH_KL, marks=requires_plugin("areal.algorithms", "grpo")),
    # two pipeline stages: the first stage's rank 0 drives the trainer with what the last stage computed
    ("megatron:p2@cpu", "tensors", ("algorithm.name=rl_pg_double",)),
], ids=["t1-disk", "t2-tensors", "t2-grpo-kl", "p2-tensors"])
def test_megatron_trains_against_the_embedded_engine(tmp_path, placement, weight_sync, algorithm):
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    proc, run_dir = rl_doubles.areal_run(tmp_path, "megatron", [
        f"allocation=local:cpu+{placement}", f"rollout.weight_sync={weight_sync}", "rollout.backend=local",
        "actor.backend=megatron", *algorithm, f"model.path={model}", "model.dtype=float32", "actor.optimizer.lr=1e-3",
        "rollout.max_head_offpolicyness=1", "trainer.total_steps=3", "rollout.dynamic_filtering=true",
        "trainer.save_every=1"], timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    if algorithm is GRPO_WITH_KL:
        assert all(0.0 < m["train/behav_weight_mean"] < 5.0 for m in metrics)
        kl = [k for k in metrics[-1] if "kl" in k.lower()]
        assert kl, f"no KL metric among {sorted(metrics[-1])}"
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "model.safetensors").exists()
    assert "weights v3" in (run_dir / "logs" / "rollout-0.log").read_text()
    if placement.startswith(("megatron:t2", "megatron:p2")):
        assert (run_dir / "logs" / "actor-rank1.log").exists()  # two tensor-parallel ranks / stages took part
