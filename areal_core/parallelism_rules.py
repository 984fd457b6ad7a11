"""Small plan rules shared by engine plugins' ``areal_validate_parallelism`` hooks.

The core checks what every plan obeys (:mod:`areal_core.parallelism`); rules
that depend on a backend live in its plugin. The ones several backends share
are here so that their wording and hints stay the same everywhere.
"""

from __future__ import annotations

from dataclasses import replace
from math import isqrt
from typing import TYPE_CHECKING

from areal_core.problems import Problem

if TYPE_CHECKING:  # pragma: no cover - typing only
    from areal_core.config.allocation import Component
    from areal_core.config.model_info import ModelInfo

__all__ = ["divisors", "experts_problem", "heads_problem", "layers_problem"]


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n`` in ascending order; [] when ``n`` < 1."""
    if n < 1:
        return []
    small = [k for k in range(1, isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def heads_problem(
    code: str,
    comp: Component,
    t: int,
    model: ModelInfo | None,
    *,
    kv_replication: bool = False,
) -> Problem | None:
    """A problem when tensor parallel size ``t`` cannot split the model's attention heads.

    ``t`` must divide the number of attention heads and of key-value heads.
    With ``kv_replication`` (vLLM, SGLang) a ``t`` that is a multiple of the
    key-value heads is accepted too: each key-value head is then replicated
    on ``t // kv`` ranks. None when ``t`` is 1, the model is unknown or its
    config does not give the head count, or ``t`` fits.
    """
    if t <= 1 or model is None or not model.num_attention_heads:
        return None
    heads = model.num_attention_heads
    kv = model.num_key_value_heads or heads

    def fits(size: int) -> bool:
        return heads % size == 0 and (kv % size == 0 or (kv_replication and size % kv == 0))

    if fits(t):
        return None
    valid = [size for size in divisors(heads) if fits(size)]
    kv_rule = (
        f", and divide or be a multiple of its {kv} key-value heads"
        if kv_replication
        else f" and its {kv} key-value heads"
    )
    below = [size for size in valid if size < t]
    example = replace(comp, parallel=replace(comp.parallel, t=below[-1])) if below else None
    return Problem(
        code,
        f"'{comp}': tensor parallel size t{t} must divide the model's {heads} attention heads"
        f"{kv_rule}.",
        f"choose t from {', '.join(map(str, valid))}"
        + (f", e.g. '{example}'" if example is not None else ""),
        key="allocation",
    )


def layers_problem(code: str, comp: Component, p: int, model: ModelInfo | None) -> Problem | None:
    """A problem when pipeline size ``p`` does not divide the model's layers.

    None when ``p`` is 1, the model or its layer count is unknown, or ``p`` fits.
    """
    layers = model.num_hidden_layers if model is not None else None
    if p <= 1 or not layers or layers % p == 0:
        return None
    return Problem(
        code,
        f"'{comp}': pipeline size p{p} must divide the model's {layers} layers.",
        f"choose p from {', '.join(map(str, divisors(layers)))}",
        key="allocation",
    )


def experts_problem(
    backend: str,
    comp: Component,
    e: int,
    model: ModelInfo | None,
    *,
    divide_experts: bool = True,
) -> Problem | None:
    """A problem when expert parallel size ``e`` does not fit the model's experts.

    ``<backend>.expert-not-moe`` when ``e`` > 1 and the model has no experts;
    with ``divide_experts``, ``<backend>.expert-count`` when ``e`` does not
    divide the number of experts. None when ``e`` is 1 or the model unknown.
    """
    if e <= 1 or model is None:
        return None
    if not model.is_moe:
        return Problem(
            f"{backend}.expert-not-moe",
            f"'{comp}': expert parallel e{e} needs a mixture-of-experts model, "
            f"but the model at {model.path!r} has no experts.",
            "remove e from the allocation, or use a mixture-of-experts model",
            key="allocation",
        )
    experts = model.num_experts or 0
    if divide_experts and experts % e:
        return Problem(
            f"{backend}.expert-count",
            f"'{comp}': expert parallel size e{e} must divide the model's {experts} experts.",
            f"choose e from {', '.join(map(str, divisors(experts)))}",
            key="allocation",
        )
    return None
