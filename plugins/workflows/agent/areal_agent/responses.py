"""The Responses API (``/v1/responses``) on top of the proxy's chat path: items in, items out, streamed or not.

A Responses request is turned into a chat request (``instructions`` + ``input``
items + ``previous_response_id``'s conversation -> messages, function tools ->
chat tools) and served by :meth:`Proxy.chat_completion`, so token reuse,
recording, tool-call parsing and the staleness bound are the chat path's. The
answer is turned back into output items: a ``message`` with ``output_text``
and one ``function_call`` per tool call; with ``stream`` the same response as
the Responses API's server-sent events (created, item and part added, text or
arguments delta and done, item done, completed), generated first and then sent
(the engines return whole replies).

Input items served: messages (``role`` + text content), ``function_call`` and
``function_call_output``; others (images, files, reasoning, built-in tools) get
HTTP 400 naming the item. ``previous_response_id`` reaches back to responses of
the same session only (a session is one episode).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from areal_agent.proxy import BadRequest, ChatRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def text_of(content: Any) -> str:
    """A message's text: a string, or the ``input_text`` / ``output_text`` / ``text`` parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"message content {content!r} is neither text nor a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise BadRequest(f"content part of type {kind!r} is not served (text parts only: input_text, "
                             f"output_text)")
        texts.append(part.get("text") or "")
    return "".join(texts)


def input_messages(given: Any) -> list[dict]:
    """``input`` (a string or a list of items) as chat messages; consecutive function calls join one assistant
    turn, with the assistant message just before them if there is one (as the chat path answered them)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise BadRequest("input must be a string or a list of items (messages, function_call, "
                         "function_call_output)")
    messages: list[dict] = []
    open_turn = False  # the last message is an assistant turn that the next function calls join
    for n, item in enumerate(given):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{n}] is {item!r}, not an item")
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            messages.append({"role": item["role"], "content": text_of(item.get("content"))})
            open_turn = item["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if open_turn:
                messages[-1].setdefault("tool_calls", []).append(call)
                messages[-1]["content"] = messages[-1]["content"] or None  # as the chat path answers calls only
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            open_turn = True
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
            open_turn = False
        else:
            raise BadRequest(f"input[{n}] is an item of type {kind!r}, which the proxy does not serve "
                             f"(messages, function_call and function_call_output only)")
    return messages


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in the chat shape."""
    if not tools:
        return None
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"tools[{n}] is of type {kind!r}; the proxy serves function tools only "
                             f"({{'type': 'function', 'name': ..., 'parameters': ...}})")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def conversation_before(responses: dict[str, list[dict]], previous: str | None) -> list[dict]:
    """The messages of ``previous`` (a response id of this session, in ``responses``) with its reply; [] for None."""
    if previous is None:
        return []
    if previous not in responses:
        raise BadRequest(f"previous_response_id {previous!r} is not a response of this session (each episode's "
                         f"key reaches its own responses only)")
    return list(responses[previous])


def chat_request(data: dict, conversation: list[dict]) -> ChatRequest:
    """The chat request a Responses request asks for."""
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    if data.get("top_logprobs"):
        raise BadRequest(f"top_logprobs is {data['top_logprobs']}; the engines return the sampled token's logprob "
                         f"only: leave it out and ask include=['{LOGPROBS_INCLUDE}']")
    messages = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") else []
    messages += conversation + input_messages(data.get("input"))
    include = data.get("include") or []
    return ChatRequest(messages=messages, model=data.get("model") or "", max_tokens=data.get("max_output_tokens"),
                       temperature=data.get("temperature"), top_p=data.get("top_p"),
                       tools=chat_tools(data.get("tools")), tool_choice=chat_tool_choice(data.get("tool_choice")),
                       logprobs=LOGPROBS_INCLUDE in include)


def response_body(data: dict, answer: dict) -> tuple[dict, dict]:
    """(the Response object for a chat ``answer``, the assistant message it adds to the conversation)."""
    choice = answer["choices"][0]
    message = choice["message"]
    rid = "resp_" + answer["id"].removeprefix("chatcmpl-")
    output: list[dict] = []
    if message.get("content") or not message.get("tool_calls"):
        logprobs = [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"], "top_logprobs": []}
                    for t in (choice.get("logprobs") or {}).get("content", [])]
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                       "role": "assistant", "content": [{"type": "output_text", "text": message.get("content") or "",
                                                         "annotations": [], "logprobs": logprobs}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = answer["usage"]
    cut = choice["finish_reason"] == "length"
    body = {"id": rid, "object": "response", "created_at": answer["created"],
            "status": "incomplete" if cut else "completed", "model": answer["model"], "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": data.get("instructions"), "metadata": data.get("metadata") or {},
            "previous_response_id": data.get("previous_response_id"), "parallel_tool_calls": True,
            "temperature": data.get("temperature"), "top_p": data.get("top_p"),
            "max_output_tokens": data.get("max_output_tokens"), "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice") or "auto", "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    reply = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return body, reply


def response_events(body: dict) -> Iterator[dict]:
    """``body`` (a finished Response) as the Responses API's stream of events, numbered in order."""
    seq = iter(range(1 << 62))
    started = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield {"type": "response.created", "sequence_number": next(seq), "response": started}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": started}
    for index, item in enumerate(body["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            yield {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": index,
                   "item": {**item, "status": "in_progress", "content": []}}
            for k, part in enumerate(item["content"]):
                empty = {**part, "text": "", "logprobs": []}
                yield {"type": "response.content_part.added", "sequence_number": next(seq), **at,
                       "content_index": k, "part": empty}
                yield {"type": "response.output_text.delta", "sequence_number": next(seq), **at, "content_index": k,
                       "delta": part["text"], "logprobs": part["logprobs"]}
                yield {"type": "response.output_text.done", "sequence_number": next(seq), **at, "content_index": k,
                       "text": part["text"], "logprobs": part["logprobs"]}
                yield {"type": "response.content_part.done", "sequence_number": next(seq), **at,
                       "content_index": k, "part": part}
        else:
            yield {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": index,
                   "item": {**item, "status": "in_progress", "arguments": ""}}
            yield {"type": "response.function_call_arguments.delta", "sequence_number": next(seq), **at,
                   "delta": item["arguments"]}
            yield {"type": "response.function_call_arguments.done", "sequence_number": next(seq), **at,
                   "name": item["name"], "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "sequence_number": next(seq), "output_index": index,
               "item": item}
    final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield {"type": final, "sequence_number": next(seq), "response": body}
