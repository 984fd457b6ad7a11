"""The allocation grammar: how a run's components are placed on devices.

An allocation string names each component of a run (a training or inference
backend), how it is parallelised, and which components share devices::

    fsdp:d4                     one FSDP trainer on 4 GPUs (data parallel)
    megatron:d2p2t2             data 2 x pipeline 2 x tensor 2 = 8 GPUs
    vllm:d2t4+fsdp:d8           '+' : separate device sets, 16 GPUs in all
    vllm:d4|fsdp:d4             '|' : colocated on the same 4 GPUs
    fsdp[actor]:d4              a named component
    local:cpu                   shorthand for local:d1@cpu (no accelerator)

Grammar (whitespace is allowed around '+' and '|' and at both ends only)::

    allocation := group ( '+' group )*
    group      := component ( '|' component )*
    component  := backend [ '[' name ']' ] ':' placement
    placement  := 'cpu' | dims [ '@' device ]
    dims       := ( dim count )+          dim in d, p, t, c, e; each at most once
    device     := 'cpu' | 'gpu'
    backend, name := [A-Za-z_][A-Za-z0-9_-]*    (backend may not be cpu/gpu)
    count      := decimal integer, 1 .. 1_000_000

``parse_allocation`` turns text into an :class:`Allocation`; ``str()`` of an
allocation gives its canonical text, which parses back to an equal object.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DIMENSIONS",
    "DIMENSION_NAMES",
    "DEVICES",
    "MAX_COUNT",
    "AllocationParseError",
    "Parallelism",
    "Component",
    "Allocation",
    "parse_allocation",
]

DIMENSIONS: tuple[str, ...] = ("d", "p", "t", "c", "e")
"""Parallelism dimensions in canonical order."""

DIMENSION_NAMES: dict[str, str] = {
    "d": "data",
    "p": "pipeline",
    "t": "tensor",
    "c": "context",
    "e": "expert",
}

DEVICES: tuple[str, ...] = ("cpu", "gpu")
"""Device kinds a component may be placed on."""

MAX_COUNT = 1_000_000
"""Largest count accepted for one dimension (keeps products sane)."""


class AllocationParseError(ValueError):
    """An allocation string is malformed.

    Attributes:
        text: the whole input.
        position: 0-based index of the offending character
            (``len(text)`` when the input ended too early).
        reason: what is wrong, in words.
    """

    def __init__(self, text: str, position: int, reason: str) -> None:
        super().__init__(text, position, reason)
        self.text = text
        self.position = position
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"allocation {self.text!r}: {self.reason} at character {self.position + 1}\n"
            f"  {self.text}\n"
            f"  {' ' * self.position}^"
        )


@dataclass(frozen=True)
class Parallelism:
    """Degree of parallelism along each dimension (all default to 1)."""

    d: int = 1
    p: int = 1
    t: int = 1
    c: int = 1
    e: int = 1

    def __post_init__(self) -> None:
        for dim in DIMENSIONS:
            count = getattr(self, dim)
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"{DIMENSION_NAMES[dim]} parallelism must be an int >= 1, got {count!r}")

    @property
    def world_size(self) -> int:
        """Number of ranks: d * p * t * c (expert parallelism is carved out of these)."""
        return self.d * self.p * self.t * self.c

    def __str__(self) -> str:
        text = "".join(f"{dim}{getattr(self, dim)}" for dim in DIMENSIONS if getattr(self, dim) != 1)
        return text or "d1"


@dataclass(frozen=True)
class Component:
    """One backend of a run, e.g. ``fsdp[actor]:d4`` or ``vllm:d2t4``."""

    backend: str
    parallel: Parallelism
    name: str | None = None
    device: str = "gpu"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    @property
    def world_size(self) -> int:
        """Number of ranks this component runs."""
        return self.parallel.world_size

    @property
    def n_devices(self) -> int:
        """Accelerators used: the world size on GPU, none on CPU."""
        return self.world_size if self.device == "gpu" else 0

    def __str__(self) -> str:
        head = self.backend + (f"[{self.name}]" if self.name is not None else "")
        if self.device == "cpu" and self.parallel == Parallelism():
            return f"{head}:cpu"
        return f"{head}:{self.parallel}" + ("@cpu" if self.device == "cpu" else "")


@dataclass(frozen=True)
class Allocation:
    """A whole run: groups on separate devices ('+'), each group colocated ('|')."""

    groups: tuple[tuple[Component, ...], ...]

    @property
    def components(self) -> tuple[Component, ...]:
        """All components, flattened in textual order."""
        return tuple(component for group in self.groups for component in group)

    @property
    def n_devices(self) -> int:
        """Accelerators used: per group the largest component, summed over groups."""
        return sum(max((c.n_devices for c in group), default=0) for group in self.groups)

    def find(self, backend: str | None = None, name: str | None = None) -> list[Component]:
        """Components matching ``backend`` and ``name`` (``None`` matches anything)."""
        return [
            c
            for c in self.components
            if (backend is None or c.backend == backend) and (name is None or c.name == name)
        ]

    def __str__(self) -> str:
        return "+".join("|".join(str(c) for c in group) for group in self.groups)


# The parser is hand-written recursive descent rather than generated (or a
# regex): the grammar has about eight tokens, and we want error messages in our
# own words that point at the exact offending character, which a parser
# generator would not give us without more code than this whole module.

_IDENT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_IDENT_REST = _IDENT_START | frozenset("0123456789-")
_DIGITS = frozenset("0123456789")
_ALLOWED_DIMS = ", ".join(DIMENSIONS)


class _Parser:
    """Recursive-descent parser over one allocation string."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, reason: str, position: int | None = None) -> AllocationParseError:
        """Build an error at ``position`` (default: the current position)."""
        return AllocationParseError(self.text, self.pos if position is None else position, reason)

    def peek(self) -> str:
        """The current character, or '' at the end."""
        return self.text[self.pos : self.pos + 1]

    def skip_space(self) -> None:
        while self.peek().isspace():
            self.pos += 1

    def take(self, allowed: frozenset[str]) -> str:
        """Consume and return the longest run of characters from ``allowed``."""
        start = self.pos
        while self.peek() and self.peek() in allowed:
            self.pos += 1
        return self.text[start : self.pos]

    def identifier(self) -> str:
        """``[A-Za-z_][A-Za-z0-9_-]*`` or '' if none starts here."""
        if not self.peek() or self.peek() not in _IDENT_START:
            return ""
        return self.take(_IDENT_REST)

    def allocation(self) -> Allocation:
        self.skip_space()
        if not self.peek():
            raise self.fail("allocation is empty", 0)
        groups = [self.group(after=None)]
        while self.peek() == "+":
            self.pos += 1
            self.skip_space()
            groups.append(self.group(after="+"))
        if self.peek():
            raise self.fail(f"unexpected character {self.peek()!r}")
        return Allocation(tuple(groups))

    def group(self, after: str | None) -> tuple[Component, ...]:
        """Colocated components; leaves the position after trailing whitespace."""
        components = [self.component(after)]
        self.skip_space()
        while self.peek() == "|":
            self.pos += 1
            self.skip_space()
            components.append(self.component(after="|"))
            self.skip_space()
        return tuple(components)

    def component(self, after: str | None) -> Component:
        start = self.pos
        backend = self.identifier()
        if not backend:
            where = f" after {after!r}" if after else " such as 'fsdp:d4'"
            raise self.fail(f"expected a component{where}")
        if backend in DEVICES:
            raise self.fail(f"{backend!r} is a device, not a backend", start)
        name = None
        if self.peek() == "[":
            self.pos += 1
            name = self.identifier()
            if not name:
                raise self.fail("expected a name after '['")
            if self.peek() != "]":
                raise self.fail(f"expected ']' after name {name!r}")
            self.pos += 1
        if self.peek() != ":":
            raise self.fail(f"expected ':' after {'backend ' if name is None else ''}{self.text[start:self.pos]!r}")
        self.pos += 1
        if self.text.startswith("cpu", self.pos):
            self.pos += 3
            return Component(backend, Parallelism(), name, "cpu")
        parallel = self.dims()
        device = "gpu"
        if self.peek() == "@":
            self.pos += 1
            device = self.device()
        return Component(backend, parallel, name, device)

    def dims(self) -> Parallelism:
        """One or more ``<dim><count>`` pairs, in any order."""
        counts: dict[str, int] = {}
        while True:
            dim = self.peek()
            if not (dim.isascii() and dim.isalpha()):
                if counts:
                    return Parallelism(**counts)
                raise self.fail(f"expected a placement: dimensions ({_ALLOWED_DIMS}) with counts, or 'cpu'")
            if dim not in DIMENSIONS:
                raise self.fail(f"unknown dimension {dim!r} (allowed: {_ALLOWED_DIMS})")
            if dim in counts:
                raise self.fail(f"dimension {dim!r} given twice")
            self.pos += 1
            counts[dim] = self.count(dim)

    def count(self, dim: str) -> int:
        start = self.pos
        digits = self.take(_DIGITS)
        if not digits:
            raise self.fail(f"expected a count after dimension {dim!r}")
        significant = digits.lstrip("0")
        if not significant:
            raise self.fail("count must be >= 1", start)
        # Check the length first: int() of a huge digit string is slow or refused.
        if len(significant) > len(str(MAX_COUNT)) or int(significant) > MAX_COUNT:
            raise self.fail(f"count is too large (at most {MAX_COUNT:_})", start)
        return int(significant)

    def device(self) -> str:
        start = self.pos
        word = self.take(_IDENT_REST)
        if not word:
            raise self.fail("expected a device ('cpu' or 'gpu') after '@'")
        if word not in DEVICES:
            raise self.fail(f"unknown device {word!r} (allowed: cpu, gpu)", start)
        return word


def parse_allocation(text: str) -> Allocation:
    """Parse an allocation string such as ``"vllm:d2t4+fsdp:d8"``.

    Raises:
        AllocationParseError: for any malformed input, pointing at the
            offending character.
    """
    return _Parser(text).allocation()


Allocation.parse = staticmethod(parse_allocation)  # type: ignore[attr-defined]
