"""The endpoints of `pipe serve`, registered on its FastAPI application.

A generation route turns a body into prompt token ids and jobs (`pipeline.serve.http.jobs`), submits
them to the engine client and hands the streams to a response writer
(`pipeline.serve.http.responses`). Besides the OpenAI routes: vLLM's /tokenize, /detokenize,
/tokenizer_info and /version, its weight-transfer routes (`pipeline.serve.http.weight_routes`),
Prometheus' /metrics and /health.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations as objects.
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from pipeline import __version__
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.http.beam_search import beam_search
from pipeline.serve.http.codec import Codec
from pipeline.serve.http.engine_client import EngineClient
from pipeline.serve.http.jobs import Generation, plan_jobs, submit_jobs
from pipeline.serve.http.lora_routes import ServedAdapters, add_lora_routes
from pipeline.serve.http.metrics import ServeMetrics
from pipeline.serve.http.openai_api import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    completion_prompts,
)
from pipeline.serve.http.responses import ChatWriter, CompletionWriter, respond
from pipeline.serve.http.responses_api import add_responses_routes
from pipeline.serve.http.tokenizer_info import tokenizer_info
from pipeline.serve.http.tool_calls import ToolReply, ToolServing
from pipeline.serve.http.weight_control import WeightControl
from pipeline.serve.http.weight_routes import add_weight_routes
from pipeline.tokenizer.reasoning import ReasoningReader, ReasoningServing


@dataclass(frozen=True)
class ChatRequest:
    """What a chat body asks of the engine: its prompt's ids and text, how its reply's tool
    calls are read (None: plain text) and a maker of reasoning readers (None: no parser)."""

    prompt: list[int]
    text: str
    tools: ToolReply | None
    reasoning: Callable[[], ReasoningReader] | None


@dataclass
class ServedModel:
    """What the routes share: the engine client, the name the model is served under, its
    tokenizer (`codec`), the metrics, the tool options (`tools`), when the server started and
    its weights' version and pause state (`weights`)."""

    client: EngineClient
    name: str
    codec: Codec
    metrics: ServeMetrics
    tools: ToolServing = field(default_factory=ToolServing)
    reasoning: ReasoningServing | None = None  # --reasoning-parser
    started: int = field(default_factory=lambda: int(time.time()))
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)
    weights: WeightControl = field(init=False, repr=False)
    adapters: ServedAdapters = field(init=False, repr=False)  # LoRA adapters by name

    def __post_init__(self) -> None:
        self.weights = WeightControl(self.client)
        self.adapters = ServedAdapters(self.client)

    @classmethod
    def of(
        cls,
        client: EngineClient,
        name: str,
        tools: ToolServing | None = None,
        reasoning_parser: str | None = None,
    ) -> "ServedModel":
        """The model behind a started `client`, served as `name` (with `tools` options and the
        reasoning parser of that name); ValueError for a parser the tokenizer cannot serve."""
        ready = client.ready
        codec = Codec(
            client.tokenizer, client.chat_template, ready.vocab_size, ready.tokenizer_path
        )
        metrics = ServeMetrics(name, lambda: client.load)
        reasoning = None
        if reasoning_parser is not None:
            reasoning = ReasoningServing.of(reasoning_parser, codec.encode, codec.decode)
        return cls(client, name, codec, metrics, tools or ToolServing(), reasoning)

    @property
    def token_budget(self) -> int:
        """What max_tokens null may use: a request reserves its whole length in the cache."""
        ready = self.client.ready
        return min(ready.max_context, ready.cache_blocks * ready.block_size)

    def new_id(self, prefix: str) -> str:
        """A fresh response id, e.g. `cmpl-7`."""
        return f"{prefix}-{next(self._ids)}"

    def response_id(self, body, prefix: str) -> str:
        """The response's id: vLLM's `prefix-request_id` when the body names one, else fresh."""
        return f"{prefix}-{body.request_id}" if body.request_id else self.new_id(prefix)

    def truncated(self, body, prompt: list[int]) -> list[int]:
        """`prompt` cut as the body's `truncate_prompt_tokens` asks (-1: the context)."""
        return body.truncated(prompt, self.client.ready.max_context)

    def check_model(self, name: str | None) -> str | None:
        """The adapter `name` asks for (None: the base model); 404 unless `name` (when given)
        is the served model's or an adapter's."""
        if name is None or name == self.name:
            return None
        if name in self.adapters:
            return name
        raise APIError(f"The model `{name}` does not exist.", 404, "model")

    def submit(
        self, prompt: list[int], params: list[SamplingParams], lora_name: str | None = None
    ) -> list:
        """A group of engine requests on `prompt` (prefilled once, run with the adapter
        `lora_name` when given), each one's stream of deltas with its latencies recorded."""
        streams = self.client.submit_group(prompt, params, lora_name)
        return [self.metrics.track(s) for s in streams]

    def chat_request(self, body: ChatBody) -> "ChatRequest":
        """A checked chat body's prompt (rendered by the chat template with the body's tools and
        kwargs), how to read its reply's tool calls and a maker of reasoning readers."""
        tools = self.tools.reply(body)
        text = self.codec.chat(
            body.messages,
            body.add_generation_prompt is not False,
            continue_final=bool(body.continue_final_message),
            tools=body.tools,
            extra=body.template_kwargs(),
        )
        prompt = self.truncated(body, self.codec.encode(text, body.special_tokens_wanted))
        reader = None
        if self.reasoning is not None:
            kwargs, reasoning = body.template_kwargs(), self.reasoning
            reader = lambda: reasoning.reader(kwargs)  # noqa: E731 - one per choice
        return ChatRequest(prompt, text, tools, reader)

    def submitter(self, lora_name: str | None):
        """`submit` for the requests of one body, all with the adapter `lora_name`."""
        return lambda prompt, params: self.submit(prompt, params, lora_name)


def add_routes(app: FastAPI, served: ServedModel) -> None:
    """Register every endpoint of `pipe serve` on `app`."""
    _add_status_routes(app, served)
    _add_generation_routes(app, served)
    _add_token_routes(app, served)
    add_weight_routes(app, served.weights)
    add_lora_routes(app, served.adapters)


def _add_status_routes(app: FastAPI, served: ServedModel) -> None:
    client, metrics = served.client, served.metrics

    @app.get("/health")
    async def health():
        running, waiting = client.load
        finished = dict(client.finish_counts)
        if client.failure is not None:  # a load balancer must stop sending requests here
            body = {"status": "failed", "error": str(client.failure), "finished": finished}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "running": running, "waiting": waiting, "finished": finished}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        entry = {
            "id": served.name,
            "object": "model",
            "created": served.started,
            "owned_by": "pipe",
            "root": served.name,
            "max_model_len": client.ready.max_context,
            "weight_version": served.weights.version,
        }
        adapters = served.adapters.cards(served.name, served.started)
        return {"object": "list", "data": [entry, *adapters]}


@dataclass(frozen=True)
class GenerationAnswers:
    """How the generation routes answer a body once its prompts are known: its jobs planned and
    submitted (or its beams searched) and the replies written, whole or streamed."""

    served: ServedModel
    eos_ids: frozenset[int]

    async def answer(self, http, body, lora, prompts, writer, param: str, prefix: str):
        """Plan the body's jobs on `prompts`, submit them (a 400 names `param` where a prompt
        is refused) and answer through `writer`, whole or streamed, under an id of `prefix`."""
        served = self.served
        jobs = plan_jobs(body, prompts, served.token_budget, self.eos_ids, served.codec.encode)
        if body.use_beam_search:
            generations = await self.beam_generations(body, lora, prompts, jobs)
            answer = writer.whole(
                served.response_id(body, prefix), lora or served.name, generations
            )
            return {**answer, "system_fingerprint": served.weights.fingerprint}
        streams = submit_jobs(served.submitter(lora), jobs, param)
        return await respond(
            writer,
            served.response_id(body, prefix),
            lora or served.name,
            jobs,
            streams,
            body.stream,
            http.is_disconnected,
            served.weights.fingerprint,
        )

    async def beam_generations(self, body, lora, prompts, jobs) -> list[Generation]:
        """Each prompt's n beams (`pipeline.serve.http.beam_search`) as its jobs' generations."""
        for name, wrong in (("stream", body.stream), ("logprobs", body.logprobs)):
            if wrong:
                raise APIError(f"{name} is not served with use_beam_search", param=name)
        generations = []
        for index, prompt in enumerate(prompts):
            mine = [job for job in jobs if job.prompt_index == index]
            beams = await beam_search(
                self.served.submitter(lora),
                prompt,
                len(mine),
                mine[0].params.max_new_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                eos_ids=self.eos_ids,
                ignore_eos=bool(body.ignore_eos),
                length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                include_eos=bool(body.include_stop_str_in_output),
            )
            skip = body.skip_special_tokens is not False
            generations += [
                self._beam_generation(job, beam, skip) for job, beam in zip(mine, beams)
            ]
        return generations

    def _beam_generation(self, job, beam, skip: bool) -> Generation:
        """One beam as its job's generation, its text decoded as the body's
        `skip_special_tokens` asks."""
        shown = [t for t in beam.generated if t not in self.eos_ids or not skip]
        generation = Generation(job, list(beam.generated), finish_reason=beam.finish_reason)
        generation.text = self.served.codec.tokenizer.decode(shown, skip_special_tokens=skip)
        generation.completion_tokens = len(beam.generated)
        return generation


def _add_generation_routes(app: FastAPI, served: ServedModel) -> None:
    eos_ids = served.client.ready.eos_ids
    answers = GenerationAnswers(served, eos_ids)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        lora = served.check_model(body.model)
        body.check(served.codec.vocab_size)
        special = body.special_tokens_wanted
        prompts = [
            served.truncated(body, served.codec.prompt(p, special_tokens=special))
            for p in completion_prompts(body.prompt)
        ]
        writer = CompletionWriter(body, prompts, served.codec.token_text)
        return await answers.answer(http, body, lora, prompts, writer, "prompt", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        lora = served.check_model(body.model)
        body.check(served.codec.vocab_size)
        chat = served.chat_request(body)
        writer = ChatWriter(
            body, chat.prompt, served.codec.token_text, chat.tools, chat.text, chat.reasoning
        )
        return await answers.answer(http, body, lora, [chat.prompt], writer, "messages", "chatcmpl")

    add_responses_routes(app, served, eos_ids)


def _add_token_routes(app: FastAPI, served: ServedModel) -> None:
    codec = served.codec

    info: list[dict] = []  # /tokenizer_info's body, made on first request

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        served.check_model(body.model)
        body.check()
        if body.prompt is not None:
            text = body.prompt
        else:
            continue_final = bool(body.continue_final_message)
            add_generation_prompt = not continue_final and body.add_generation_prompt is not False
            text = codec.chat(
                body.messages,
                add_generation_prompt,
                continue_final=continue_final,
                tools=body.tools,
                extra=body.chat_template_kwargs,
            )
        tokens = codec.encode(text, body.special_tokens_wanted)
        strs = [codec.token_text(t) for t in tokens] if body.return_token_strs else None
        max_model_len = served.client.ready.max_context
        return {
            "count": len(tokens),
            "max_model_len": max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        if not info:
            path = served.client.ready.tokenizer_path
            info.append(tokenizer_info(path, codec.tokenizer, codec.template))
        return info[0]

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        served.check_model(body.model)
        codec.prompt(body.tokens, param="tokens")  # checks the ids
        return {"prompt": codec.decode(body.tokens)}
