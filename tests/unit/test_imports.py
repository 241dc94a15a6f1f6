"""The house's import rules (docs/design.md), checked by a walk over every import of every module, lazy ones
(inside functions) included: no import runs from a lower layer to a higher one, no strategy imports another or a
model, and no two modules import each other, directly or round a circle."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import paratrain

STRATEGIES = ("data_parallel", "sharding", "tensor_parallel", "expert_parallel", "pipeline", "context_parallel",
              "param_server", "memory")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "names", "rng", "eager"),
    ("nn",),
    ("models",),
    ("topology", "comm", "data", "state_layout", "optim"),
    STRATEGIES,
    ("hybrid",),
    ("checkpoint",),
    ("hf",),
    ("train", "plot"),
    ("planner",),
    ("launch",),
    ("fit",),
    ("scaling",),
    ("cli", "__init__", "__main__"),
)
"""Rooms of paratrain, lowest first: a room imports its own layer and the ones below."""
LAYER = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}
ROOT = Path(paratrain.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.lru_cache(maxsize=1)
def _imports() -> dict[str, set[str]]:
    """module -> the paratrain modules it imports (anywhere in it, `from a import b` counted as a.b when b is one)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            out[module] |= {name for name in names if name.startswith("paratrain") and name in modules}
    return out


def test_every_room_has_a_layer():
    rooms = {_room(_module(p)) for p in ROOT.rglob("*.py")}
    assert rooms <= set(LAYER), f"rooms without a layer in this test and docs/design.md: {sorted(rooms - set(LAYER))}"


def test_no_import_runs_up_and_no_strategy_imports_another_or_a_model():
    wrong = []
    for module, targets in _imports().items():
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other == room:
                continue
            if LAYER[other] > LAYER[room]:
                wrong.append(f"{module} -> {target} (layer {LAYER[room]} imports layer {LAYER[other]})")
            elif room in STRATEGIES and (other in STRATEGIES or other == "models"):
                wrong.append(f"{module} -> {target} (a strategy imports {'a model' if other == 'models' else 'another'})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"
