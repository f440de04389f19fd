"""The package's import structure: no module-level import cycle, `swarmkv.kv` without torch, the models without
triton. Read from this checkout's sources with `ast`, so no swarmkv module is imported to build the graph."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "swarmkv"


def _module_files(src: Path = SRC) -> dict[str, Path]:
    """Every module of the packages under `src` by dotted name (a package by its `__init__.py`)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(body: list[ast.stmt], in_functions: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported (and, with `in_functions`, those that run when its
    functions are called); never those under TYPE_CHECKING."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_statements(node.orelse, in_functions)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or in_functions:
            for block in _blocks(node):
                yield from _import_statements(block, in_functions)


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a statement: if, try, with, loop, match, class and function bodies."""
    blocks = [getattr(node, field, []) for field in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return [block for block in blocks if isinstance(block, list)]


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, files: dict[str, Path]
) -> list[str]:
    """The dotted names one import statement names: `import a.b` names a.b; `from a import b` names a, and a.b
    too when b is a submodule; relative imports resolved against the importing module's package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = (module if is_package else module.rpartition(".")[0]).split(".")
        base = ".".join(package[: len(package) - node.level + 1])
        target = f"{base}.{node.module}" if node.module else base
    else:
        assert node.module is not None
        target = node.module
    return [target, *(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files)]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(src: Path = SRC, in_functions: bool = False) -> dict[str, set[str]]:
    """module -> the package modules its import runs: each name an import-time statement names, and the parent
    packages Python runs before it. Parents of the importing module itself are left out (Python has run them
    before it anyway, so a package's `__init__` importing its own submodules is no cycle) unless named outright.
    `in_functions` adds the imports inside functions, which run when they are called."""
    files = _module_files(src)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for node in _import_statements(ast.parse(path.read_text(), str(path)).body, in_functions):
            for target in _targets(node, module, path.name == "__init__.py", files):
                edges.update(a for a in _ancestors(target) if a not in _ancestors(module))
                edges.add(target)
        graph[module] = {name for name in edges if name in files and name != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component that has one, by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first member, by breadth-first search inside it."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def _describe(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_graph_sees_imports_of_every_form(tmp_path: Path) -> None:
    src = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import thing\n",  # a package importing its own submodule
            "pkg/sub/__init__.py": "",
            "pkg/sub/thing.py": "from .. import other\nfrom ..deep.leaf import x\n",
            "pkg/other.py": "import pkg.deep.leaf\ntry:\n    import pkg.guarded\nexcept ImportError:\n    pass\n",
            "pkg/guarded.py": "",
            "pkg/deep/__init__.py": "",
            "pkg/deep/leaf.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import other\n"
                "def later():\n    from pkg.sub import thing\n"
            ),
        },
    )
    assert import_graph(src) == {
        "pkg": {"pkg.sub", "pkg.sub.thing"},
        "pkg.sub": set(),
        "pkg.sub.thing": {"pkg", "pkg.other", "pkg.deep", "pkg.deep.leaf"},  # relative, submodule, parents
        "pkg.other": {"pkg.deep", "pkg.deep.leaf", "pkg.guarded"},  # not its own parent pkg
        "pkg.guarded": set(),
        "pkg.deep": set(),
        "pkg.deep.leaf": set(),  # TYPE_CHECKING and function bodies excluded
    }
    assert import_graph(src, in_functions=True)["pkg.deep.leaf"] == {"pkg.sub", "pkg.sub.thing"}
    # pkg.sub.thing names pkg outright (`from .. import other`), so pkg <-> pkg.sub.thing is a cycle.
    assert find_cycles(import_graph(src)) == [["pkg", "pkg.sub.thing", "pkg"]]


def test_find_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, f"module-level import cycles:\n{_describe(cycles)}"


def test_no_cycle_through_models_or_kernels_even_in_functions() -> None:
    """A function-local import only hides a cycle: models/ import a kernel on a GPU path, kernels/ never models/."""
    cycles = [
        cycle
        for cycle in find_cycles(import_graph(in_functions=True))
        if any(m.startswith((f"{PACKAGE}.models", f"{PACKAGE}.kernels")) for m in cycle)
    ]
    assert not cycles, f"import cycles:\n{_describe(cycles)}"


def test_kernels_import_nothing_from_models() -> None:
    """kernels/ sits below models/, in function bodies too: a kernel's torch reference is in kernels/reference.py."""
    files = _module_files()
    for module, path in files.items():
        if not module.startswith(f"{PACKAGE}.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets = _targets(node, module, path.name == "__init__.py", files)
                assert not any(t.startswith(f"{PACKAGE}.models") for t in targets), (
                    f"{module} imports {targets}"
                )


def test_no_import_cycle_even_in_functions() -> None:
    cycles = find_cycles(import_graph(in_functions=True))
    assert not cycles, f"import cycles, function-local imports included:\n{_describe(cycles)}"


def _imports_in_a_fresh_interpreter(code: str) -> subprocess.CompletedProcess[str]:
    path = [str(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_kv_imports_no_torch() -> None:
    result = _imports_in_a_fresh_interpreter("import sys, swarmkv.kv; assert 'torch' not in sys.modules")
    assert result.returncode == 0, result.stderr


def test_the_engine_core_imports_no_torch() -> None:
    """The bookkeeping the planner, lint and the router drive runs without tensors."""
    code = (
        "import sys, swarmkv.core.core, swarmkv.lint.replay, swarmkv.cluster.routing, swarmkv.cluster.simulate\n"
        "assert 'torch' not in sys.modules"
    )
    result = _imports_in_a_fresh_interpreter(code)
    assert result.returncode == 0, result.stderr


def test_models_import_no_triton() -> None:
    """Every module of swarmkv.models, and the LLM entry point, load without triton: Triton kernels load on a GPU
    path (the CPU's C kernel for GGUF blocks, `cpu_grouped`, and the huge-page packing of CPU weights need none)."""
    code = (
        "import importlib, pkgutil, sys, swarmkv, swarmkv.models\n"
        "for m in pkgutil.iter_modules(swarmkv.models.__path__):\n"
        "    importlib.import_module('swarmkv.models.' + m.name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'swarmkv.kernels.')))\n"
        "assert loaded == ['swarmkv.kernels.cpu_grouped', 'swarmkv.kernels.huge_pages', 'swarmkv.kernels.reference'], loaded\n"
    )
    result = _imports_in_a_fresh_interpreter(code)
    assert result.returncode == 0, result.stderr
