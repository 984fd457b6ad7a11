"""What MegatronEngine.initialize refuses, `areal check` refuses too, and `areal run` refuses before it starts
anything: the same verdict three ways, for each refusal the engine can make from the config and the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from areal_core.api import Context  # noqa: E402
from areal_core.config.allocation import parse_allocation  # noqa: E402
from areal_core.testing import rl_doubles, tiny_model  # noqa: E402
from areal_core.testing.train import engine_run_config  # noqa: E402
from areal_core.testing.waits import scaled  # noqa: E402

AREAL = str(Path(sys.executable).with_name("areal"))

# name: (overrides beyond the model, the problem code, what the engine's own refusal says, engine spec)
CASES = {
    "cpu-bfloat16": (["model.dtype=bfloat16"], "megatron.cpu-dtype", "needs mixed precision",
                     {"dtype": "bfloat16"}),
    "cpu-recompute": (["model.dtype=float32", "actor.gradient_checkpointing=true"], "megatron.cpu-recompute",
                      "activation recomputation uses Megatron's CUDA RNG", {"gradient_checkpointing": True}),
    "sliding-window": (["model.dtype=float32"], "megatron.architecture", "use_sliding_window is not converted", {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-refusals")
    llama = tiny_model(root / "llama", arch="llama", seed=0)
    qwen = tiny_model(root / "qwen2-sliding", arch="qwen2", seed=1)
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 64}))
    return {"llama": llama, "sliding": qwen}


def areal(command: str, folder: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    with rl_doubles.installed(folder) as (config, env):
        return subprocess.run([AREAL, command, str(config), f"output_dir={folder / 'runs'}", "trial=refused",
                               *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=scaled(120))


def megatron_overrides(model: Path) -> list[str]:
    return ["allocation=rl_infer_double:cpu+megatron:cpu", "actor.backend=megatron", f"model.path={model}"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_run_and_the_engine_refuse_alike(models, tmp_path, case):
    from areal_megatron.engine import MegatronEngine, MegatronEngineConfig

    overrides, code, engine_says, spec = CASES[case]
    model = models["sliding" if case == "sliding-window" else "llama"]
    args = [*megatron_overrides(model), *overrides]
    check = areal("check", tmp_path, args)
    assert check.returncode == 1 and f"[{code}]" in check.stdout, check.stdout
    assert "Traceback" not in check.stdout
    run = areal("run", tmp_path, args)
    assert run.returncode == 1 and f"[{code}]" in run.stdout, run.stdout
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made, nothing started
    (placement,) = parse_allocation("megatron:cpu").components
    engine = MegatronEngine.create(Context(config=engine_run_config({"model": str(model), **spec}),
                                           options=MegatronEngineConfig(), placement=placement,
                                           extras={"role": "actor"}))
    with pytest.raises(NotImplementedError, match=engine_says):
        engine.initialize()


def test_what_the_engine_builds_on_cpu_the_check_passes(models, tmp_path):
    check = areal("check", tmp_path, [*megatron_overrides(models["llama"]), "model.dtype=float32"])
    assert check.returncode == 0, check.stdout
    assert "OK. allocation rl_infer_double:cpu+megatron:cpu" in check.stdout
