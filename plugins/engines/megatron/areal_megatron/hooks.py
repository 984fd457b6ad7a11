"""Placement declaration and plan rules of the ``megatron`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch or megatron.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem
from areal_core.config.allocation import Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, role_of, validate_components
from areal_core.parallelism_rules import divisors, experts_problem, heads_problem, layers_problem

BACKEND = "megatron"
# Written by the user as ``actor.virtual_pipeline_size``: a key of the megatron
# engine's own config, which the loader keeps in ``config.actor.extra``.
VPP_KEY = "virtual_pipeline_size"
# Dimensions declared to the plan check (and their rules checked) that the engine does not build, and why.
UNBUILT = {
    "c": "context parallel (c) in Megatron-Core runs through Transformer Engine's attention, which needs a GPU "
         "and is not wired into this engine; the fsdp backend has context parallel (fsdp:...c2) on CPU and GPU",
    "e": "expert parallel (e) shards the experts of a mixture-of-experts model, and this engine converts dense "
         "Llama / Qwen2 models only",
}


def _rules(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    # actor.virtual_pipeline_size configures the actor; other megatron
    # components (a ref model) keep the default of no virtual pipeline.
    if role_of(comp, "train") != "actor":
        return [*_component_problems(comp, model, 1), _architecture_problem(model)]
    vpp, vpp_problems = _virtual_pipeline_size(config)
    return [*vpp_problems, *_component_problems(comp, model, vpp), *_cpu_problems(config, comp),
            _architecture_problem(model)]


# What MegatronEngine.initialize refuses, judged here from the config and the model's config.json so that
# `areal check` gives the verdict `areal run` would reach only after starting the trainer.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _cpu_problems(config: Any, comp: Component) -> list[Problem | None]:
    """The actor on CPU: float32 only (Megatron's CPU linear layers have no mixed precision), no recomputation
    (it uses Megatron's CUDA RNG checkpointing)."""
    if comp.device != "cpu":
        return []
    from areal_core.config.dtype import resolve_dtype

    dtype = getattr(getattr(config, "model", None), "dtype", "auto")
    problems: list[Problem | None] = []
    if resolve_dtype(dtype) != "float32":
        shown = dtype if dtype != "auto" else "auto (bfloat16 on this CPU, which has bf16 units)"
        problems.append(Problem(
            f"{BACKEND}.cpu-dtype",
            f"'{comp}': model.dtype {shown} over the actor's float32 master weights needs mixed precision, which "
            f"Megatron's CPU linear layers do not support (their backward mixes dtypes under autocast).",
            "set model.dtype=float32 for megatron on CPU, place the actor on GPU, or use actor.backend=fsdp",
            key="model.dtype"))
    if getattr(getattr(config, "actor", None), "gradient_checkpointing", False):
        problems.append(Problem(
            f"{BACKEND}.cpu-recompute",
            f"'{comp}': actor.gradient_checkpointing recomputes activations with Megatron's CUDA RNG checkpointing, "
            f"which has no CPU path.",
            "set actor.gradient_checkpointing=false on CPU, or place the actor on GPU",
            key="actor.gradient_checkpointing"))
    return problems


def _architecture_problem(model: ModelInfo | None) -> Problem | None:
    """The engine converts dense Llama and Qwen2 checkpoints (SwiGLU, no Llama biases, no Qwen2 sliding window)."""
    if model is None or model.model_type is None:
        return None  # not read yet (a hub name): the engine says so when it loads it
    raw = model.raw or {}
    why = None
    if model.model_type not in ARCHITECTURES:
        why = f"a {model.model_type} model; the megatron backend converts {', '.join(ARCHITECTURES)} only"
    elif raw.get("hidden_act", "silu") != "silu":
        why = f"hidden_act {raw['hidden_act']!r}, not silu (SwiGLU), which the conversion assumes"
    elif model.model_type == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        why = "a Llama with attention_bias / mlp_bias, which the conversion does not carry"
    elif model.model_type == "qwen2" and raw.get("use_sliding_window"):
        why = "a Qwen2 with use_sliding_window, which the conversion does not carry"
    if why is None:
        return None
    return Problem(f"{BACKEND}.architecture", f"model.path {model.path} holds {why}.",
                   "use actor.backend=fsdp, which trains any causal LM transformers loads", key="model.path")


def _virtual_pipeline_size(config: Any) -> tuple[int, list[Problem]]:
    extra = getattr(getattr(config, "actor", None), "extra", None)
    value = extra.get(VPP_KEY, 1) if isinstance(extra, dict) else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, []
    return 1, [
        Problem(
            f"{BACKEND}.virtual-pipeline-size",
            f"actor.{VPP_KEY} is {value!r}; it must be an integer >= 1.",
            f"set actor.{VPP_KEY}=1 (no interleaving) or a larger integer",
            key=f"actor.{VPP_KEY}",
        )
    ]


def _component_problems(comp: Component, model: ModelInfo | None, vpp: int) -> list[Problem | None]:
    par = comp.parallel
    return [
        heads_problem(f"{BACKEND}.tensor-heads", comp, par.t, model),
        layers_problem(f"{BACKEND}.pipeline-layers", comp, par.p, model),
        _virtual_pipeline_problem(comp, model, vpp),
        experts_problem(BACKEND, comp, par.e, model),
        _expert_placement_problem(comp),
        _not_built_problem(comp),
    ]


def _virtual_pipeline_problem(comp: Component, model: ModelInfo | None, vpp: int) -> Problem | None:
    par = comp.parallel
    layers = model.num_hidden_layers if model is not None else None
    if vpp <= 1:
        return None
    if par.p == 1:
        return Problem(
            f"{BACKEND}.virtual-pipeline-needs-pipeline",
            f"'{comp}': actor.{VPP_KEY}={vpp} interleaves pipeline stages, "
            "but the component has no pipeline parallelism (p1).",
            f"add pipeline parallelism (e.g. p2) or set actor.{VPP_KEY}=1",
            key=f"actor.{VPP_KEY}",
        )
    # When p alone does not divide the layers, layers_problem already says so.
    if not layers or layers % par.p or layers % (par.p * vpp) == 0:
        return None
    return Problem(
        f"{BACKEND}.virtual-pipeline-layers",
        f"'{comp}': pipeline size p{par.p} x virtual pipeline size {vpp} = "
        f"{par.p * vpp} chunks must divide the model's {layers} layers.",
        f"set actor.{VPP_KEY} to one of {', '.join(map(str, divisors(layers // par.p)))}",
        key=f"actor.{VPP_KEY}",
    )


def _expert_placement_problem(comp: Component) -> Problem | None:
    par = comp.parallel
    # Experts are sharded over the ranks of one pipeline stage (d*t*c of them),
    # with expert-tensor parallel the same size as t.
    stage = par.world_size // par.p
    if par.e <= 1 or stage % (par.e * par.t) == 0:
        return None
    return Problem(
        f"{BACKEND}.expert-placement",
        f"'{comp}': expert parallel e{par.e} x expert-tensor parallel t{par.t} = "
        f"{par.e * par.t} must divide the {stage} ranks of one pipeline stage "
        f"(d{par.d} x t{par.t} x c{par.c}).",
        f"make d x c a multiple of e{par.e}: choose e from "
        f"{', '.join(map(str, divisors(par.d * par.c)))}, or raise d",
        key="allocation",
    )


def _not_built_problem(comp: Component) -> Problem | None:
    """Context and expert parallel are declared (and their rules checked) but not built: see ``UNBUILT``."""
    par = comp.parallel
    unbuilt = [(dim, n) for dim, n in (("c", par.c), ("e", par.e)) if n > 1]
    if not unbuilt:
        return None
    built = "".join(f"{dim}{n}" for dim, n in (("p", par.p), ("t", par.t)) if n > 1)
    return Problem(
        f"{BACKEND}.not-built",
        f"'{comp}': {', '.join(f'{dim}{n}' for dim, n in unbuilt)} is not built by areal-plugin-megatron: "
        f"{'; '.join(UNBUILT[dim] for dim, _ in unbuilt)}.",
        f"use d, t and p only on the same {par.world_size} devices, e.g. "
        f"'megatron:d{par.world_size // (par.p * par.t)}{built}'",
        key="allocation",
    )


areal_declare_backends = declare_backend(
    BACKEND, "train", dims="dptce", devices=("gpu", "cpu"),
    description="Megatron-Core trainer: data, pipeline, tensor, context, expert parallel",
)
areal_validate_parallelism = validate_components(BACKEND, _rules)
