"""Build a `TrainConfig` from its layers: defaults < recipe TOML < `--set` < first-class flags.

The whole resolution, with the checkpoint `checkpoint.load` names read once and every check
(the objective's and the optimizer's included), is `pipeline.train.assembly.run_config`'s
`resolve_config`; this module reads no checkpoint.

The CLI keeps a small, fixed set of options (the "first-class flags" in `FLAG_TARGETS`); anything
else is reachable as `--set section.key=value`, type-checked against the schema in
`pipeline.train.config.schema`. Flags win over `--set` because they are the explicit, named way
to say the same thing; the CLI passes only flags the user actually typed (not click defaults).
"""

from __future__ import annotations

import ast
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.train.config.fields import field_types, literal_values
from pipeline.train.config.schema import SECTIONS, ConfigError, TrainConfig
from pipeline.train.config.toml_io import load as load_toml

__all__ = [
    "save_config_toml",
    "FLAG_TARGETS",
    "RECIPES_DIR",
    "apply_flags",
    "apply_set",
    "list_recipes",
    "load_recipe",
    "parse_set_value",
    "recipe_path",
    "recipe_tables",
]

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# CLI flag name (as the click parameter is called) -> the config field it sets.
FLAG_TARGETS: dict[str, str] = {
    "data": "data.blend",
    "iters": "training.iters",
    "seq_length": "data.seq_length",
    "micro_batch_size": "training.micro_batch_size",
    "global_batch_size": "training.global_batch_size",
    "lr": "optimizer.lr",
    "device": "training.device",
    "save": "checkpoint.save",
    "load": "checkpoint.load",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "dp": "parallel.dp",
    "fp8": "fp8.recipe",
    "lora": "lora.enabled",
    "lora_base": "lora.base",
}


def list_recipes() -> list[str]:
    """Names of the recipes shipped in `pipeline/train/recipes/`."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def recipe_path(name_or_path: str | Path) -> Path:
    """The TOML file for a shipped recipe name, or `name_or_path` itself when it is a file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"recipe file {path} not found")
        return path
    shipped = RECIPES_DIR / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise ConfigError(
            f"unknown recipe {str(name_or_path)!r}; shipped recipes: {', '.join(list_recipes())} "
            "(or pass a path to a .toml file)"
        )
    return shipped


def recipe_tables(name_or_path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The recipe's file and its parsed tables."""
    path = recipe_path(name_or_path)
    try:
        return path, load_toml(path)
    except ValueError as e:  # tomllib.TOMLDecodeError subclasses ValueError
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def save_config_toml(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg.to_toml()` to `path` atomically (a temporary file, then a rename): the run
    directory's `config.toml`, which `load_recipe` reads back to the same config."""
    from pipeline.common.atomic import write_text

    write_text(path, cfg.to_toml())


def load_recipe(name_or_path: str | Path) -> TrainConfig:
    """Defaults overlaid with a recipe: a shipped name or a TOML file (e.g. a run's config.toml)."""
    path, tables = recipe_tables(name_or_path)
    cfg = TrainConfig()
    cfg.update(tables, source=str(path))
    return cfg


def parse_set_value(raw: str, tp: Any) -> Any:
    """Turn the text after `=` into a Python value, guided by the field's annotation `tp`.

    Python literals are read with `ast.literal_eval` (never `eval`); `true`/`false`/`none` are also
    accepted in lower case. Text that is not a literal stays a string, and a string field keeps
    its raw text unless it was quoted, so `data.split=969,30,1` and
    `data.blend=0.7 out/a 0.3 out/b` need no quotes.
    """
    text = raw.strip()
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered and text not in ("True", "False", "None"):
        value: Any = lowered[text.lower()]
    else:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = text
    if (
        _accepts_str(tp)
        and not isinstance(value, str)
        and not (value is None and _accepts_none(tp))
    ):
        value = text
    return value


def apply_set(cfg: TrainConfig, assignment: str) -> None:
    """Apply one `--set section.key=value` to `cfg`, with errors that name the assignment."""
    source = f"--set {assignment}"
    dotted, sep, raw = assignment.partition("=")
    dotted = dotted.strip()
    section_name, dot, key = dotted.partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"{source}: expected section.key=value (e.g. training.iters=100)")
    if section_name not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section {section_name!r}; valid sections: {', '.join(SECTIONS)}"
        )
    hints = field_types(SECTIONS[section_name])
    if key not in hints:
        raise ConfigError(
            f"{source}: unknown key {key!r} in section [{section_name}]; "
            f"valid keys: {', '.join(hints)}"
        )
    cfg.set(dotted, parse_set_value(raw, hints[key]), source=source)


def apply_flags(cfg: TrainConfig, flags: Mapping[str, Any]) -> None:
    """Apply first-class CLI flags (`None` values mean "not given" and are skipped).

    Giving `data` also turns `data.mock` off: naming a blend on the command line means "train on
    this", whatever the recipe chose.
    """
    for name, value in flags.items():
        if value is None:
            continue
        if name not in FLAG_TARGETS:
            raise ConfigError(
                f"unknown first-class flag {name!r}; known flags: {', '.join(FLAG_TARGETS)}"
            )
        cfg.set(FLAG_TARGETS[name], value, source=f"--{name.replace('_', '-')}")
        if name == "data":
            cfg.data.mock = False


def _accepts_str(tp: Any) -> bool:
    if typing.get_origin(tp) is list:  # list[str] takes a list, not the raw text
        return False
    if any(isinstance(value, str) for value in literal_values(tp)):
        return True
    return tp is str or str in getattr(tp, "__args__", ())


def _accepts_none(tp: Any) -> bool:
    return type(None) in getattr(tp, "__args__", ())
