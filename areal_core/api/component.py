"""What every selectable component shares: options, capabilities, construction."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Context:
    """What the core hands a component when it builds one.

    ``config`` is the whole typed :class:`~areal_core.config.RunConfig` (None
    in unit tests that need none); ``options`` the component's own keys from
    its config section, already checked against ``config_class`` and filled
    with defaults; ``placement`` the allocation component it runs as, if any.
    """

    config: Any = None
    options: Any = None
    placement: Any = None
    extras: dict = field(default_factory=dict)


class Component(ABC):
    """Base of every selectable component.

    ``config_class``: an optional dataclass of the keys this component adds
    to its config section (``algorithm.eps_clip``); the core type-checks them
    and passes an instance as ``context.options``.
    ``capabilities``: names of optional features it implements; the
    conformance kit skips tests of the others and says which one is missing.
    """

    config_class: ClassVar[type | None] = None
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def create(cls, context: Context) -> Component:
        """Build an instance; override when construction needs more than the context."""
        return cls(context)  # type: ignore[call-arg]

    def __init__(self, context: Context | None = None) -> None:
        self.context = context or Context()
