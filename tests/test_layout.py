"""The package's layout: folders by job, each importing only its own folder and the folders below it, the compute core
importing no loader, no import loop. Read from the source (every import statement, at module level or inside a
function), so a new module or folder is covered as soon as it exists."""

from __future__ import annotations

import ast
from pathlib import Path

import llama_jax

ROOT = Path(llama_jax.__file__).parent
# the units of the package, lowest first: a folder, or a module at the package's root; a unit may import its own
# modules and any unit of a lower rank, never one of its own rank or above
LAYERS: list[set[str]] = [
    {"errors", "version"},
    {"text", "runtime"},
    {"core"},
    {"kernels"},
    {"nn"},
    {"passes"},
    {"loaders"},
    {"model"},
    {"lens"},  # TransformerLens' names, which the activation store (research) takes too
    {"research", "lm_eval", "serve", "testing"},
    {"cli"},
    {"__init__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
CORE = {
    "core",
    "kernels",
    "nn",
    "passes",
    "runtime",
    "text",
    "errors",
    "version",
}  # the compute core and what it stands on


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name below llama_jax ("passes.forward", "passes" for its __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return out


MODULES = modules()


def unit(module: str) -> str:
    return module.split(".")[0]


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports (static imports anywhere in it; `from pkg import name` counts
    the submodule pkg.name where one exists, else pkg)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llama_jax":
            base = node.module.removeprefix("llama_jax").lstrip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}".lstrip(".")
                found.add(name if name in MODULES else base or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("llama_jax").lstrip(".") or "__init__" for a in node.names
                      if a.name.split(".")[0] == "llama_jax"}  # fmt: skip
    return {m for m in found if m in MODULES and m != module}


def test_every_module_sits_in_a_ranked_folder():
    """A new folder or root module gets a place in the layering before it lands."""
    assert {unit(m) for m in MODULES} <= set(RANK), sorted({unit(m) for m in MODULES} - set(RANK))


def test_nothing_imports_upward():
    """A folder's modules import only their own folder and the folders below it."""
    upward = [
        f"{m} imports {i}" for m in MODULES for i in imports(m) if unit(i) != unit(m) and RANK[unit(i)] >= RANK[unit(m)]
    ]
    assert upward == []


def test_the_import_graph_has_no_loops():
    """No module reaches itself through the imports (within a folder too)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    loops = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for i in sorted(imports(m)):
            if state.get(i) == 1:
                loops.append(" -> ".join([*path[path.index(i) :], i]))
            elif i not in state:
                visit(i, [*path, i])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert loops == []


def test_the_compute_core_imports_no_file_loader():
    """nn, passes, kernels and what they stand on import nothing that reads checkpoint files (static imports,
    transitively)."""
    start = [m for m in MODULES if unit(m) in CORE]
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports(module)
    assert {"passes.forward", "nn.block", "core.weights", "kernels.library"} <= seen
    assert {unit(m) for m in seen} <= CORE, sorted(m for m in seen if unit(m) not in CORE)
