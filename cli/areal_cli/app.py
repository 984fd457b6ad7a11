"""The ``areal`` console script: built-in and plugin commands, gathered through one hook."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from areal_core.cli_registrar import CommandRegistrar
from areal_core.plugins import PluginManager, get_plugin_manager

err_console = Console(stderr=True, emoji=False)  # ":m:" in a path or value must print as typed

HELP = "areal: fully asynchronous RL for LLM reasoning and agents."


def collect_commands(manager: PluginManager) -> CommandRegistrar:
    """Call every ``areal_register_commands``, built-ins first so they keep their names."""
    registrar = CommandRegistrar()
    impls = list(reversed(manager.hook.areal_register_commands.get_hookimpls()))
    impls.sort(key=lambda impl: not manager.plugins[impl.plugin_name].builtin)
    for impl in impls:
        info = manager.plugins[impl.plugin_name]
        registrar._bind(info.name, f'"{info.name}" ({info.distribution} {info.version})', info.builtin)
        try:
            impl.function(registrar=registrar)
        except Exception as exc:  # one plugin's broken CLI must not take the others down
            registrar.errors.append(
                f'plugin "{info.name}" ({info.distribution} {info.version}) crashed adding its '
                f"commands: {type(exc).__name__}: {exc}. Fix: upgrade or disable {info.distribution}."
            )
    return registrar


def versions() -> str:
    """``areal --version``: the core's version, then every distribution that provides plugins, with what it
    provides (entry-point names)."""
    from areal_core.discovery import CORE_DISTRIBUTION, distributions, normalize

    lines, rest = [], []
    for (dist, ver), names in distributions().items():
        (lines if normalize(dist) == CORE_DISTRIBUTION else rest).append(f"{dist} {ver} ({', '.join(names)})")
    return "\n".join((lines or ["areal-core (not installed: run from a source tree)"]) + rest)


def build_app(manager: PluginManager) -> tuple[typer.Typer, list[str]]:
    # add_completion: typer's --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    app = typer.Typer(name="areal", help=HELP, no_args_is_help=True, add_completion=True,
                      pretty_exceptions_enable=False)

    def show_version(value: bool) -> None:
        if value:
            print(versions())
            raise typer.Exit()

    @app.callback()
    def areal(version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                           help="Show the core's and every plugin distribution's version.")) -> None:
        """areal: fully asynchronous RL for LLM reasoning and agents."""

    registrar = collect_commands(manager)
    for name, cmd in registrar.commands.items():
        if cmd.is_group:
            app.add_typer(cmd.target, name=name)
        else:
            app.command(name=name)(cmd.target)
    return app, registrar.errors


def main(argv: list[str] | None = None) -> None:
    manager = get_plugin_manager()
    app, errors = build_app(manager)
    for line in manager.warnings() + errors:
        err_console.print("warning:", style="yellow", end=" ")
        err_console.print(line, highlight=False, soft_wrap=True, markup=False)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="areal")


if __name__ == "__main__":  # pragma: no cover
    main()
