"""The built-in ``local`` launcher (:mod:`areal_core.launch.local`). The process machinery every launcher builds on
is :mod:`areal_core.processes`; its names stay importable from here."""

from areal_core.processes import *  # noqa: F403 (the names plugins imported from here before the move)
from areal_core.processes import __all__  # noqa: F401
