"""Imports run one way: no module of llmtrain/ imports, at any level (function-level included), a module that
imports it back. The graph comes from parsing every module's import statements (nothing is imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmtrain"


def module_graph() -> dict[str, set[str]]:
    """{module: the llmtrain modules it imports}; a package is its __init__, `from pkg import mod` names mod."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    found.add(target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Modules that reach themselves through the graph."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen
    return sorted(m for m in graph if m in reach(m))


def test_llmtrain_imports_run_one_way():
    graph = module_graph()
    assert len(graph) > 20 and "llmtrain.models.hf" in graph["llmtrain.parallelize"]  # the parser sees imports
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


# FSDP's private attributes (FSDP2's state and param groups, its FSDPParam internals): read or written only
# by llmtrain/parallelize.py, where the Strategy owns weight access.
FSDP_PRIVATE = re.compile(r"\._(?:fsdp\w*|get_fsdp_state|auto_reshard_after_forward|sharded_param_data|"
                          r"init_extensions|module_info)\b")


def test_fsdp_private_attributes_only_in_parallelize():
    allowed = PACKAGE / "parallelize.py"
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
             for root in (PACKAGE, PACKAGE.parent / "recipes") for path in sorted(root.rglob("*.py"))
             if path != allowed for i, line in enumerate(path.read_text().splitlines(), 1)
             if FSDP_PRIVATE.search(line)]
    assert found == []
    assert FSDP_PRIVATE.search(allowed.read_text())  # the pattern finds what parallelize.py does use


def imported(node: ast.AST) -> set[str]:
    """The top-level module names an import statement names."""
    if isinstance(node, ast.Import):
        return {a.name.partition(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom) and not node.level:
        return {node.module.partition(".")[0]}
    return set()


def test_test_modules_import_helpers_not_each_other():
    """What tests share lives in tests/helpers; a test module importing another drags in its fixtures and its
    module-level set-up."""
    tests = PACKAGE.parent / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    found = [f"{path.relative_to(tests)}:{node.lineno}" for path in sorted(tests.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if imported(node) & names]
    assert found == []
