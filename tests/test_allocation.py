"""Tests for the allocation grammar (areal_core.config.allocation)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.config.allocation import (
    DIMENSION_NAMES,
    DIMENSIONS,
    Allocation,
    AllocationParseError,
    Component,
    Parallelism,
    parse_allocation,
)

FAST = settings(max_examples=200, deadline=None)

# ---------------------------------------------------------------- strategies

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,8}", fullmatch=True)
backends = identifiers.filter(lambda s: s not in ("cpu", "gpu"))
counts = st.integers(min_value=1, max_value=64)
parallelisms = st.builds(Parallelism, d=counts, p=counts, t=counts, c=counts, e=counts) | st.builds(
    Parallelism, d=counts
)
components = st.builds(
    Component,
    backend=backends,
    parallel=parallelisms,
    name=st.none() | identifiers,
    device=st.sampled_from(["gpu", "cpu"]),
)
allocations = st.builds(
    Allocation,
    st.lists(st.lists(components, min_size=1, max_size=3).map(tuple), min_size=1, max_size=3).map(tuple),
)
spaces = st.text(alphabet=" \t", max_size=2)


@st.composite
def noncanonical_text(draw: st.DrawFn, allocation: Allocation) -> str:
    """Equivalent text: shuffled dims, explicit 1s, '@gpu', whitespace around separators."""

    def component_text(c: Component) -> str:
        head = c.backend + (f"[{c.name}]" if c.name is not None else "")
        dims = [d for d in DIMENSIONS if getattr(c.parallel, d) != 1 or draw(st.booleans())] or ["d"]
        dims = draw(st.permutations(dims))
        text = head + ":" + "".join(f"{d}{getattr(c.parallel, d)}" for d in dims)
        if c.device == "cpu":
            return text + "@cpu"
        return text + ("@gpu" if draw(st.booleans()) else "")

    def sep(symbol: str) -> str:
        return draw(spaces) + symbol + draw(spaces)

    groups = [sep("|").join(component_text(c) for c in group) for group in allocation.groups]
    return draw(spaces) + sep("+").join(groups) + draw(spaces)


# ---------------------------------------------------------------- properties


@FAST
@given(allocations)
def test_round_trip(allocation: Allocation) -> None:
    assert parse_allocation(str(allocation)) == allocation


@FAST
@given(st.data())
def test_noncanonical_text_parses_like_canonical(data: st.DataObject) -> None:
    allocation = data.draw(allocations)
    text = data.draw(noncanonical_text(allocation))
    assert parse_allocation(text) == allocation == parse_allocation(str(allocation))


def _check_only_parse_errors(text: str) -> None:
    try:
        allocation = parse_allocation(text)
    except AllocationParseError as err:
        assert 0 <= err.position <= len(text)
        assert err.text == text and err.reason
        assert str(err).splitlines()[0].endswith(f"at character {err.position + 1}")
    else:
        assert parse_allocation(str(allocation)) == allocation


@settings(max_examples=500, deadline=None)
@given(st.text())
def test_arbitrary_text_raises_only_parse_errors(text: str) -> None:
    _check_only_parse_errors(text)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet="dptcefsl:[]|+@0123456789 _-gpuxa", max_size=30))
def test_grammar_alphabet_raises_only_parse_errors(text: str) -> None:
    _check_only_parse_errors(text)


# ---------------------------------------------------------------- examples


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "fsdp:d0",
            "allocation 'fsdp:d0': count must be >= 1 at character 7\n"
            "  fsdp:d0\n"
            "        ^",
        ),
        (
            "fsdp:x4",
            "allocation 'fsdp:x4': unknown dimension 'x' (allowed: d, p, t, c, e) at character 6\n"
            "  fsdp:x4\n"
            "       ^",
        ),
        (
            "fsdp d4",
            "allocation 'fsdp d4': expected ':' after backend 'fsdp' at character 5\n"
            "  fsdp d4\n"
            "      ^",
        ),
        (
            "fsdp:d4+",
            "allocation 'fsdp:d4+': expected a component after '+' at character 9\n"
            "  fsdp:d4+\n"
            "          ^",
        ),
        (
            "fsdp[actor:d4",
            "allocation 'fsdp[actor:d4': expected ']' after name 'actor' at character 11\n"
            "  fsdp[actor:d4\n"
            "            ^",
        ),
        (
            "fsdp:d2d2",
            "allocation 'fsdp:d2d2': dimension 'd' given twice at character 8\n"
            "  fsdp:d2d2\n"
            "         ^",
        ),
        (
            "fsdp:d4@tpu",
            "allocation 'fsdp:d4@tpu': unknown device 'tpu' (allowed: cpu, gpu) at character 9\n"
            "  fsdp:d4@tpu\n"
            "          ^",
        ),
        (
            "",
            "allocation '': allocation is empty at character 1\n"
            "  \n"
            "  ^",
        ),
        (
            "fsdp:d4 x",
            "allocation 'fsdp:d4 x': unexpected character 'x' at character 9\n"
            "  fsdp:d4 x\n"
            "          ^",
        ),
    ],
)
def test_error_messages(text: str, message: str) -> None:
    with pytest.raises(AllocationParseError) as info:
        parse_allocation(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "position", "reason_part"),
    [
        ("   ", 0, "allocation is empty"),
        ("fsdp:d2000000", 6, "too large"),
        ("fsdp:d" + "9" * 5000, 6, "too large"),
        ("cpu:d1", 0, "device, not a backend"),
        ("fsdp:", 5, "expected a placement"),
        ("fsdp:d", 6, "expected a count after dimension 'd'"),
        ("fsdp[]:d1", 5, "expected a name"),
        ("vllm:d4 |", 9, "expected a component after '|'"),
        ("fsdp:d4@", 8, "expected a device"),
        ("local:cpu@cpu", 9, "unexpected character '@'"),
        ("fsdp : d4", 4, "expected ':'"),
    ],
)
def test_error_positions(text: str, position: int, reason_part: str) -> None:
    with pytest.raises(AllocationParseError) as info:
        parse_allocation(text)
    assert info.value.position == position
    assert reason_part in info.value.reason
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("text", "canonical", "world_sizes", "n_devices"),
    [
        ("fsdp:d4", "fsdp:d4", [4], 4),
        ("megatron:d2p2t2", "megatron:d2p2t2", [8], 8),
        ("vllm:d2t4", "vllm:d2t4", [8], 8),
        ("sglang:d4t2", "sglang:d4t2", [8], 8),
        ("vllm:d2t4+fsdp:d8", "vllm:d2t4+fsdp:d8", [8, 8], 16),
        (" vllm:t4d2 +\tfsdp:d8 ", "vllm:d2t4+fsdp:d8", [8, 8], 16),
        ("vllm:d4|fsdp:d4", "vllm:d4|fsdp:d4", [4, 4], 4),
        ("fsdp[actor]:d4", "fsdp[actor]:d4", [4], 4),
        ("local:cpu", "local:cpu", [1], 0),
        ("local:d1@cpu", "local:cpu", [1], 0),
        ("fsdp:d2@cpu", "fsdp:d2@cpu", [2], 0),
        ("local:cpu+fsdp:d1@cpu", "local:cpu+fsdp:cpu", [1, 1], 0),
        ("megatron:e4d2t2@gpu", "megatron:d2t2e4", [4], 4),
        ("fsdp:d1", "fsdp:d1", [1], 1),
    ],
)
def test_examples(text: str, canonical: str, world_sizes: list[int], n_devices: int) -> None:
    allocation = parse_allocation(text)
    assert str(allocation) == canonical
    assert [c.world_size for c in allocation.components] == world_sizes
    assert allocation.n_devices == n_devices
    assert Allocation.parse(text) == allocation


def test_parsed_values() -> None:
    allocation = parse_allocation("vllm:d2t4+fsdp[actor]:d4|fsdp[ref]:d4@cpu")
    vllm, actor, ref = allocation.components
    assert vllm == Component("vllm", Parallelism(d=2, t=4))
    assert actor == Component("fsdp", Parallelism(d=4), name="actor")
    assert ref == Component("fsdp", Parallelism(d=4), name="ref", device="cpu")
    assert allocation.groups == ((vllm,), (actor, ref))
    assert allocation.n_devices == 8 + 4
    assert allocation.find(backend="fsdp") == [actor, ref]
    assert allocation.find(name="ref") == [ref]
    assert allocation.find(backend="fsdp", name="actor") == [actor]
    assert allocation.find(backend="sglang") == []
    assert allocation.find() == [vllm, actor, ref]
    assert (ref.world_size, ref.n_devices) == (4, 0)


def test_parallelism_text_and_world_size() -> None:
    assert str(Parallelism()) == "d1"
    assert str(Parallelism(t=8)) == "t8"
    assert str(Parallelism(d=2, p=2, t=2, c=2, e=4)) == "d2p2t2c2e4"
    assert Parallelism(d=2, t=2, e=4).world_size == 4  # expert parallel is not multiplied in
    assert DIMENSIONS == tuple(DIMENSION_NAMES)
    with pytest.raises(ValueError):
        Parallelism(d=0)
    with pytest.raises(ValueError):
        Component("fsdp", Parallelism(), device="tpu")


def test_error_is_picklable() -> None:
    import pickle

    with pytest.raises(AllocationParseError) as info:
        parse_allocation("fsdp:d0")
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.text, copy.position, copy.reason) == ("fsdp:d0", 6, "count must be >= 1")
