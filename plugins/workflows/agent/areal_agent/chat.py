"""Chat messages -> prompt token ids, reusing an earlier call's exact tokens where the messages extend it.

A call whose messages are an earlier call's messages, then the assistant reply
the proxy returned for it, then new messages (tool results, the user's next
turn) is prompted with the earlier call's prompt ids + the model's output ids
exactly as the engine produced them + the ids of only the new messages. Those
are tokenized from the text the chat template writes after an assistant turn
(found by rendering the template around a placeholder, as the ``multi_turn``
workflow does between turns). No text the model produced is ever re-tokenized,
so the trained tokens are the sampled ones (no drift).

What the template would have written instead is reported, not used: where the
template renders the history differently from the tokens kept (it rewrites a
tool call's JSON, drops an earlier turn's reasoning, ...), ``info["template_drift"]``
says where; where the new messages cannot be isolated (the template rejects
or rewrites the placeholder turn), the call is tokenized whole and
``info["prefix"]["reason"]`` says why.
"""

from __future__ import annotations

import json
from typing import Any

PLACEHOLDER = "\u2063AREAL-ASSISTANT-TURN\u2063"


def content_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def tool_call_key(call: Any) -> tuple[str, str]:
    function = call.get("function") or {}
    arguments = function.get("arguments", "")
    try:  # the agent may re-serialise the arguments (spacing, key order)
        arguments = json.dumps(json.loads(arguments), sort_keys=True)
    except (TypeError, ValueError):
        pass
    return function.get("name", ""), arguments


def message_key(message: dict) -> str:
    """A canonical string of what a message says (role, text, name, tool call id, tool calls)."""
    return json.dumps([message.get("role"), content_text(message.get("content")), message.get("name"),
                       message.get("tool_call_id"),
                       [tool_call_key(c) for c in message.get("tool_calls") or []]], ensure_ascii=False)


def template_message(message: dict) -> dict:
    """A message as chat templates expect it: text content, tool call arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = content_text(message.get("content"))
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function") or {})
            try:
                function["arguments"] = json.loads(function.get("arguments") or "{}")
            except (TypeError, ValueError):
                pass
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


class ChatTokenizer:
    """The run's tokenizer and chat template, rendering OpenAI messages token-in / token-out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool = True) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template([template_message(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        # straight to the Rust tokenizer where there is one: transformers' decode first converts every id through
        # Python (to_py_obj), which made a 76k-token history's drift check 7 ms of a 16 ms call
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return backend.decode(list(ids), skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def full(self, messages: list[dict], tools: list | None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def continuation(self, earlier: list[dict], new: list[dict], tools: list | None,
                     last_token: int | None) -> tuple[list[int] | None, str]:
        """Ids of ``new`` as the template writes them after an assistant turn following ``earlier``.

        (ids, "") or (None, why it cannot be done with this template).
        """
        try:
            rendered = self.render([*earlier, {"role": "assistant", "content": PLACEHOLDER}, *new], tools)
        except Exception as exc:  # a template that refuses this shape
            return None, f"the chat template fails on a placeholder assistant turn: {type(exc).__name__}: {exc}"
        if rendered.count(PLACEHOLDER) != 1:
            return None, "the chat template does not write an earlier assistant turn's content as given"
        text = rendered[rendered.index(PLACEHOLDER) + len(PLACEHOLDER):]
        # The model's own last token may already be the end-of-turn marker the template writes next.
        if last_token is not None and last_token in self.special_ids:
            marker = self.tokenizer.decode([last_token])
            if text.startswith(marker):
                text = text[len(marker):]
        return self.encode(text), ""

    def drift(self, ids: list[int], messages: list[dict], tools: list | None, kept: str | None = None) -> dict | None:
        """Where re-rendering ``messages`` through the template would differ from ``ids`` (kept), or None.
        ``kept``: ``ids`` already decoded (the proxy keeps each call's text, so a long history is not decoded
        again on every call)."""
        try:
            template = self.render(messages, tools)
        except Exception:
            return None
        kept = self.decode(ids, skip_special=False) if kept is None else kept
        if kept == template:
            return None
        at = next((i for i, (a, b) in enumerate(zip(kept, template)) if a != b), min(len(kept), len(template)))
        return {"char": at, "kept": kept[max(0, at - 20):at + 40], "template": template[max(0, at - 20):at + 40],
                "note": "re-rendering the messages through the chat template would train on other tokens here; "
                        "the tokens the engine saw and produced are kept"}
