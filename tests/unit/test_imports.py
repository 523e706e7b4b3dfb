"""The import rules of lorad (STYLE.md 1 and 19), checked by reading the source with `ast`.

No module is imported: every `import` and `from ... import` anywhere in a file (module level,
inside functions, under TYPE_CHECKING) is resolved to the package's modules. The rules: no import
cycle; a kernel module imports no package module outside kernels/; the coordinator (daemon/)
imports no torch, triton or workers; protocol/ and config/ import neither process's package, nor
torch. The checker is also run on small synthetic packages, so that it is seen to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorad

# package-relative prefix -> what modules under it may not import (package-relative prefixes,
# or top-level names of outside packages)
FORBIDDEN = {
    "daemon": ("workers", "torch", "triton"),
    "protocol": ("daemon", "workers", "torch"),
    "config": ("daemon", "workers", "torch"),
}
KERNELS = "workers.kernels"


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its __init__)."""
    package = root.name
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest known module that `name` names or lies in (an attribute of a module)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(package modules that `module` imports, top-level names of the outside packages)."""
    package = module.split(".")[0]
    is_package = path.name == "__init__.py"
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from X import Y`: Y may be a submodule of X, or a name defined in X.
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            if _under(target, package):
                inside.add(_resolve(target, modules))
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or one importing itself
    (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_violations(root: Path) -> list[str]:
    """Every broken import rule in the package at `root`, one line each naming the modules."""
    package = root.name
    modules = module_files(root)
    graph, problems = {}, []
    for module, path in modules.items():
        inside, outside = imports_of(module, path, modules)
        graph[module] = inside
        if _under(module, f"{package}.{KERNELS}"):
            for target in sorted(inside):
                if not _under(target, f"{package}.{KERNELS}"):
                    problems.append(f"kernel {module} imports {target}, outside kernels/")
        for prefix, banned in FORBIDDEN.items():
            if not _under(module, f"{package}.{prefix}"):
                continue
            for name in banned:
                hits = sorted(t for t in inside if _under(t, f"{package}.{name}"))
                hits += [name] if name in outside else []
                problems += [f"{module} ({prefix}/) imports {hit}" for hit in hits]
    for component in _cycles(graph):
        problems.append("import cycle among " + ", ".join(component))
    return problems


def test_lorad_keeps_its_import_rules():
    root = Path(lorad.__file__).parent
    assert len(module_files(root)) > 50  # the walk found the package
    assert import_violations(root) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _package(tmp_path: Path, **extra: str) -> Path:
    """A synthetic package `pkg` that keeps every rule, plus `extra` files (a/b.py as a__b)."""
    files = {"__init__.py": "", "config/__init__.py": "", "config/model.py": "import json\n",
             "protocol/__init__.py": "", "protocol/messages.py": "from pkg.config import model\n",
             "daemon/__init__.py": "", "daemon/main.py": "from ..protocol import messages\n",
             "workers/__init__.py": "", "workers/layer.py": "import torch\n",
             "workers/kernels/__init__.py": "",
             "workers/kernels/k.py": "import triton\nfrom . import common\n",
             "workers/kernels/common.py": "import torch\n"}
    files.update({name.replace("__", "/") + ".py": text for name, text in extra.items()})
    return _write(tmp_path / "pkg", files)


def test_a_package_that_keeps_the_rules_passes(tmp_path):
    assert import_violations(_package(tmp_path)) == []


def test_a_cycle_is_named(tmp_path):
    # Through a function-level import and a relative one, as cycles hide in real code.
    root = _package(tmp_path, workers__a="def f():\n    from pkg.workers import b\n",
                    workers__b="from .a import f\n")
    assert import_violations(root) == ["import cycle among pkg.workers.a, pkg.workers.b"]


def test_a_kernel_importing_a_layer_is_named(tmp_path):
    root = _package(tmp_path, workers__kernels__k="from pkg.workers.layer import torch\n")
    assert import_violations(root) == [
        "kernel pkg.workers.kernels.k imports pkg.workers.layer, outside kernels/"]


def test_a_relative_import_out_of_kernels_is_named(tmp_path):
    root = _package(tmp_path, workers__kernels__k="from .. import layer\n")
    assert import_violations(root) == [
        "kernel pkg.workers.kernels.k imports pkg.workers.layer, outside kernels/"]


def test_the_coordinator_importing_torch_or_workers_is_named(tmp_path):
    root = _package(tmp_path, daemon__main="import torch.nn\nimport pkg.workers.layer\n")
    assert import_violations(root) == ["pkg.daemon.main (daemon/) imports pkg.workers.layer",
                                       "pkg.daemon.main (daemon/) imports torch"]


def test_config_or_protocol_importing_a_process_package_is_named(tmp_path):
    root = _package(tmp_path, config__model="from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from pkg.daemon import main\n",
                    protocol__messages="from pkg.workers.layer import x\nimport torch\n")
    assert import_violations(root) == [
        "pkg.config.model (config/) imports pkg.daemon.main",
        "pkg.protocol.messages (protocol/) imports pkg.workers.layer",
        "pkg.protocol.messages (protocol/) imports torch"]
