"""Moved to :mod:`areal_core.processes.nodes` (process machinery is not the local launcher's): this name stays the
same module for plugins written against it."""

import sys

from areal_core.processes import nodes as _moved

sys.modules[__name__] = _moved
