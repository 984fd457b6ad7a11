"""The launcher contract: place a validated run's processes (entry-point group ``areal.launchers``)."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

from areal_core.api.component import Component


class Launcher(Component):
    """Starts every process of a run from its allocation, watches them, tears them down."""

    @abstractmethod
    def launch(self, config: Any, allocation: Any, run_dir: Path) -> int:
        """Run to completion; return the exit status. Must leave no process behind."""
