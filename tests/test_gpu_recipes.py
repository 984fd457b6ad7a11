"""The GPU recipes in examples/gpu/ pass `areal check` as written, with their hub models' real shapes: a stand-in
of the hub on 127.0.0.1 serves the Qwen2.5 configs (their published sizes), so the plan rules judge the
allocations against the real head and layer counts, and GSM8K's two parquet files at the paths the recipes name
(holding the repository's GSM8K-format sample, not GSM8K); the vLLM interpreter is a stand-in (the GPU vLLM is
not installable here). The SLURM recipe's job is also written (`--dry-run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.distributions import interpreter_with
from areal_core.testing.hub import serve
from areal_core.testing.waits import scaled

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "gpu").glob("*.yaml"))
AREAL = str(Path(sys.executable).with_name("areal"))
# config.json facts of the models the recipes name (Qwen2.5 *-Instruct, as published on the hub)
QWEN = {
    "Qwen2.5-0.5B-Instruct": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                  num_hidden_layers=24, intermediate_size=4864, tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                                  num_hidden_layers=28, intermediate_size=8960, tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                num_hidden_layers=28, intermediate_size=18944, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    for name, shape in QWEN.items():
        folder = root / "models" / "Qwen" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
            "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "use_sliding_window": False, **shape}))
    import pyarrow as pa
    import pyarrow.parquet as pq

    gsm8k = root / "datasets" / "openai" / "gsm8k" / "main"
    gsm8k.mkdir(parents=True)
    for sample, name in (("train", "train"), ("val", "test")):
        rows = [json.loads(line) for line in (ROOT / "examples" / "data" / f"gsm8k_format_{sample}.jsonl").open()]
        pq.write_table(pa.Table.from_pylist(rows), gsm8k / f"{name}-00000-of-00001.parquet")
    python = interpreter_with(root / "vllm-env", "vllm", "0.32.0")
    with serve(root) as endpoint:
        yield endpoint, python, root


def areal(hub, tmp_path, *args):
    endpoint, python, _ = hub
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"))
    return subprocess.run([AREAL, *args, f"rollout.python={python}", f"output_dir={tmp_path / 'runs'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(180))  # `areal plan` takes ~35 s alone


def test_there_are_recipes_for_one_gpu_eight_and_two_nodes():
    assert [p.name for p in RECIPES] == ["gsm8k_qwen2.5-0.5b_1gpu.yaml", "gsm8k_qwen2.5-1.5b_8gpu.yaml",
                                         "gsm8k_qwen2.5-7b_2nodes_ray.yaml", "gsm8k_qwen2.5-7b_2nodes_slurm.yaml"]


# the one-GPU recipe by default; the others (~4 s each) in CI's slow suite
@pytest.mark.parametrize("recipe", [pytest.param(p, marks=() if "1gpu" in p.name else pytest.mark.slow)
                                    for p in RECIPES], ids=[p.stem for p in RECIPES])
def test_each_recipe_passes_the_check_with_its_models_real_shape(hub, tmp_path, recipe):
    checked = areal(hub, tmp_path, "check", str(recipe))
    said = checked.stdout + checked.stderr
    assert checked.returncode == 0, said
    assert "OK. allocation" in said
    fetched = (hub[2] / "requests.log").read_text()
    model = next(name for name in QWEN if name in recipe.read_text())
    assert f"/Qwen/{model}/resolve/" in fetched  # its config came from the hub, and GSM8K's files
    assert "/datasets/openai/gsm8k/resolve/main/main/test-00000-of-00001.parquet" in fetched


def test_the_plan_rules_read_the_hub_models_heads(hub, tmp_path):
    """The 7B recipe at t3 is refused: 28 heads are not divisible by 3, which only the model's config says."""
    recipe = ROOT / "examples" / "gpu" / "gsm8k_qwen2.5-7b_2nodes_ray.yaml"
    refused = areal(hub, tmp_path, "check", str(recipe), "allocation=vllm:d4t3+fsdp:d4")
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "[vllm.tensor-heads]" in said and "28 attention heads" in said, said


@pytest.mark.slow
def test_the_slurm_recipe_writes_its_job(hub, tmp_path):
    recipe = ROOT / "examples" / "gpu" / "gsm8k_qwen2.5-7b_2nodes_slurm.yaml"
    dry = areal(hub, tmp_path, "run", str(recipe), "--dry-run")
    said = dry.stdout + dry.stderr
    assert dry.returncode == 0, said
    assert "#SBATCH --nodes=2" in said and "#SBATCH --partition=gpu" in said, said


# the multi-GPU recipes' splits and the profile each is planned with (the 1-GPU recipe is colocated: no split)
PLANNED = {"gsm8k_qwen2.5-1.5b_8gpu.yaml": (8, "qwen2.5-1.5b-h800"),
           "gsm8k_qwen2.5-7b_2nodes_ray.yaml": (16, "qwen2.5-7b-h800"),
           "gsm8k_qwen2.5-7b_2nodes_slurm.yaml": (16, "qwen2.5-7b-h800")}  # with launcher.nodes=2


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANNED))
def test_each_multi_gpu_recipe_uses_the_split_areal_plan_chooses(hub, tmp_path, name):
    """`areal plan` (the simulator, with the recipe's model from the hub stand-in and the H800 profile of its
    size) chooses the recipe's own allocation, with the recipe's staleness bound the best or within 2 % of it:
    the command each recipe's comment names. ~20-35 s each."""
    import re

    import yaml

    recipe = ROOT / "examples" / "gpu" / name
    gpus, profile = PLANNED[name]
    planned = areal(hub, tmp_path, "plan", str(recipe), "--gpus", str(gpus), "--profile", profile, "--steps", "12",
                    "--eta", "0,2,4")
    said = planned.stdout + planned.stderr
    assert planned.returncode == 0, said
    config = yaml.safe_load(recipe.read_text())
    assert f"--gpus {gpus} --profile" in recipe.read_text().replace("\n# ", " ")  # the comment names the command
    best = re.search(r"^allocation: (\S+)\s+rollout\.max_head_offpolicyness=(\d+)\n\s+predicted ([\d.]+) samples/s",
                     said, re.M)
    assert best is not None, said
    assert best[1] == config["allocation"], said
    eta = config["rollout"]["max_head_offpolicyness"]
    if int(best[2]) != eta:
        runner = re.search(rf"^runner-up: {re.escape(best[1])}\s+rollout\.max_head_offpolicyness={eta}: "
                           rf"([\d.]+) samples/s", said, re.M)
        assert runner is not None and float(runner[1]) >= 0.98 * float(best[3]), said


@pytest.mark.slow
def test_the_one_gpu_recipes_device_script_runs_here_on_cpu(tmp_path):
    """scripts/device_check_recipe_1gpu.sh --cpu: the recipe's shape with a tiny model, the trainer on the CPU
    (~20 s), so the script a lent GPU runs cannot rot between device sessions."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check_recipe_1gpu.sh"), "--cpu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "=== recipe check passed" in done.stdout
    assert (tmp_path / "out" / "metrics.jsonl").exists()
