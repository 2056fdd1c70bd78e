"""The package's layers: each module imports only its own folder and the layers below it, and
no import, at module level or inside a function, closes a cycle (docs/architecture.md).

Static: the modules' import statements are read with ``ast``, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_guard"

#: lowest first: (layer, the dotted prefixes under raytrain_guard that belong to it)
LAYERS = (
    ("base", ("errors", "units", "config", "factories", "log")),
    ("planner", ("planner",)),
    ("core", ("core",)),
    ("coordination", ("coordination",)),
    ("runtime host", ("runtime", "runtime.host_memory")),
    ("runtime parts", ("runtime.guard", "runtime.data", "runtime.dist")),
    ("runtime loops", ("runtime.loop", "runtime.dropin")),
    ("cluster", ("cluster",)),
    ("experiment", ("experiment",)),
    ("top", ("train", "cli", "integrations", "__init__")),
)
#: layers whose folders are one unit: any of its modules may import any other
OPEN_LAYERS = {"base", "cluster", "top"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _place(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it) of a raytrain_guard module."""
    short = module[len("raytrain_guard."):] if module != "raytrain_guard" else "__init__"
    best: tuple[int, str] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (short == prefix or short.startswith(prefix + ".")) and (
                    best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (tests/test_layers.py)")
    return best


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported raytrain_guard module, inside a function) of one file."""
    tree = ast.parse(path.read_text())
    inner_lines = {n.lineno for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("raytrain_guard"):
            targets = [node.module]
            if node.module == "raytrain_guard":       # from raytrain_guard import x
                targets = [f"raytrain_guard.{a.name}" for a in node.names]
            elif _is_package(node.module):             # from raytrain_guard.pkg import module
                targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                           else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("raytrain_guard")]
        else:
            continue
        out.extend((node.lineno, t, node.lineno in inner_lines) for t in targets)
    return out


def _path_of(module: str) -> Path:
    return PACKAGE.parent.joinpath(*module.split("."))


def _is_package(module: str) -> bool:
    return (_path_of(module) / "__init__.py").exists()


def _is_module(module: str) -> bool:
    return _path_of(module).with_suffix(".py").exists() or _is_package(module)


FILES = sorted(PACKAGE.rglob("*.py"))
EDGES = [(_module(f), line, target, inner) for f in FILES for line, target, inner in _imports(f)]


def test_every_module_has_a_layer():
    for f in FILES:
        _place(_module(f))


def _breaks_layering(module: str, target: str) -> str | None:
    (mine, my_prefix), (theirs, their_prefix) = _place(module), _place(target)
    layer = LAYERS[mine][0]
    if theirs > mine:
        return f"imports the higher layer {LAYERS[theirs][0]!r}"
    if theirs == mine and my_prefix != their_prefix and layer not in OPEN_LAYERS:
        return f"imports {their_prefix!r}, another folder of its layer {layer!r}"
    return None


def test_each_module_imports_only_its_folder_and_lower_layers():
    broken = [f"{module}:{line} -> {target}: {why}"
              for module, line, target, _ in EDGES
              if (why := _breaks_layering(module, target)) is not None]
    assert not broken, "\n".join(broken)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges``, or None."""
    state: dict[str, int] = {}                 # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


@pytest.mark.parametrize("with_inner", [False, True], ids=["module level", "with function level"])
def test_no_import_cycle(with_inner):
    # "with function level": an import inside a function must not hide a cycle either
    edges: dict[str, set[str]] = {}
    for module, _, target, inner in EDGES:
        if target != module and (with_inner or not inner):
            edges.setdefault(module, set()).add(target)
    cycle = _cycle(edges)
    assert cycle is None, " -> ".join(cycle or ())


def test_the_checks_catch_what_they_guard():
    # the rule itself: an upward import and a cycle are found
    assert _breaks_layering("raytrain_guard.runtime.loop.steps", "raytrain_guard.experiment.card")
    assert _breaks_layering("raytrain_guard.runtime.data.loader", "raytrain_guard.runtime.guard.x")
    assert _breaks_layering("raytrain_guard.core.gate", "raytrain_guard.planner.plan") is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
