"""areal core: contracts, hooks, config and the rollout controller.

Importing this package never imports torch or any engine; plugins are found
through entry points and imported only when selected.
"""

from areal_core.hookspecs import hookimpl
from areal_core.problems import Problem, ProblemsError

__version__ = "0.1.0"
__all__ = ["Problem", "ProblemsError", "__version__", "hookimpl"]
