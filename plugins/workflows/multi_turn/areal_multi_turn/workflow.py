"""The ``multi_turn`` workflow: model turn, environment reply, ... until done or ``max_turns``.

Token-in / token-out across turns: turn t+1's prompt is every token so far
(prompt, the model's ids as the engine returned them, the environment's
reply ids) and never a re-tokenized transcript. Only the environment's reply
is tokenized: for a chat, the text the chat template puts after an assistant
turn (its end marker, the reply turn, the next assistant opener), found by
rendering the template around a placeholder; for a raw prompt,
``raw_reply_format``. Loss only on the model's tokens: reply tokens have
loss_mask 0, logprob 0 and version -1.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from areal_core.api import (
    GenerationRequest,
    InferenceEngine,
    Trajectory,
    Workflow,
    encode_prompt,
    group_size_of,
    run_seed_of,
    sampling_params,
    stable_seed,
)
from areal_core.config.schema import spec
from areal_multi_turn.environment import FunctionEnvironment, RetryWithFeedback, answer, load_object

PLACEHOLDER = "\u2063AREAL-ASSISTANT-TURN\u2063"


@dataclass
class MultiTurnConfig:
    """Keys of ``workflow`` when ``workflow.name: multi_turn``."""

    max_turns: int = spec(3, ge=1, help="model turns per episode at most")
    discount: float = spec(1.0, gt=0.0, le=1.0, help="the final reward is multiplied by discount ** (turns - 1)")
    environment: str = spec("", help="'package.module:Name' of an environment class or function; "
                                     "'' = retry with feedback, scored by the run's reward")
    environment_options: dict = spec(factory=dict, help="keyword arguments for the environment class")
    feedback: str = spec("That is not right. Try again.", help="the default environment's reply to a wrong answer")
    success_threshold: float = spec(1.0, help="the default environment ends the episode at this reward or above")
    raw_reply_format: str = spec("\n{message}\n", help="how a reply is appended to a raw (non-chat) prompt")
    seed_samples: bool = spec(True, help="seed each turn's sampling from (trainer.seed, item id, sample, turn)")


class MultiTurnWorkflow(Workflow):
    """Multi-turn episodes; needs ``context.extras["reward"]`` for the default environment."""

    config_class = MultiTurnConfig

    def __init__(self, context: Any = None, tokenizer: Any = None) -> None:
        super().__init__(context)
        o = self.options = self.context.options if self.context.options is not None else MultiTurnConfig()
        self.reward = self.context.extras.get("reward")
        self.factory = load_object(o.environment, "workflow.environment") if o.environment else None
        if self.factory is None and self.reward is None:
            raise ValueError("the default multi_turn environment scores answers with the run's reward, but "
                             "context.extras['reward'] is missing; the trainer passes it (build(..., reward=...))")
        self.group_size, self.run_seed = group_size_of(self.context.config), run_seed_of(self.context.config)
        if tokenizer is None:
            from areal_core.models import load_tokenizer

            tokenizer = load_tokenizer(self.context.config)
        self.tokenizer = tokenizer

    def environment(self, item: Any) -> Any:
        o = self.options
        if self.factory is None:
            return RetryWithFeedback(item, self.reward, o.feedback, o.success_threshold)
        if isinstance(self.factory, type):
            return self.factory(item=item, reward=self.reward, **o.environment_options)
        return FunctionEnvironment(self.factory, item)

    def reply_ids(self, item: dict, reply: Any, last_token: int | None) -> list[int]:
        """Token ids of the environment's reply, as the chat template (or raw format) places it."""
        if "messages" not in item:
            text = self.options.raw_reply_format.format(message=reply.message)
        else:
            rendered = self.tokenizer.apply_chat_template(
                [*item["messages"], {"role": "assistant", "content": PLACEHOLDER},
                 {"role": reply.role, "content": reply.message}], tokenize=False, add_generation_prompt=True)
            text = rendered[rendered.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
            # The model's last token may already be the end-of-turn marker the template writes next.
            if last_token is not None and last_token in self.tokenizer.all_special_ids:
                marker = self.tokenizer.decode([last_token])
                if text.startswith(marker):
                    text = text[len(marker):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def _sample(self, engine: InferenceEngine, item: dict, k: int) -> Trajectory:
        o = self.options
        prompt_ids, prompt_text = encode_prompt(self.tokenizer, item)
        tokens, loss_mask = list(prompt_ids), [0] * len(prompt_ids)
        logprobs, versions = [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
        env = self.environment(item)
        if isinstance(env, RetryWithFeedback):
            env.prompt = prompt_text
        turns: list[dict] = []
        reply = None
        for turn in range(1, o.max_turns + 1):
            seed = stable_seed(self.run_seed, str(item["id"]), k, turn) if o.seed_samples else None
            response = await engine.agenerate(GenerationRequest(
                list(tokens), sampling_params(self.context.config, item, seed),
                metadata={"item_id": item.get("id"), "sample": k, "turn": turn}))
            tokens += response.output_ids
            loss_mask += [1] * len(response.output_ids)
            logprobs += response.output_logprobs
            versions += response.output_versions
            completion = self.tokenizer.decode(response.output_ids, skip_special_tokens=True)
            reply = await answer(env, completion, turn)
            turns.append({"completion": completion, "reward": reply.reward, "reply": reply.message,
                          "stop_reason": response.stop_reason, "info": reply.info})
            if reply.done or turn == o.max_turns:
                break
            ids = self.reply_ids(item, reply, response.output_ids[-1] if response.output_ids else None)
            tokens += ids
            loss_mask += [0] * len(ids)
            logprobs += [0.0] * len(ids)
            versions += [-1] * len(ids)
        reward = float(reply.reward) * o.discount ** (len(turns) - 1)
        return Trajectory(tokens, loss_mask, logprobs, versions, reward,
                          info={"id": item.get("id"), "sample": k, "prompt": prompt_text, "turns": turns,
                                "num_turns": len(turns), "success": bool(reply.done)})

    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        return list(await asyncio.gather(*(self._sample(engine, item, k) for k in range(self.group_size))))
