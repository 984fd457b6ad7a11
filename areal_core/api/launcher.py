"""The launcher contract: place a validated run's processes (entry-point group ``areal.launchers``)."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

from areal_core.api.component import Component


class Launcher(Component):
    """Starts every process of a run from its allocation, watches them, tears them down."""

    @abstractmethod
    def launch(self, run: Any, run_dir: Path, *, resume: bool = False) -> int:
        """Run to completion and return the exit status; leave no process behind.

        ``run`` is the :class:`~areal_core.config.validate.ValidatedRun`
        (config, parsed allocation, declared backends, resolved components);
        ``run_dir`` holds its resolved ``config.yaml``; ``resume`` continues
        from the last complete checkpoint there.
        """
