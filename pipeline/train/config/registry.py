"""The shape both of training's registries share (`pipeline.train.objectives.OBJECTIVES`, found by
`data.kind`, and `pipeline.train.optimizers.OPTIMIZERS`, found by `optimizer.name`): specs by
name, each added once, and a look-up whose unknown name is one `ConfigError` line naming the
config field and the known names. Torch-free, as the registries are."""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from pipeline.train.config.fields import ConfigError

__all__ = ["Registry"]

Spec = TypeVar("Spec")


def call_target(target: str, *args: Any, **kwargs: Any) -> Any:
    """Import "module:function" (or "module:Class") now and call it with the arguments given:
    a registry names what it needs as text, so it stays torch-free."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


class Registry(dict[str, Spec]):
    """Specs by name, one config field choosing among them (`field`); `unknown` formats the
    error for a name none has (`{field}`, `{name}` and `{known}` filled in)."""

    def __init__(self, field: str, unknown: str) -> None:
        super().__init__()
        self.field, self.unknown = field, unknown

    def add(self, name: str, spec: Spec) -> Spec:
        """Add `spec` under `name`; a name taken already is a programming error (ValueError)."""
        if name in self:
            raise ValueError(f"{self.field} {name!r} is registered already")
        self[name] = spec
        return spec

    def spec(self, name: str) -> Spec:
        """The spec called `name`; an unknown name is a one-line `ConfigError`."""
        try:
            return self[name]
        except KeyError:
            known = ", ".join(self)
            message = self.unknown.format(field=self.field, name=repr(name), known=known)
            raise ConfigError(message) from None
