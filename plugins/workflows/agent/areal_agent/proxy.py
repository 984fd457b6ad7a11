"""What the proxy does per call, apart from HTTP: tokenize (reusing earlier tokens), generate, record, answer.

Runs on the proxy's thread; generation itself runs on the episode's event loop
through :meth:`Session.generate`, i.e. through the engine the rollout
controller handed the episode (staleness bound, interruption, per-token
versions apply as to any workflow).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict

from areal_core.api import GenerationRequest, SamplingParams
from areal_agent.chat import ChatTokenizer, message_key
from areal_agent.sessions import CallRecord, Choice, Session
from areal_agent.tools import offered_functions, parse_tool_calls


class _Sampled(BaseModel):
    """The fields the chat and completion requests share: how many, how long, how sampled."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    n: int = 1
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


class ChatRequest(_Sampled):
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Any = None
    stream_options: dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[int]
    logprobs: int | None = None


class BadRequest(ValueError):
    """A request the proxy cannot serve; answered with HTTP 400 and this message."""


class UnknownModel(BadRequest):
    """A request for a model this proxy does not serve; answered with HTTP 404 (OpenAI's model_not_found)."""


SERVED_NAME = "policy"  # the name every agent may use for the model being trained (docs/workflows.md)
UNSERVED_PARTS = {"image_url": "an image", "input_image": "an image", "input_audio": "audio", "file": "a file",
                  "input_file": "a file"}


def check_sampling(body: Any) -> None:
    """The numbers a request sets, each within what OpenAI's API allows (BadRequest naming the field)."""
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, field, None)
        if value is not None and value < 1:
            raise BadRequest(f"{field} is {value}; it must be at least 1 (leave it out for the run's "
                             f"rollout.sampling.max_new_tokens)")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise BadRequest(f"temperature is {body.temperature}; it must be between 0 and 2")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise BadRequest(f"top_p is {body.top_p}; it must be greater than 0 and at most 1")
    response_format = (body.model_extra or {}).get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        raise BadRequest(f"response_format {kind!r} is not served: the engines sample without a grammar, so JSON "
                         f"output cannot be guaranteed; leave response_format out (or 'text') and ask for JSON in "
                         f"the prompt")


def check_content(messages: list[dict]) -> None:
    """Text only: a part the model cannot read (an image, audio, a file) is refused, not silently dropped."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] is {message!r}, not a message object")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    what = UNSERVED_PARTS.get(kind, f"a part of type {kind!r}")
                    raise BadRequest(f"messages[{i}].content[{j}] is {what}; the model takes text only (send text "
                                     f"parts, or a string)")


def tools_key(tools: list | None) -> str:
    """A digest of the tools a call was rendered with (a later call with other tools is not a continuation):
    kept on the call's record, not in its info, which every trajectory of the episode copies."""
    return hashlib.sha1(json.dumps(tools or [], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def tool_format(parser: str, template: str) -> str:
    """``hermes`` or ``llama3``: how this model writes a tool call (``workflow.tool_parser``, or its template's)."""
    if parser in ("hermes", "llama3"):
        return parser
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "parameters" in template):
        return "llama3"
    return "hermes"


def forced_opening(tool_choice: Any, tools: list | None, style: str) -> str:
    """The text a reply must begin with for ``tool_choice`` (``required`` or one named function), else "".

    The engines sample freely (no grammar), so the proxy writes the start of the call in the model's format
    and lets the model continue: with ``required`` from the function's name on, with a named function from its
    arguments on. The opening goes into the prompt (not trained: the model did not sample it). Arguments that
    then do not parse come back as content, as any garbled tool call does.
    """
    if tool_choice in (None, "auto", "none"):
        return ""
    names = [(t.get("function") or {}).get("name") for t in tools or []]
    if tool_choice == "required":
        if not names:
            raise BadRequest("tool_choice is 'required' but the request sends no tools; send tools or "
                             "tool_choice 'auto'")
        return '<tool_call>\n{"name": "' if style == "hermes" else '{"name": "'
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not among the request's tools "
                             f"({', '.join(map(str, names)) or 'none sent'})")
        key = "arguments" if style == "hermes" else "parameters"
        return ("<tool_call>\n" if style == "hermes" else "") + f'{{"name": {json.dumps(name)}, "{key}": '
    raise BadRequest(f"tool_choice is {tool_choice!r}; send 'auto', 'none', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}")


class Proxy:
    """Serves the OpenAI endpoints for every session of one workflow."""

    def __init__(self, tokenizer: Any, sampling: SamplingParams, options: Any, model_name: str) -> None:
        self.chat = ChatTokenizer(tokenizer)
        self.sampling, self.options, self.model_name = sampling, options, model_name
        self.served = list(dict.fromkeys([SERVED_NAME, model_name, *(getattr(options, "model_aliases", None) or [])]))
        self.vocab_size = len(tokenizer)
        self.stop_ids = tuple(i for i in {tokenizer.eos_token_id} if i is not None)
        self.tool_style = tool_format(options.tool_parser, str(getattr(tokenizer, "chat_template", "") or ""))

    # ------------------------------------------------------------ sampling
    def params(self, body: Any, k: int) -> SamplingParams:
        base, o = self.sampling, self.options
        wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
        params = replace(base, max_new_tokens=min(wanted or base.max_new_tokens, base.max_new_tokens),
                         stop=tuple(dict.fromkeys([*base.stop, *stop])),
                         stop_token_ids=tuple(dict.fromkeys([*base.stop_token_ids, *self.stop_ids])))
        if o.agent_sampling:
            params = replace(params, temperature=base.temperature if body.temperature is None else body.temperature,
                             top_p=base.top_p if body.top_p is None else body.top_p,
                             seed=None if body.seed is None else body.seed + k)
        return params

    def check(self, body: Any) -> None:
        """What every endpoint refuses before generating: an unknown model, numbers out of range."""
        if body.model and body.model not in self.served:
            raise UnknownModel(f"the model {body.model!r} is not served here; this proxy serves "
                               f"{', '.join(map(repr, self.served))} (workflow.model_aliases adds names)")
        check_sampling(body)

    async def sample(self, session: Session, prompt_ids: list[int], body: Any, call_id: str) -> list[Any]:
        if body.n < 1 or body.n > 16:
            raise BadRequest(f"n is {body.n}; the proxy serves 1 to 16 choices per call")
        requests = [GenerationRequest(list(prompt_ids), self.params(body, k),
                                      metadata={"session": session.id, "call": call_id, "choice": k})
                    for k in range(body.n)]
        timeout = self.options.agent_timeout_s
        try:
            return list(await asyncio.gather(*(session.generate(r, timeout) for r in requests)))
        except ValueError as exc:  # the engine refused the request itself (too long, ...): the agent's to fix
            raise BadRequest(f"the inference engine refused the request ({len(prompt_ids)} prompt tokens): "
                             f"{exc}") from None

    def choice(self, response: Any, opening: str = "", tools: list | None = None) -> Choice:
        """What the proxy answers for one engine reply; ``opening``: the text the proxy began the reply with;
        ``tools``: the request's, the only functions a reply may call (others come back as content, flagged)."""
        ids = list(response.output_ids)
        text = self.chat.decode(ids)
        choice = Choice(ids, list(response.output_logprobs), list(response.output_versions), response.stop_reason,
                        text, content=opening + text)
        if tools or opening:
            raw = self.chat.decode(ids, skip_special=False)
            if ids and ids[-1] in self.chat.special_ids:  # the end-of-turn marker is not part of the reply
                raw = raw[:len(raw) - len(self.chat.decode(ids[-1:], skip_special=False))]
            parsed = parse_tool_calls(opening + raw, self.tool_style if opening else self.options.tool_parser,
                                      offered_functions(tools))
            if parsed.errors:
                choice.tool_errors = parsed.errors
            if parsed.tool_calls:
                choice.content, choice.tool_calls = parsed.content, parsed.tool_calls
                if choice.content is not None:
                    choice.content = self._strip_special(choice.content)
        return choice

    def _strip_special(self, text: str) -> str:
        for token in self.chat.tokenizer.all_special_tokens:
            text = text.replace(token, "")
        return text

    # ------------------------------------------------------------ chat
    def prompt_for(self, session: Session, messages: list[dict], tools: list | None,
                   tools_digest: str) -> tuple[list[int], dict, Any]:
        """Prompt ids for ``messages``: an earlier call's exact ids + the new messages' ids where they extend it."""
        keys = [message_key(m) for m in messages]
        hit = session.earlier(keys)
        if hit is None:
            reason = "first call of the session" if not session.records else \
                "the messages do not extend an earlier call's messages and reply"
            return self._render_whole(messages, tools), {"reused": False, "reason": reason}, None
        n, record, k = hit
        if record.tools_digest != tools_digest:
            # the template renders the tools into the prompt: the earlier ids show the old ones (a handoff, a
            # dynamic tool), so the call is rendered whole, a branch of its own
            return self._render_whole(messages, tools), {"reused": False, "reason": "the tools differ from the "
                                                         "earlier call's, and the template renders them"}, None
        choice = record.choices[k]
        ids, why = self.chat.continuation(messages[:n - 1], messages[n:], tools,
                                          choice.output_ids[-1] if choice.output_ids else None)
        if ids is None:
            return self._render_whole(messages, tools), {"reused": False, "reason": why}, None
        prefix = [*record.prompt_ids, *choice.output_ids]
        return prefix + ids, {"reused": True, "from_call": record.call_id, "choice": k,
                              "reused_tokens": len(prefix), "new_tokens": len(ids)}, (record.call_id, k)

    def _render_whole(self, messages: list[dict], tools: list | None) -> list[int]:
        try:
            return self.chat.full(messages, tools)
        except Exception as exc:
            raise BadRequest(f"the model's chat template cannot render these messages: "
                             f"{type(exc).__name__}: {exc}") from None

    async def chat_completion(self, session: Session, body: ChatRequest) -> tuple[CallRecord, dict]:
        self.check(body)
        if not body.messages:
            raise BadRequest("messages is empty; send at least one message")
        check_content(body.messages)
        if body.top_logprobs:
            raise BadRequest(f"top_logprobs is {body.top_logprobs}; the engines return the sampled token's logprob "
                             f"only: leave top_logprobs out or send 0 (logprobs=true still gives each token's)")
        use_tools = body.tools if body.tool_choice != "none" else None
        opening = forced_opening(body.tool_choice, use_tools, self.tool_style)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        began = time.monotonic()
        digest = tools_key(use_tools)
        prompt_ids, prefix, parent = self.prompt_for(session, body.messages, use_tools, digest)
        if opening:  # part of the prompt: the model continues it, and it is not trained
            prompt_ids = prompt_ids + self.chat.encode(opening)
        responses = await self.sample(session, prompt_ids, body, call_id)
        choices = [self.choice(r, opening, use_tools) for r in responses]
        info = {"prefix": prefix, **({"forced_opening": opening} if opening else {})}
        errors = {k: c.tool_errors for k, c in enumerate(choices) if c.tool_errors}
        if errors:  # recorded with the trajectory; the agent gets the reply as content
            info["tool_errors"] = errors
        if prefix["reused"] and not opening:
            kept = self._kept_text(session, parent, prompt_ids, prefix["reused_tokens"])
            drift = self.chat.drift(prompt_ids, body.messages, use_tools, kept)
            if drift is not None:
                info["template_drift"] = drift
            for k, c in enumerate(choices):  # what the next call's check starts from
                session.kept_texts[(call_id, k)] = kept + self.chat.decode(c.output_ids, skip_special=False)
        record = CallRecord(call_id, "chat", prompt_ids, choices, parent, info=info,
                            seconds=time.monotonic() - began, tools_digest=digest)
        keys = [message_key(m) for m in body.messages]
        replies = [message_key({"role": "assistant", "content": c.content, "tool_calls": c.tool_calls})
                   for c in choices]
        session.add(record, messages=keys, texts=replies)
        return record, self.chat_body(record, body)

    def _kept_text(self, session: Session, parent: tuple[str, int], prompt_ids: list[int], reused: int) -> str:
        """``prompt_ids`` decoded: the parent call's kept text (when this session has it) + the new ids'."""
        head = session.kept_texts.get(parent)
        if head is None:
            head = self.chat.decode(prompt_ids[:reused], skip_special=False)
        return head + self.chat.decode(prompt_ids[reused:], skip_special=False)

    def chat_body(self, record: CallRecord, body: ChatRequest) -> dict:
        choices = []
        for k, c in enumerate(record.choices):
            message: dict = {"role": "assistant", "content": c.content}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            entry = {"index": k, "message": message, "finish_reason": finish_reason(c),
                     "logprobs": self.logprobs(c) if body.logprobs else None}
            choices.append(entry)
        return {"id": record.call_id, "object": "chat.completion", "created": int(time.time()),
                "model": body.model or self.model_name, "choices": choices, "usage": usage(record)}

    def logprobs(self, c: Choice) -> dict:
        tokens = []
        for token_id, lp in zip(c.output_ids, c.logprobs):
            text = self.chat.decode([token_id], skip_special=False)
            tokens.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": tokens}

    # ------------------------------------------------------------ completions
    async def completion(self, session: Session, body: CompletionRequest) -> tuple[CallRecord, dict]:
        self.check(body)
        if not body.prompt:
            raise BadRequest("prompt is empty; send text or at least one token id")
        if isinstance(body.prompt, list):
            bad = next(((i, t) for i, t in enumerate(body.prompt) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt[{bad[0]}] is the token id {bad[1]}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size})")
        call_id = f"cmpl-{uuid.uuid4().hex}"
        began = time.monotonic()
        parent = None
        if isinstance(body.prompt, list):
            prompt_ids, prefix = list(body.prompt), {"reused": False, "reason": "token ids given"}
        else:
            hit = session.earlier_text(body.prompt)
            if hit is None:
                prompt_ids = self.chat.encode(body.prompt)
                prefix = {"reused": False, "reason": "the prompt does not extend an earlier prompt and output"}
            else:
                text, record, k = hit
                prefix_ids = [*record.prompt_ids, *record.choices[k].output_ids]
                rest = self.chat.encode(body.prompt[len(text):])
                prompt_ids, parent = prefix_ids + rest, (record.call_id, k)
                prefix = {"reused": True, "from_call": record.call_id, "choice": k,
                          "reused_tokens": len(prefix_ids), "new_tokens": len(rest)}
        responses = await self.sample(session, prompt_ids, body, call_id)
        choices = [self.choice(r) for r in responses]
        record = CallRecord(call_id, "completions", prompt_ids, choices, parent, info={"prefix": prefix},
                            seconds=time.monotonic() - began)
        prompt_text = body.prompt if isinstance(body.prompt, str) else self.chat.decode(prompt_ids)
        session.add(record, texts=[prompt_text + c.text for c in choices])
        out = []
        for k, c in enumerate(choices):
            lp = None
            if body.logprobs is not None:
                tokens = [self.chat.decode([t], skip_special=False) for t in c.output_ids]
                lp = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": None}
            out.append({"index": k, "text": c.text, "finish_reason": finish_reason(c), "logprobs": lp})
        return record, {"id": call_id, "object": "text_completion", "created": int(time.time()),
                        "model": body.model or self.model_name, "choices": out, "usage": usage(record)}


def finish_reason(c: Choice) -> str:
    if c.tool_calls:
        return "tool_calls"
    return "length" if c.stop_reason == "length" else "stop"


def usage(record: CallRecord) -> dict:
    completion = sum(len(c.output_ids) for c in record.choices)
    return {"prompt_tokens": len(record.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(record.prompt_ids) + completion}
