"""Every hook a plugin may implement. The docstrings are the contracts.

Hooks are found in modules named by entry points in the ``areal`` group
(``[project.entry-points.areal] myplugin = "my_pkg.hooks"``). A hook module
must import nothing heavy (no torch, no model code): ``areal plugins`` and
``areal check`` load every hook module on every call.

Implement a hook with ``@areal_core.hookimpl`` on a module-level function of
the same name; an implementation may accept any subset of the arguments named
here. A function named ``areal_*`` that is not a hook below is an error
(misspelt hooks fail loudly instead of silently never running).

Named components (engines, algorithms, workflows, rewards, launchers,
datasets) are not hooks: they are entry points in their own groups, see
:mod:`areal_core.registry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from areal_core.cli_registrar import CommandRegistrar
    from areal_core.config.allocation import Allocation
    from areal_core.config.model_info import ModelInfo
    from areal_core.parallelism import BackendSupport
    from areal_core.problems import Problem

PROJECT = "areal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def areal_declare_backends() -> list[BackendSupport]:
    """Declare the engine backends this plugin places, and what each supports.

    Called once per process when the plugin manager is built, in the process
    running ``areal`` (the CLI or the launcher), before any config is read.
    Return a list of :class:`areal_core.parallelism.BackendSupport`: backend
    name as written in an allocation (``fsdp`` in ``fsdp:d4``), its kind
    (``"train"`` or ``"inference"``), the parallel dimensions it accepts and
    the devices it can run on. The core rejects an allocation naming an
    undeclared backend or a dimension > 1 the backend does not accept, so a
    plugin only adds rules beyond those in :func:`areal_validate_parallelism`.
    Two plugins declaring one backend name is an error naming both.
    """


@hookspec
def areal_validate_parallelism(
    config: Any,
    allocation: Allocation,
    model: ModelInfo | None,
    backends: dict[str, BackendSupport],
) -> list[Problem]:
    """Return every problem this plugin sees in the run's placement; [] if none.

    Called by ``areal check`` and before ``areal run`` starts any process,
    after the config loaded and the allocation parsed without errors.
    ``config`` is the typed :class:`areal_core.config.RunConfig`,
    ``allocation`` the parsed :class:`areal_core.config.allocation.Allocation`,
    ``model`` what could be read of the model's ``config.json`` without
    loading weights (``None`` when there is no local model yet),
    ``backends`` every declared backend by name (from all plugins).

    Only judge components whose backend this plugin declared. Never raise for
    a bad plan: return :class:`areal_core.Problem` objects with a code
    prefixed by the plugin (``fsdp.no-pipeline``), a message with the values
    seen, and a hint with the fix. Results of all plugins are concatenated and
    reported together, so the user sees every problem at once.
    """


@hookspec
def areal_validate_config(config: Any) -> list[Problem]:
    """Return every problem this plugin sees in the typed run config; [] if none.

    Called after types and ranges of every key were checked, before the
    parallelism hooks. Use it for rules spanning several keys (``eps_high``
    below ``eps_low``). Same reporting rules as
    :func:`areal_validate_parallelism`.
    """


@hookspec(firstresult=True)
def areal_resolve_model(path: str, dtype: str, materialize: bool) -> str | None:
    """Turn ``model.path`` into a local HF folder, or return None to pass.

    Called (in any process, possibly often) by
    :func:`areal_core.models.resolve_model_path` for a path that is not an
    existing folder, notably ``""`` (the built-in demo model), with ``dtype``
    already resolved to ``"float32"`` or ``"bfloat16"``. A plugin that knows
    the name returns a folder holding ``config.json``, the safetensors weights
    and the tokenizer, materialising it first if needed (a one-time
    conversion into a user cache is fine; a network download is not). The
    first non-None answer wins.

    ``materialize`` is False when ``areal check`` only asks whether the name
    is known (for a non-empty ``model.path`` that is not a folder): answer
    with the folder it would be, writing nothing. A non-empty path that is
    not a folder and that no plugin knows is refused before the run starts.
    """


@hookspec
def areal_register_commands(registrar: CommandRegistrar) -> None:
    """Add subcommands to the ``areal`` CLI.

    Called once when the CLI starts. Use ``registrar.add_group(typer_app,
    name)`` to add ``areal <name> <command>`` (name defaults to the plugin's
    entry-point name) or ``registrar.add_command(function, name)`` for a
    single ``areal <name>``. A name taken by a built-in command, or by
    another plugin, is refused with both owners named.
    """
