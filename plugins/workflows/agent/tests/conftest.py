"""Shared by the agent workflow's tests: a tiny model folder, its tokenizer with a tool-aware chat template, a
workflow factory, and scripted engine outputs written as text."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A test double of a Hermes / Qwen2.5-style chat template: ChatML, tools listed in a system turn, an assistant's
# tool calls written as <tool_call>{json}</tool_call>, tool results as a user turn in <tool_response>.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from areal_core.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("areal-agent") / "model", seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from areal_core.models import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def say(tokenizer):
    """Engine output ids for a text: its tokens, then <|im_end|> (the model ends its turn)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(text: str, end_turn: bool = True) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([end] if end_turn else [])

    return ids


@pytest.fixture
def make_flow(tiny_model_dir, tokenizer):
    """make_flow(agent=..., **options) -> an AgentWorkflow on the tiny model (closed after the test)."""
    from areal_core.api import Context
    from areal_core.config.schema import RunConfig
    from areal_agent.config import AgentConfig
    from areal_agent.workflow import AgentWorkflow

    made = []

    def make(group_size: int = 1, max_new_tokens: int = 256, reward=None, **options):
        config = RunConfig()
        config.model.path, config.model.dtype = str(tiny_model_dir), "float32"
        config.rollout.group_size = group_size
        config.rollout.sampling.max_new_tokens = max_new_tokens
        extras = {"reward": reward} if reward is not None else {}
        flow = AgentWorkflow(Context(config=config, options=AgentConfig(**options), extras=extras),
                             tokenizer=tokenizer)
        made.append(flow)
        return flow

    yield make
    for flow in made:
        flow.close()
