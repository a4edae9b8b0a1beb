"""`pipe serve`'s options for adapters by name, spelled as vLLM spells them:

    pipe serve BASE --lora-modules a=out/adapter_a b=out/adapter_b --max-loras 2
    pipe serve BASE --enable-lora --allow-runtime-lora-updating   # POST /v1/load_lora_adapter

`--lora-modules` takes several entries after one flag, as vLLM's does (and the flag may be
repeated). click is the only import, so `--help` stays instant.
"""

from __future__ import annotations

from typing import Any

import click


class ManyValuesOption(click.Option):
    """An option that takes every following argument up to the next option (`--flag a b c`),
    like argparse's nargs="+"; repeated, the values add up. click has no such option, so its
    parser's handler of this option is wrapped to take the rest."""

    def add_to_parser(self, parser, ctx) -> None:
        super().add_to_parser(parser, ctx)
        parsed = next(parser._long_opt[name] for name in self.opts if name in parser._long_opt)
        store = parsed.process

        def take_rest(value: Any, state: Any) -> None:
            values = [value]
            while state.rargs and not state.rargs[0].startswith("-"):
                values.append(state.rargs.pop(0))
            store(tuple(values), state)

        parsed.process = take_rest

    def type_cast_value(self, ctx: click.Context, value: Any) -> Any:
        # every occurrence is a tuple of values: flatten them into one tuple of strings
        return tuple(str(v) for group in (value or ()) for v in group)


def lora_options(command):
    """The adapter options of `pipe serve` (module docstring)."""
    options = [
        click.option(
            "--lora-modules",
            cls=ManyValuesOption,
            multiple=True,
            metavar="NAME=DIR ...",
            help="LoRA adapters served by name (pipe --lora checkpoints or peft directories): "
            'name=DIR, or vLLM\'s JSON {"name": ..., "path": ...}; each is a model in '
            "/v1/models.",
        ),
        click.option(
            "--enable-lora",
            is_flag=True,
            help="Serve adapters by name (implied by --lora-modules).",
        ),
        click.option(
            "--max-loras",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Adapters resident at once (the least recently used idle one is evicted and "
            "read again from disk when asked for).",
        ),
        click.option(
            "--max-lora-rank",
            type=click.IntRange(min=1),
            default=16,
            show_default=True,
            help="The highest adapter rank accepted.",
        ),
        click.option(
            "--allow-runtime-lora-updating",
            is_flag=True,
            help="Accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, also honoured); implies --enable-lora.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def adapter_settings(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the `EngineSpec` fields of the adapter options, whether the load / unload routes work),
    popped from `options`; a one-line usage error for a bad `--lora-modules` entry."""
    from pipeline.serve.http.lora_routes import parse_lora_module, runtime_updating_allowed

    try:
        modules = tuple(parse_lora_module(text) for text in options.pop("lora_modules"))
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    names = [name for name, _ in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise click.BadParameter(f"--lora-modules names {repeated[0]!r} twice")
    runtime = runtime_updating_allowed(options.pop("allow_runtime_lora_updating"))
    enabled = options.pop("enable_lora") or bool(modules) or runtime
    max_loras, max_rank = options.pop("max_loras"), options.pop("max_lora_rank")
    fields = {
        "lora_modules": modules,
        "max_loras": max_loras if enabled else 0,
        "max_lora_rank": max_rank,
    }
    return fields, runtime
