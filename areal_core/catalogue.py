"""What this project ships, for messages about what is *not* installed.

When a config names a component no installed distribution provides (``allocation: vllm:d1`` without the vLLM
plugin, ``algorithm.name: grpo`` with the core alone), nothing installed can say which distribution would
provide it: entry points are read from installed metadata only. This module is that list for the first-party
distributions, kept by hand and checked against every first-party ``pyproject.toml`` by
``tests/test_catalogue.py`` (the names, the extras of the meta-distribution, and every component each plugin
declares), so it cannot drift from what is built.

Names: ``areal`` on the Python package index belongs to another project, so the meta-distribution is
``areal-rl`` (with extras: ``areal-rl[vllm]``); the core is ``areal-core`` and each plugin
``areal-plugin-<name>``. Each name was free on the index when chosen (``bash scripts/build_wheels.sh
--check-names`` asks again). None is published yet (:data:`PUBLISHED`): until then every install line names
the wheels ``scripts/build_wheels.sh`` builds, and the editable install of a checkout.
"""

from __future__ import annotations

META = "areal-rl"
CORE = "areal-core"

# Whether the distributions are on the package index. While False, install lines say where the wheels come
# from instead of sending users to an index where anyone could have registered the name.
PUBLISHED = False

# distribution -> (folder in a checkout, the meta-distribution's extra that brings it; None: the default set)
DISTRIBUTIONS: dict[str, tuple[str, str | None]] = {
    "areal-plugin-ppo": ("plugins/algorithms/ppo", None),
    "areal-plugin-tasks": ("plugins/datasets/tasks", None),
    "areal-plugin-reasoning-gym": ("plugins/datasets/reasoning_gym", None),
    "areal-plugin-local": ("plugins/engines/local", None),
    "areal-plugin-fsdp": ("plugins/engines/fsdp", None),
    "areal-plugin-sim": ("plugins/engines/sim", None),
    "areal-plugin-math": ("plugins/rewards/math", None),
    "areal-plugin-code": ("plugins/rewards/code", None),
    "areal-plugin-rlvr": ("plugins/workflows/rlvr", None),
    "areal-plugin-multi-turn": ("plugins/workflows/multi_turn", None),
    "areal-plugin-agent": ("plugins/workflows/agent", None),
    "areal-plugin-vllm": ("plugins/engines/vllm", "vllm"),
    "areal-plugin-sglang": ("plugins/engines/sglang", "sglang"),
    "areal-plugin-megatron": ("plugins/engines/megatron", "megatron"),
    "areal-plugin-ray": ("plugins/launchers/ray", "ray"),
    "areal-plugin-slurm": ("plugins/launchers/slurm", "slurm"),
    "areal-plugin-wandb": ("plugins/loggers/wandb", "wandb"),
    "areal-plugin-mlflow": ("plugins/loggers/mlflow", "mlflow"),
    "areal-plugin-trackio": ("plugins/loggers/trackio", "trackio"),
}

# kind (as in areal_core.registry.KINDS, plus "backend" for allocation backends) -> name -> distribution
_BY_DISTRIBUTION: dict[str, dict[str, tuple[str, ...]]] = {
    "areal-plugin-ppo": {"algorithm": ("cispo", "dapo", "dr_grpo", "grpo", "gspo", "m2po", "ppo", "reinforce_pp",
                                       "reinforce_pp_baseline", "rloo", "sapo")},
    "areal-plugin-tasks": {"dataset": ("arithmetic", "countdown", "files"), "reward": ("arithmetic", "countdown")},
    "areal-plugin-reasoning-gym": {"dataset": ("reasoning_gym",), "reward": ("reasoning_gym",)},
    "areal-plugin-local": {"inference_engine": ("local",), "backend": ("local",)},
    "areal-plugin-fsdp": {"train_engine": ("fsdp",), "backend": ("fsdp",)},
    "areal-plugin-sim": {"inference_engine": ("sim",), "train_engine": ("sim_train",), "workflow": ("sim",),
                         "reward": ("sim",), "dataset": ("sim",), "backend": ("sim", "sim_train")},
    "areal-plugin-math": {"reward": ("format", "math")},
    "areal-plugin-code": {"reward": ("code",)},
    "areal-plugin-rlvr": {"workflow": ("rlvr",)},
    "areal-plugin-multi-turn": {"workflow": ("multi_turn",)},
    "areal-plugin-agent": {"workflow": ("agent",)},
    "areal-plugin-vllm": {"inference_engine": ("vllm",), "backend": ("vllm",)},
    "areal-plugin-sglang": {"inference_engine": ("sglang",), "backend": ("sglang",)},
    "areal-plugin-megatron": {"train_engine": ("megatron",), "backend": ("megatron",)},
    "areal-plugin-ray": {"launcher": ("ray",)},
    "areal-plugin-slurm": {"launcher": ("slurm",)},
    "areal-plugin-wandb": {"logger": ("wandb",)},
    "areal-plugin-mlflow": {"logger": ("mlflow",)},
    "areal-plugin-trackio": {"logger": ("trackio",)},
}

PROVIDERS: dict[tuple[str, str], str] = {
    (kind, name): distribution
    for distribution, kinds in _BY_DISTRIBUTION.items() for kind, names in kinds.items() for name in names
}


def extras() -> dict[str, list[str]]:
    """The meta-distribution's extras: each optional part's name -> the distributions it adds (and ``all``)."""
    out: dict[str, list[str]] = {}
    for distribution, (_, extra) in DISTRIBUTIONS.items():
        if extra is not None:
            out.setdefault(extra, []).append(distribution)
    out["all"] = sorted(d for d, (_, extra) in DISTRIBUTIONS.items() if extra is not None)
    return out


def default_set() -> list[str]:
    """What installing ``areal-rl`` brings besides the core: enough to run the demo and every CPU example."""
    return [d for d, (_, extra) in DISTRIBUTIONS.items() if extra is None]


def provider(kind: str, name: str) -> str | None:
    """The first-party distribution that provides component ``name`` of ``kind``, or None."""
    return PROVIDERS.get((kind, str(name)))


def install_line(distribution: str) -> str:
    """How to install ``distribution``, as a fix message says it."""
    if distribution == CORE:
        target = f"'{META}'"
    else:
        folder, extra = DISTRIBUTIONS[distribution]
        target = f"'{META}[{extra}]'" if extra else f"'{META}'"
    if PUBLISHED:
        line = f"pip install {target}"
    else:
        line = (f"pip install --find-links dist {target} (the wheels scripts/build_wheels.sh builds; not on the "
                "package index yet)")
    folder = "." if distribution == CORE else DISTRIBUTIONS[distribution][0]
    return f"{line}, or in a checkout pip install -e {folder}"


def install_fix(kind: str, name: str) -> str | None:
    """``install <distribution>, which provides it: <line>`` for a first-party component, else None."""
    distribution = provider(kind, name)
    if distribution is None:
        return None
    return f"install {distribution}, which provides it: {install_line(distribution)}"


def reinstall_line(distribution: str) -> str:
    """How to reinstall ``distribution``: for a first-party one not on the index, from the wheels or the
    checkout (``--force-reinstall`` alone would fetch the name from an index where it is not ours yet)."""
    if distribution == CORE or distribution == META or distribution in DISTRIBUTIONS:
        if not PUBLISHED:
            folder = "." if distribution in (CORE, META) else DISTRIBUTIONS[distribution][0]
            return (f"pip install --force-reinstall --find-links dist {distribution} (the wheels "
                    f"scripts/build_wheels.sh builds), or in a checkout pip install -e {folder}")
    return f"pip install --force-reinstall {distribution}"
