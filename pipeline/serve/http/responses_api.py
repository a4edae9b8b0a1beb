"""OpenAI's Responses API, `POST /v1/responses`, in the subset vLLM serves for chat models.

A request becomes a chat body (`ChatBody`) and is generated as /v1/chat/completions generates it
(the chat template, the tool-call and reasoning parsers); the reply becomes the response's
`output` items: a `reasoning` item (with `--reasoning-parser`), `function_call` items (tools, read
by `--tool-call-parser` as for chat), then the `message` with its `output_text`.

- `input`: a text (one user message) or items: messages (`role`, `content` as text or
  `input_text` / `output_text` parts), `function_call` and `function_call_output` (a tool round
  trip sent back), `reasoning` (dropped: the template renders no past thinking);
- `instructions`: a system message first (not carried to a later response, as OpenAI says);
- `tools`: function tools in the Responses form (`{"type": "function", "name", "parameters"}`),
  `tool_choice` `auto`, `none`, `required` or `{"type": "function", "name"}`;
- `max_output_tokens`: the reply's bound; a reply that reaches it is `incomplete`;
- `previous_response_id`: the conversation of a stored response goes before `input`; responses
  are stored (`store`, default true) in memory, the last `STORED_RESPONSES` of them;
  `store: false` keeps none. `GET /v1/responses/{id}` returns a stored one.
- `stream`: server-sent events with vLLM's names and order (`response.created`,
  `response.in_progress`, per item `response.output_item.added`, `response.content_part.added`,
  the deltas, their `.done` events, `response.output_item.done`, then `response.completed`),
  each with `event:` and a `sequence_number`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations as objects.
import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import Field

from pipeline.serve.http.jobs import gather_generations, merged_deltas, plan_jobs, submit_jobs
from pipeline.serve.http.lenient import LenientModel
from pipeline.serve.http.openai_api import APIError, ChatBody
from pipeline.serve.http.responses import error_response

STORED_RESPONSES = 1024


class ResponsesBody(LenientModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    request_id: str | None = None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's form; a 400 naming `tools` for any other kind."""
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise APIError(
                    f"tools[{index}]: only function tools "
                    '({"type": "function", "name": ...}) are served',
                    param="tools",
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
        return tools or None

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        return self.tool_choice if self.tools else None

    def chat_body(self, history: list[dict[str, Any]]) -> ChatBody:
        """The chat body this request generates as: `history` (a stored conversation), then
        the instructions and the input as messages."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + input_messages(self.input)
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if self.text and (self.text.get("format") or {}).get("type", "text") != "text":
            raise APIError("text.format: only text output is served", param="text")
        fields = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "include_reasoning": self.include_reasoning,
            "chat_template_kwargs": kwargs or None,
            "reasoning_effort": effort,
            "stream": self.stream,
        }
        return ChatBody.model_validate({k: v for k, v in fields.items() if v is not None})


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise APIError(f"{where}: only text parts are served", param="input")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise APIError(f"{where}: content must be text or a list of text parts", param="input")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; a 400 naming the item that cannot be one."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}: role {role!r} is not served", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            raise APIError(f"{where}: items of type {kind!r} are not served", param="input")
    if not messages:
        raise APIError("input has no message", param="input")
    return messages


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ReplyItems:
    """One reply turned into output items, whole or as it streams, in vLLM's order: reasoning,
    the message's text (held back when tool calls may be read from it), then the calls."""

    def __init__(self, chat, body: ChatBody) -> None:
        self.reader = chat.reasoning() if chat.reasoning else None
        self.tools, self.hide = chat.tools, body.include_reasoning is False
        self.reasoning, self.content = "", ""
        self.reasoning_id, self.message_id = _id("rs"), _id("msg")
        self.events: list[dict] = []
        self.opened: str | None = None  # the item being streamed: "reasoning" or "message"
        self.index = 0  # output_index of the item being streamed

    def push(self, text: str, ids: list[int], stream: bool, last: bool = False) -> None:
        """A delta of the reply (its events too when `stream`); `last`: the reply ends here."""
        thinking, content = self.reader.push(text, ids) if self.reader else ("", text)
        if last and self.reader:
            content += self.reader.finish()
        thinking = "" if self.hide else thinking
        self.reasoning += thinking
        self.content += content
        if not stream:
            return
        if thinking:
            self._open("reasoning")
            self._part(
                "response.reasoning_text.delta",
                self.reasoning_id,
                delta=thinking,
            )
        if content and self.tools is None:
            self._open("message")
            self._part(
                "response.output_text.delta",
                self.message_id,
                delta=content,
                logprobs=[],
            )

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, **fields})

    def _part(self, kind: str, item_id: str, **fields) -> None:
        """An event of the first content part of the item being streamed."""
        self._event(kind, item_id=item_id, output_index=self.index, content_index=0, **fields)

    def _open(self, kind: str) -> None:
        if self.opened == kind:
            return
        self._close()
        self.opened = kind
        if kind == "reasoning":
            item = {"id": self.reasoning_id, "type": "reasoning", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
            item_id = self.reasoning_id
        else:
            item = _message_item(self.message_id, "", "in_progress")
            item["content"] = []
            part = _output_text("")
            item_id = self.message_id
        self._event("response.output_item.added", output_index=self.index, item=item)
        self._part(
            "response.content_part.added",
            item_id,
            part=part,
        )

    def _close(self) -> None:
        """The `.done` events of the item being streamed."""
        if self.opened == "reasoning":
            item = self._reasoning_item()
            part = item["content"][0]
            self._part(
                "response.reasoning_text.done",
                self.reasoning_id,
                text=part["text"],
            )
            self._done_part(self.reasoning_id, part, item)
        elif self.opened == "message":
            item = _message_item(self.message_id, self.content, "completed")
            part = item["content"][0]
            self._part(
                "response.output_text.done",
                self.message_id,
                text=self.content,
                logprobs=[],
            )
            self._done_part(self.message_id, part, item)
        if self.opened is not None:
            self.index += 1
        self.opened = None

    def _done_part(self, item_id: str, part: dict, item: dict) -> None:
        self._part(
            "response.content_part.done",
            item_id,
            part=part,
        )
        self._event("response.output_item.done", output_index=self.index, item=item)

    def _reasoning_item(self) -> dict:
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": self.reasoning}],
        }

    def items(self, finish_reason: str | None) -> list[dict]:
        """The output items of the whole reply."""
        output = [self._reasoning_item()] if self.reasoning else []
        content, calls = self.content, []
        if self.tools is not None:
            message, _ = self.tools.message(content, finish_reason)
            content = message.get("content") or ""
            calls = [
                {
                    "id": _id("fc"),
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
                for call in message.get("tool_calls", [])
            ]
        if content or not (calls or output):  # vLLM's: a message only with text, or alone
            output.append(_message_item(self.message_id, content, "completed"))
        return output + calls

    def finish(self, finish_reason: str | None) -> list[dict]:
        """The streamed reply's last events: the open item closed, then the items not streamed
        (the message read for tool calls, the calls) added and done."""
        self._close()
        output = self.items(finish_reason)
        for item in output[self.index :]:
            self._event("response.output_item.added", output_index=self.index, item=item)
            if item["type"] == "function_call":
                for kind, key in (("delta", "delta"), ("done", "arguments")):
                    extra = {"name": item["name"]} if kind == "done" else {}
                    self._event(
                        f"response.function_call_arguments.{kind}",
                        item_id=item["id"],
                        output_index=self.index,
                        **{key: item["arguments"]},
                        **extra,
                    )
            elif item["type"] == "message" and item["content"]:
                part = item["content"][0]
                self._part(
                    "response.content_part.added",
                    item["id"],
                    part=_output_text(""),
                )
                self._part(
                    "response.output_text.delta",
                    item["id"],
                    delta=part["text"],
                    logprobs=[],
                )
                self._part(
                    "response.output_text.done",
                    item["id"],
                    text=part["text"],
                    logprobs=[],
                )
                self._part(
                    "response.content_part.done",
                    item["id"],
                    part=part,
                )
            self._event("response.output_item.done", output_index=self.index, item=item)
            self.index += 1
        return output


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [_output_text(text)] if text else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


class ResponseStore:
    """The last `limit` stored responses and their conversations, by id."""

    def __init__(self, limit: int = STORED_RESPONSES) -> None:
        self.limit = limit
        self._responses: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._responses[response["id"]] = (response, conversation)
        while len(self._responses) > self.limit:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if response_id not in self._responses:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param)
        return self._responses[response_id]


def _conversation_after(messages: list[dict], output: list[dict]) -> list[dict]:
    """The messages a later response continues from: this one's (without its instructions) and
    its reply as an assistant message."""
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    reply: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        reply["tool_calls"] = calls
    return [*messages, reply]


def _response(body: ResponsesBody, ident: str, model: str, created: int, **state) -> dict:
    return {
        "id": ident,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": state.get("status", "in_progress"),
        "output": state.get("output", []),
        "usage": state.get("usage"),
        "incomplete_details": state.get("incomplete_details"),
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "metadata": body.metadata,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice,
        "tools": body.tools,
        "reasoning": body.reasoning,
        "store": body.store,
        "text": body.text or {"format": {"type": "text"}},
        "truncation": body.truncation,
        "background": False,
        "user": body.user,
    }


class ResponseRun:
    """One POST /v1/responses being answered: its id, the reply's output items and the response
    objects made of them, whole or as server-sent events; the finished response is stored in
    `store` when the body asks."""

    def __init__(self, body: ResponsesBody, chat, chat_body: ChatBody, model: str, store) -> None:
        self.body, self.chat, self.model, self.store = body, chat, model, store
        self.ident = f"resp_{body.request_id}" if body.request_id else _id("resp")
        self.created = int(time.time())
        messages = [m.model_dump(exclude_none=True) for m in chat_body.messages]
        self.messages = messages[1:] if body.instructions else messages  # no instructions
        self.reply = ReplyItems(chat, chat_body)
        self.streamed_output: list[dict] | None = None  # the streamed reply's items, at its end
        self.sequence = 0  # the next event's sequence_number

    def response(self, **state) -> dict:
        """The response object in `state` (status, output, usage...)."""
        return _response(self.body, self.ident, self.model, self.created, **state)

    def finished(self, finish_reason: str | None, completion_tokens: int, cached: int) -> dict:
        """The finished response (`incomplete` when the reply reached max_output_tokens),
        stored when the body asks."""
        body, reply = self.body, self.reply
        output = reply.items(finish_reason) if not body.stream else self.streamed_output
        incomplete = finish_reason == "length"
        response = self.response(
            status="incomplete" if incomplete else "completed",
            output=output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=_usage(len(self.chat.prompt), completion_tokens, cached, reply),
        )
        if body.store:
            self.store.put(response, _conversation_after(self.messages, output))
        return response

    async def whole(self, jobs, streams, is_disconnected):
        """The unstreamed answer: the finished response, or a 499 when the client left."""
        generations = await gather_generations(jobs, streams, is_disconnected)
        if generations is None:
            return error_response("client disconnected", 499)
        g = generations[0]
        self.reply.push(g.text, g.token_ids, stream=False, last=True)
        return self.finished(g.finish_reason, g.completion_tokens, g.cached_tokens)

    def sse(self, event: dict) -> str:
        """`event` as a server-sent event, numbered."""
        event = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def _pending_events(self):
        """The reply's events not yet sent, as server-sent events."""
        for event in self.reply.events:
            yield self.sse(event)
        self.reply.events.clear()

    async def events(self, streams):
        """The streamed answer's server-sent events, in vLLM's order."""
        start = self.response()
        yield self.sse({"type": "response.created", "response": start})
        yield self.sse({"type": "response.in_progress", "response": start})
        finish, tokens, cached = None, 0, 0
        async for _, delta in merged_deltas(streams):
            last = delta.finish_reason is not None
            self.reply.push(delta.text, delta.token_ids, stream=True, last=last)
            finish = delta.finish_reason or finish
            tokens, cached = delta.completion_tokens, delta.cached_tokens or cached
            for event in self._pending_events():
                yield event
        self.streamed_output = self.reply.finish(finish)
        for event in self._pending_events():
            yield event
        completed = self.finished(finish, tokens, cached)
        yield self.sse({"type": "response.completed", "response": completed})


def add_responses_routes(app: FastAPI, served, eos_ids: frozenset[int]) -> None:
    """Register POST /v1/responses and GET /v1/responses/{id} on `app` for `served` (the
    routes' `ServedModel`)."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(http: HTTPRequest, body: ResponsesBody):
        lora = served.check_model(body.model)
        history = []
        if body.previous_response_id:
            history = store.get(body.previous_response_id, "previous_response_id")[1]
        chat_body = body.chat_body(history)
        chat_body.check(served.codec.vocab_size)
        chat = served.chat_request(chat_body)
        jobs = plan_jobs(
            chat_body, [chat.prompt], served.token_budget, eos_ids, served.codec.encode
        )
        streams = submit_jobs(served.submitter(lora), jobs, "input")
        run = ResponseRun(body, chat, chat_body, lora or served.name, store)
        if not body.stream:
            return await run.whole(jobs, streams, http.is_disconnected)
        return StreamingResponse(run.events(streams), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return store.get(response_id)[0]


def _usage(prompt_tokens: int, completion_tokens: int, cached: int, reply: ReplyItems) -> dict:
    reasoning = reply.reader.reasoning_tokens if reply.reader else 0
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt_tokens + completion_tokens,
    }
