"""`pipe generate` and `pipe serve`: text from a checkpoint, at the terminal or over HTTP.

    pipe generate CKPT --prompt "Once upon a time" [--max-new-tokens 64] [--greedy]
    pipe serve CKPT --port 8000           (OpenAI-compatible: /v1/completions, /v1/chat/completions)
    pipe generate CKPT --prompt "..." --nproc-per-node 2   (heads split over 2 processes)
    pipe generate CKPT --chat --prompt "Hi" [--system "Be brief."]   (through the chat template)

CKPT is a pipe checkpoint (a save directory or one `iter_*`, any parallel layout) or a Hugging
Face model directory. click is the only import at module level, so `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import click

from pipeline.core.parallel.process_group import (
    destroy_process_group,
    launched_by_torchrun,
    relaunch_under_torchrun,
)
from pipeline.serve.http.lora_options import adapter_settings, lora_options

DTYPES = ("auto", "fp32", "bf16")
# pipeline.serve.http.tool_parsers' formats
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "pythonic")
# pipeline.tokenizer.reasoning's formats
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45", "mistral", "openai_gptoss", "gpt_oss")


def model_options(command):
    """The options generate, serve and eval share: where the model and its tokenizer come from.
    CHECKPOINT stays the text given: served, it is the model's name (as vLLM names it)."""
    options = [
        click.argument("checkpoint", type=click.Path(exists=True)),
        click.option(
            "--tokenizer",
            type=click.Path(exists=True, path_type=Path),
            help="Tokenizer directory or file (default: the one recorded with the checkpoint, "
            "or the Hugging Face directory's own).",
        ),
        click.option(
            "--lora-adapter",
            type=click.Path(exists=True, path_type=Path),
            help="LoRA adapters (a pipe --lora checkpoint or a peft directory) run beside the "
            "base weights, unmerged.",
        ),
        click.option("--device", default="auto", help="cpu, cuda, cuda:N or auto."),
        click.option(
            "--dtype",
            type=click.Choice(DTYPES),
            default="auto",
            help="auto: bf16 on a GPU, fp32 on a CPU.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def open_for_generation(
    checkpoint: str, tokenizer: Path | None, device: str, dtype: str, lora_adapter: Path | None
):
    """The loaded `Generator` (split over torchrun's ranks when launched by it), or a one-line
    click error."""
    import torch

    from pipeline.core.parallel.process_group import launched_world_size, rank_device
    from pipeline.serve.engine.loading import LoadError, open_generator
    from pipeline.serve.engine.tensor_parallel import tensor_parallel_mesh

    chosen = _device(device)
    torch_dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    split = launched_world_size() > 1
    device = rank_device(chosen) if split else chosen
    mesh = tensor_parallel_mesh(device) if split else None
    try:
        return open_generator(
            checkpoint,
            tokenizer=tokenizer,
            device=device,
            dtype=torch_dtype,
            tp_mesh=mesh,
            lora_adapter=lora_adapter,
        )
    except LoadError as error:
        raise click.ClickException(str(error)) from None


def _device(device: str):
    """The torch device `--device` names, or a one-line click error."""
    from pipeline.core.parallel.process_group import NoCudaDevice, choose_device

    try:
        return choose_device(device)
    except NoCudaDevice:
        raise click.ClickException("--device cuda: no CUDA GPU is available here") from None
    except RuntimeError:
        raise click.BadParameter(f"--device {device!r}: use cpu, cuda, cuda:N or auto") from None


_DTYPE_NAMES = {"auto": None, "fp32": "fp32", "bf16": "bf16"}


def cuda_graph_options(command):
    """`--cuda-graphs/--no-cuda-graphs` and vLLM's `--enforce-eager` (no graphs), for every
    command that builds an engine (`cuda_graphs_choice` reads them)."""
    options = [
        click.option(
            "--cuda-graphs/--no-cuda-graphs",
            default=None,
            help="Replay each decode step from a CUDA graph captured per batch size "
            "(default: on a CUDA device; MoE and tensor-parallel models decode eagerly).",
        ),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (vLLM's flag)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def cuda_graphs_choice(options: dict[str, Any]) -> bool | None:
    """The engine's `cuda_graphs` from `cuda_graph_options`, popped from `options` (None: the
    device decides)."""
    graphs, eager = options.pop("cuda_graphs"), options.pop("enforce_eager")
    if eager and graphs:
        raise click.UsageError("--enforce-eager and --cuda-graphs ask for opposite things")
    return False if eager else graphs


@click.command()
@model_options
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option(
    "--prompt-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A file whose whole text is one more prompt.",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, help="Keep the k most likely tokens (0: all).")
@click.option("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1: all).")
@click.option("--seed", type=int, default=None, help="Sampling seed (same seed, same text).")
@click.option("--greedy", is_flag=True, help="Always take the most likely token.")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option(
    "--chat",
    is_flag=True,
    help="Each prompt is a user message, rendered with the tokenizer's chat template (as "
    "pipe serve's /v1/chat/completions renders it); only the reply is printed.",
)
@click.option("--system", metavar="TEXT", help="With --chat: a system message first.")
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Split the model's heads over this many processes (tensor parallel, under torchrun).",
)
@cuda_graph_options
def generate(
    checkpoint: str,
    prompts: tuple[str, ...],
    prompt_file: Path | None,
    chat: bool,
    system: str | None,
    **options: Any,
) -> None:
    """Continue PROMPT(s) with the model in CHECKPOINT, streaming the text as it comes (with
    --chat: answer them as user messages)."""
    prompts = list(prompts)
    if prompt_file is not None:
        prompts.append(prompt_file.read_text(encoding="utf-8"))
    if not prompts:
        raise click.UsageError("give a --prompt or a --prompt-file")
    if system is not None and not chat:
        raise click.UsageError("--system is for --chat")
    params = _sampling(options)
    cuda_graphs = cuda_graphs_choice(options)
    nproc_per_node = options.pop("nproc_per_node")
    if nproc_per_node > 1 and not launched_by_torchrun():
        relaunch_under_torchrun(nproc_per_node, "generate")
    gen = open_for_generation(
        checkpoint,
        options["tokenizer"],
        options["device"],
        options["dtype"],
        options["lora_adapter"],
    )
    if gen.tokenizer is None:
        raise click.ClickException(
            f"{checkpoint}: no tokenizer recorded or found beside it; pass --tokenizer DIR"
        )
    from pipeline.serve.generate_run import run_generation

    shown = prompts
    if chat:
        prompts, shown = _chat_prompts(gen, checkpoint, prompts, system), [""] * len(prompts)
    echo = click.echo if os.environ.get("RANK", "0") == "0" else _silent
    try:
        run_generation(gen, prompts, params, echo=echo, shown=shown, cuda_graphs=cuda_graphs)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    finally:
        destroy_process_group()


def _chat_prompts(gen: Any, checkpoint: str, prompts: list[str], system: str | None) -> list:
    """Each prompt as a user message (after `system`, when given) rendered by the chat template
    with the assistant's turn opened; a one-line error without a template or when it fails."""
    from pipeline.tokenizer.chat_template import ChatTemplateError, chat_prompt

    if gen.chat_template is None:
        raise click.ClickException(
            f"--chat: the tokenizer of {checkpoint} ({gen.tokenizer_path}) has no chat template"
        )
    head = [] if system is None else [{"role": "system", "content": system}]
    try:
        return [
            chat_prompt([*head, {"role": "user", "content": prompt}], gen.chat_template)
            for prompt in prompts
        ]
    except ChatTemplateError as error:
        raise click.ClickException(f"--chat: the chat template failed: {error}") from None


def _silent(*_args: Any, **_kwargs: Any) -> None:
    """The other ranks' echo: only the first rank writes the text."""


def _sampling(options: dict[str, Any]):
    from pipeline.serve.engine.sampling import BadSamplingValue, SamplingParams

    try:
        return SamplingParams(
            max_new_tokens=options["max_new_tokens"],
            temperature=options["temperature"],
            top_k=options["top_k"],
            top_p=options["top_p"],
            seed=options["seed"],
            greedy=options["greedy"],
            stop=tuple(options["stop"]),
        )
    except BadSamplingValue as error:
        raise click.BadParameter(str(error)) from None


def engine_options(command):
    """The options of the engine behind an HTTP server (serve and eval): batch, cache, threads,
    CUDA graphs."""
    command = cuda_graph_options(command)
    options = [
        click.option(
            "--max-batch",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Requests at once; 0: as many as the KV cache holds (up to 256).",
        ),
        click.option(
            "--kv-cache-mb",
            type=click.IntRange(min=1),
            default=256,
            show_default=True,
            help="Memory for the KV cache, in MB (how many tokens all requests together may hold).",
        ),
        click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True),
        click.option(
            "--prefill-chunk",
            type=click.IntRange(min=1),
            default=2048,
            show_default=True,
            help="Prompt tokens per engine step (longer prompts are split over steps).",
        ),
        click.option(
            "--engine-threads",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="CPU threads of the engine process; 0: every core but one (that one left to "
            "the HTTP server, as vLLM's CPU build does).",
        ),
        click.option(
            "--prefix-cache/--no-prefix-cache",
            default=True,
            show_default=True,
            help="Keep full KV blocks after their request and reuse them for prompts that begin "
            "alike.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def engine_spec(checkpoint: str, options: dict[str, Any]):
    """The `EngineSpec` of `model_options` and `engine_options`, popped from `options`."""
    from pipeline.serve.engine.process import EngineSpec

    tokenizer, adapter = options.pop("tokenizer"), options.pop("lora_adapter")
    return EngineSpec(
        checkpoint=checkpoint,
        tokenizer=None if tokenizer is None else str(tokenizer),
        device=str(_device(options.pop("device"))),
        dtype=_DTYPE_NAMES[options.pop("dtype")],
        kv_cache_bytes=options.pop("kv_cache_mb") * 2**20,
        block_size=options.pop("block_size"),
        max_batch=options.pop("max_batch"),
        prefill_chunk=options.pop("prefill_chunk"),
        threads=options.pop("engine_threads"),
        prefix_caching=options.pop("prefix_cache"),
        lora_adapter=None if adapter is None else str(adapter),
        cuda_graphs=cuda_graphs_choice(options),
    )


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@engine_options
@click.option(
    "--max-waiting",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests in flight beyond the batch after which new ones get 503 + Retry-After.",
)
@click.option(
    "--model-name",
    "--served-model-name",
    "model_name",
    default=None,
    help="The model's name in /v1/models and the answers (default: CHECKPOINT as given).",
)
@lora_options
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default=None,
    help="How the model writes tool calls (vLLM's names): llama3_json (Llama 3.x JSON), hermes "
    "(Hermes/Qwen <tool_call> tags), pythonic ([f(x=1)]).",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Serve tool_choice "auto" (the default when a request has tools): the reply is read '
    "for calls by --tool-call-parser.",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(REASONING_PARSERS),
    default=None,
    help="How the model marks its thinking (vLLM's names): qwen3, deepseek_r1, glm45 "
    "(<think>...</think>), mistral ([THINK]...[/THINK]), openai_gptoss (alias gpt_oss: "
    "gpt-oss's harmony analysis/final channels). The reply's `reasoning` and "
    "`reasoning_content` hold it apart from `content`.",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="One line per HTTP request on stderr (client, method, path, status).",
)
def serve(checkpoint: str, **options: Any) -> None:
    """Serve CHECKPOINT over an OpenAI-compatible HTTP API (FastAPI + uvicorn); the model runs
    in a process of its own."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise click.ClickException("pipe serve needs: pip install 'pipe-llm[serve]'") from None
    from pipeline.serve.engine.loading import LoadError
    from pipeline.serve.http.server import run_server
    from pipeline.serve.http.startup import adapter_hint
    from pipeline.serve.http.tool_calls import ToolServing

    hint = adapter_hint(checkpoint)
    if hint is not None:
        raise click.ClickException(hint)
    try:
        options["tools"] = ToolServing(
            options.pop("tool_call_parser"), options.pop("enable_auto_tool_choice")
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    adapters, runtime_lora = adapter_settings(options)
    spec = dataclasses.replace(engine_spec(checkpoint, options), **adapters)
    options["model_name"] = options["model_name"] or checkpoint
    try:
        run_server(spec, runtime_lora=runtime_lora, **options)
    except (LoadError, ValueError) as error:
        raise click.ClickException(str(error)) from None
