"""What every conformance suite checks, whatever the component's kind.

A suite is a plain class; pytest collects its ``test_*`` methods when a test
module subclasses it under a ``Test*`` name::

    class TestMyReward(RewardConformance):
        component_name = "my_reward"

The component is always found through its entry point, as ``areal run``
would find it, so the packaging is tested along with the code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable, ClassVar

import pytest

from areal_core.api.component import Component, Context
from areal_core.registry import KINDS, contract_for, find, resolve

# Optional features per kind, as the contracts' docstrings name them.
KNOWN_CAPABILITIES: dict[str, frozenset[str]] = {
    "inference_engine": frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors",
                                   "update_weights_from_delta", "weight_digest"}),
    "train_engine": frozenset({"save_load", "export_disk", "export_tensors", "export_beside_training", "export_into",
                               "reference", "critic", "minibatches"}),
}


def requires(capability: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated test only when the suite declares ``capability``.

    Otherwise the test is skipped with a reason naming the component and the
    capability, e.g. ``my_engine does not declare capability 'pause'``.
    """

    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(test)
        def wrapper(self: ComponentConformance, *args: Any, **kwargs: Any) -> Any:
            if capability not in self.declared_capabilities():
                pytest.skip(f"{self.component_name} does not declare capability '{capability}'")
            return test(self, *args, **kwargs)

        return wrapper

    return decorate


def finite_number(value: Any, what: str) -> float:
    """``value`` as a float, failing the test with ``what`` if it is not a finite number."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        pytest.fail(f"{what} is {value!r}, not a number")
    if isinstance(value, bool) or not math.isfinite(number):
        pytest.fail(f"{what} is {value!r}; it must be a finite number")
    return number


def as_list(value: Any) -> list:
    """A tensor, array or sequence as a Python list, without importing torch.

    A ``[1, T]`` tensor stays nested (one entry), so a wrong shape shows as a wrong length.
    """
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value)


def unimplemented(cls: type) -> list[str]:
    """Abstract methods and properties ``cls`` leaves as the contract declared them.

    ``registry.resolve`` refuses such a class too; the kit names each one.
    """
    return sorted(name for name in dir(cls)
                  if getattr(inspect.getattr_static(cls, name), "__isabstractmethod__", False))


class ComponentConformance:
    """Checks shared by every kind.

    Set on the subclass:

    ``kind``: a key of :data:`areal_core.registry.KINDS` (the kind-specific
    suites set it for you). ``component_name``: the entry-point name a user
    writes in config. ``capabilities``: the optional features to test; left
    as ``None`` it is the component class's own ``capabilities``; set it to a
    subset to skip some. Declaring one the component does not is a failure.

    Override :meth:`make` when building an instance takes more than
    ``cls.create(Context(options=<config_class defaults>))``.
    """

    kind: ClassVar[str] = ""
    component_name: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str] | None] = None

    # -- for subclasses ---------------------------------------------------
    def component_class(self) -> Any:
        """The component, imported through its entry point and checked against its contract."""
        self._check_setup()
        return resolve(self.kind, self.component_name, expected=contract_for(self.kind))

    def make(self, cls: Any) -> Any:
        """An instance built as the core builds one; override for engines that need a model."""
        config_class = getattr(cls, "config_class", None)
        options = config_class() if config_class is not None else None
        if isinstance(cls, type) and issubclass(cls, Component):
            return cls.create(Context(options=options))
        if isinstance(cls, type):
            return cls()
        return cls  # a plain callable (rewards)

    def declared_capabilities(self) -> frozenset[str]:
        if self.capabilities is not None:
            return frozenset(self.capabilities)
        return frozenset(getattr(self.component_class(), "capabilities", frozenset()))

    def _check_setup(self) -> None:
        if self.kind not in KINDS:
            pytest.fail(f"{type(self).__name__}.kind is {self.kind!r}; set it to one of {', '.join(KINDS)}")
        if not self.component_name:
            pytest.fail(f"{type(self).__name__}.component_name is not set; set it to the entry-point "
                        f"name of your {KINDS[self.kind][1]} (the name users write in config)")

    # -- tests ------------------------------------------------------------
    def test_entry_point_resolves_to_the_contract(self) -> None:
        """The entry point imports and names a class implementing the kind's contract."""
        cls = self.component_class()
        contract = contract_for(self.kind)
        if contract is None:  # a plain callable contract (rewards)
            assert callable(cls), f"{self.component_name} resolves to {cls!r}, which is not callable"
        else:
            abstract = unimplemented(cls)
            assert not abstract, (
                f"{cls.__qualname__} leaves abstract {', '.join(abstract)} of {contract.__qualname__} "
                f"unimplemented; the core cannot build it")

    def test_config_class_is_a_dataclass_with_defaults(self) -> None:
        """``config_class``, if set, is a dataclass every field of which has a default and a help text."""
        config_class = getattr(self.component_class(), "config_class", None)
        if config_class is None:
            pytest.skip(f"{self.component_name} has no config_class (no keys of its own): nothing to check")
        assert dataclasses.is_dataclass(config_class) and isinstance(config_class, type), (
            f"{self.component_name}.config_class is {config_class!r}; it must be a dataclass")
        missing = [f.name for f in dataclasses.fields(config_class)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        assert not missing, (
            f"{config_class.__qualname__} fields {', '.join(missing)} have no default; a user who "
            f"does not set them would get a crash instead of a run. Fix: give every field a default")
        silent = [f.name for f in dataclasses.fields(config_class) if not f.metadata.get("help")]
        assert not silent, (
            f"{config_class.__qualname__} fields {', '.join(silent)} have no help text, the one place a user "
            f"learns what the key does. Fix: field(default=..., metadata={{'help': '...'}}) as "
            f"plugins/_template does, or areal_core.config.schema.spec(default, help=...)")

    def test_declared_capabilities_are_implemented(self) -> None:
        """The suite tests no capability the component does not claim, and every claim is spelt right."""
        cls = self.component_class()
        claimed = frozenset(getattr(cls, "capabilities", frozenset()))
        known = KNOWN_CAPABILITIES.get(self.kind)
        if known is not None:
            unknown = sorted(claimed - known)
            assert not unknown, (
                f"{self.component_name} declares capabilities {unknown}, which are not "
                f"{KINDS[self.kind][1]} capabilities (misspelt?); the known ones are {sorted(known)}")
        if self.capabilities is not None:
            extra = sorted(frozenset(self.capabilities) - claimed)
            assert not extra, (
                f"{type(self).__name__} tests capabilities {extra} that {self.component_name} does not "
                f"declare (its capabilities are {sorted(claimed)}). Fix: add them to "
                f"{getattr(cls, '__qualname__', cls)}.capabilities, or drop them from the test class")

    def test_distribution_loads_cleanly_in_areal_plugins(self) -> None:
        """``areal plugins`` lists the component under its distribution with no errors or warnings."""
        from areal_core.discovery import normalize
        from areal_core.listing import collect_listing
        from areal_core.plugins import get_plugin_manager

        self._check_setup()
        entry = find(self.kind, self.component_name)
        get_plugin_manager(refresh=True)
        listing = {normalize(d["distribution"]): d for d in collect_listing()["distributions"]}
        mine = listing.get(normalize(entry.distribution))
        assert mine is not None, f"`areal plugins` does not list {entry.owner}"
        assert self.component_name in mine["components"].get(self.kind, []), (
            f"`areal plugins` lists {entry.owner} without {KINDS[self.kind][1]} '{self.component_name}'")
        problems = mine["errors"] + mine["warnings"]
        assert not problems, f"`areal plugins` reports for {entry.owner}:\n" + "\n".join(problems)


def public_tests(suite: type) -> list[str]:
    """The names of a suite's tests, sorted (for documentation and meta-tests)."""
    return [name for name, _ in inspect.getmembers(suite, inspect.isfunction) if name.startswith("test_")]
