"""The workflow contract: one episode from one dataset item."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from areal_core.api.component import Component
from areal_core.api.inference import InferenceEngine, SamplingParams


@dataclass
class Trajectory:
    """One sampled sequence as the trainer will see it.

    ``loss_mask`` marks the tokens the policy produced (1) versus prompt or
    tool / environment tokens (0); ``versions`` is -1 where no policy produced
    the token. All per-token lists have one entry per token of
    ``input_ids + output_ids`` flattened in ``tokens``.
    """

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory: {n} tokens but {len(getattr(self, name))} entries in {name}; "
                    "every per-token list needs one entry per token"
                )


class Workflow(Component):
    """Runs episodes against an inference engine (entry-point group ``areal.workflows``)."""

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        """Trajectories for ``item`` (a group of them for group-relative methods), or None to reject.

        Token-in / token-out: send token ids to the engine and keep the ids it
        returns; never re-tokenize a model's output.
        """


# -- helpers every token-in / token-out workflow needs ----------------------


def encode_prompt(tokenizer: Any, item: dict) -> tuple[list[int], str]:
    """(token ids, text) of an item's prompt: ``messages`` through the chat template once, or ``prompt`` as is.

    No special tokens are added to a raw ``prompt`` (it is sent as written);
    a chat gets the template's generation prompt (the assistant turn opener).
    """
    if "messages" in item:
        text = tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    elif "prompt" in item:
        text = item["prompt"]
    else:
        raise ValueError(f"item {item.get('id')!r} has neither 'prompt' nor 'messages' (keys: {sorted(item)}); "
                         f"a dataset item needs one of them (see docs/datasets.md)")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def group_size_of(config: Any) -> int:
    """``rollout.group_size``: samples per item (1 without a config)."""
    return int(config.rollout.group_size) if config is not None else 1


def run_seed_of(config: Any) -> int:
    """``trainer.seed`` (0 without a config), for per-sample sampling seeds."""
    return int(config.trainer.seed) if config is not None else 0


def sampling_params(config: Any, item: dict, seed: int | None = None) -> SamplingParams:
    """``config.rollout.sampling`` plus the item's own ``stop`` strings, with ``seed``.

    ``config`` None (unit tests) gives the :class:`SamplingParams` defaults.
    """
    stop = tuple(dict.fromkeys([*(config.rollout.sampling.stop if config is not None else []),
                                *item.get("stop", [])]))
    if config is None:
        return SamplingParams(stop=stop, seed=seed)
    s = config.rollout.sampling
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, stop=stop, seed=seed)
