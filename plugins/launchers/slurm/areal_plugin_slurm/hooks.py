"""The plugin's hooks: `areal check` (and `areal run`, before anything is written) reports launcher options
sbatch would misread and placements one SLURM job cannot make, only for runs with ``launcher.name: slurm``.

Imported on every ``areal`` call: stdlib and the core only.
"""

from __future__ import annotations

from typing import Any

from areal_core import hookimpl
from areal_core.problems import Problem

NAME = "slurm"


def _mine(config: Any) -> bool:
    return getattr(getattr(config, "launcher", None), "name", None) == NAME


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    if not _mine(config):
        return []
    from areal_plugin_slurm.config import option_problems, options_from

    return [Problem("slurm.option", message, fix, key)
            for key, message, fix in option_problems(options_from(config.launcher.extra))]


@hookimpl
def areal_validate_parallelism(config: Any, allocation: Any, backends: dict) -> list[Problem]:
    if not _mine(config):
        return []
    from areal_core.parallelism import role_of

    from areal_plugin_slurm.config import options_from
    from areal_plugin_slurm.layout import LayoutError, plan_layout

    roles = {role_of(c, backends[c.backend].kind): c for c in allocation.components if c.backend in backends}
    if "rollout" not in roles or "actor" not in roles:
        return []  # the core's own rules report a plan without them
    options = options_from(config.launcher.extra)
    try:
        layout = plan_layout(allocation, roles["rollout"], roles["actor"], options.gpus_per_node, with_servers=True)
    except LayoutError as exc:
        return [Problem("slurm.placement", exc.message, exc.fix, exc.key)]
    if options.nodes and layout.nodes > options.nodes:
        return [Problem("slurm.nodes", f"allocation '{allocation}' needs {layout.describe()} with launcher.gpus_per_node="
                        f"{options.gpus_per_node} (inference servers and train ranks never share a node here), "
                        f"more than launcher.nodes={options.nodes}",
                        f"choose a split whose parts fill whole nodes (e.g. "
                        f"{options.gpus_per_node * options.nodes // 2} GPUs each), or raise launcher.nodes",
                        "allocation")]
    return []
