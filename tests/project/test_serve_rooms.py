"""serve's two rooms (docs/architecture.md): the engine room never imports the HTTP room, so
training and `pipe generate` run the engine without the server's dependencies; and `Engine`
stays a short class that delegates (queueing and admission to the scheduler, the prefix cache's
policy to its manager, prompt sharing to the groups module)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.builders import ROOT

ENGINE_ROOM = ROOT / "pipeline" / "serve" / "engine"
HTTP_ROOM = "pipeline.serve.http"
ENGINE_METHODS = 20
IMPORT_CALLS = {"import_module", "__import__"}


def _module_name(path: Path, root: Path) -> str:
    """`pipeline.serve.engine.core` for `root/pipeline/serve/engine/core.py`."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, root: Path) -> set[str]:
    """Every module `path` imports anywhere (inside functions too): absolute and relative
    imports, the names a `from package import name` takes, and `importlib.import_module` or
    `__import__` calls with a literal name."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in IMPORT_CALLS and isinstance(first, ast.Constant):
                found.add(str(first.value))
    return found


def _http_imports(room: Path, root: Path) -> list[str]:
    """`file imports module` for each module of the HTTP room imported under `room`."""
    wrong = []
    for path in sorted(room.rglob("*.py")):
        for module in sorted(_imported(path, root)):
            if module == HTTP_ROOM or module.startswith(HTTP_ROOM + "."):
                wrong.append(f"{path.relative_to(root)} imports {module}")
    return wrong


def _method_count(path: Path, class_name: str) -> int:
    """The `def`s in the body of `class_name` in `path`: methods, properties, static and class
    methods alike."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            defs = (ast.FunctionDef, ast.AsyncFunctionDef)
            return sum(isinstance(child, defs) for child in node.body)
    raise AssertionError(f"no class {class_name} in {path}")


def test_the_engine_room_imports_nothing_of_the_http_room() -> None:
    wrong = _http_imports(ENGINE_ROOM, ROOT)
    assert not wrong, "\n".join(wrong)


def test_the_engine_class_has_at_most_twenty_methods() -> None:
    count = _method_count(ENGINE_ROOM / "core.py", "Engine")
    assert count <= ENGINE_METHODS, f"Engine has {count} methods (at most {ENGINE_METHODS})"


def test_the_checks_catch_every_way_to_import_http_and_a_long_class(tmp_path: Path) -> None:
    """The rules above fail on a tree that breaks them (so they are not vacuous)."""
    room = tmp_path / "pipeline" / "serve" / "engine"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text("from ..http import routes\n")
    (room / "lazy.py").write_text(
        "def f():\n    from pipeline.serve.http.server import run_server\n    return run_server\n"
    )
    (room / "sibling.py").write_text("from pipeline.serve import http, engine\n")
    (room / "dotted.py").write_text("import pipeline.serve.http.jobs\nfrom . import kv_cache\n")
    (room / "dynamic.py").write_text(
        "import importlib\nimportlib.import_module('pipeline.serve.http.codec')\n"
    )
    (room / "clean.py").write_text("from .kv_cache import BlockKVCache\nhttp = 'pipeline'\n")
    assert _http_imports(room, tmp_path) == [
        "pipeline/serve/engine/__init__.py imports pipeline.serve.http",
        "pipeline/serve/engine/__init__.py imports pipeline.serve.http.routes",
        "pipeline/serve/engine/dotted.py imports pipeline.serve.http.jobs",
        "pipeline/serve/engine/dynamic.py imports pipeline.serve.http.codec",
        "pipeline/serve/engine/lazy.py imports pipeline.serve.http.server",
        "pipeline/serve/engine/lazy.py imports pipeline.serve.http.server.run_server",
        "pipeline/serve/engine/sibling.py imports pipeline.serve.http",
    ]
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(ENGINE_METHODS))
    prop = "    @property\n    def p(self):\n        return 1\n"
    nested = "    class Inner:\n        def x(self):\n            pass\n"
    (tmp_path / "long.py").write_text(f"class Engine:\n{body}{nested}\n")
    assert _method_count(tmp_path / "long.py", "Engine") == ENGINE_METHODS
    (tmp_path / "long.py").write_text(f"class Engine:\n{body}{prop}{nested}\n")
    assert _method_count(tmp_path / "long.py", "Engine") == ENGINE_METHODS + 1
