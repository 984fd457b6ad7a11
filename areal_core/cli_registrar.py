"""Collects CLI commands from ``areal_register_commands`` implementations.

Kept free of Typer so hook modules can type against it without importing the
CLI. The owner of each call is known (the CLI calls implementations one by
one), so a clash names both plugins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RegisteredCommand:
    name: str
    target: Any  # a function (single command) or a typer.Typer (group)
    is_group: bool
    owner: str  # "plugin-name (distribution version)"
    builtin: bool


class CommandRegistrar:
    """Passed to ``areal_register_commands``; see the hook's docstring."""

    def __init__(self) -> None:
        self.commands: dict[str, RegisteredCommand] = {}
        self.errors: list[str] = []
        self._owner = ""
        self._plugin = ""
        self._builtin = False

    def _bind(self, plugin: str, owner: str, builtin: bool) -> None:
        self._plugin, self._owner, self._builtin = plugin, owner, builtin

    def add_command(self, function: Callable[..., Any], name: str | None = None) -> None:
        """Add ``areal <name>`` (name defaults to the function's name, dashes for underscores)."""
        self._add(name or function.__name__.replace("_", "-"), function, is_group=False)

    def add_group(self, app: Any, name: str | None = None) -> None:
        """Add a Typer app as ``areal <name> <command>`` (name defaults to the plugin's name)."""
        self._add(name or self._plugin, app, is_group=True)

    def _add(self, name: str, target: Any, is_group: bool) -> None:
        taken = self.commands.get(name)
        if taken is not None:
            what = "a built-in command" if taken.builtin else f"a command of plugin {taken.owner}"
            self.errors.append(
                f"plugin {self._owner} tried to add the command 'areal {name}', which is "
                f"{what}; it was not added. Fix: register it under another name "
                f"(e.g. registrar.add_group(app, name='{self._plugin}-{name}'))."
            )
            return
        self.commands[name] = RegisteredCommand(name, target, is_group, self._owner, self._builtin)
