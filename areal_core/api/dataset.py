"""The dataset contract: items for workflows (entry-point group ``areal.datasets``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Iterator

from areal_core.api.component import Component


class Dataset(Component):
    """A finite or endless, seeded source of items (dicts the workflow understands)."""

    @abstractmethod
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Items in a deterministic order for a given seed."""

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} is endless")
