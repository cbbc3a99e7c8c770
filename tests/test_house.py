"""The house's rules that code can check (../shared/STYLE.md): an import of bulkgen's own inside a function says
why (an optional dependency kept out, a cycle avoided), on its line or on the line above its group of imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bulkgen"


def unexplained_deferred_imports(source: str) -> list[int]:
    """Line numbers of own-module imports inside functions with no comment on their line, nor on any line of
    their group (the imports that follow each other in one body), nor on the line just above the group."""
    lines = source.splitlines()
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for body in _bodies(function):
            group: list[ast.stmt] = []
            for statement in [*body, None]:
                if isinstance(statement, ast.Import | ast.ImportFrom):
                    group.append(statement)
                    continue
                if group and not _explained(group, lines):
                    found += [s.lineno for s in group if _own(s)]
                group = []
    return sorted(set(found))


def _bodies(function: ast.AST) -> list[list[ast.stmt]]:
    return [getattr(node, field) for node in ast.walk(function) for field in ("body", "orelse", "finalbody")
            if isinstance(getattr(node, field, None), list)]


def _own(statement: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(statement, ast.ImportFrom):
        return statement.level > 0 or (statement.module or "").split(".")[0] == "bulkgen"
    return any(alias.name.split(".")[0] == "bulkgen" for alias in statement.names)


def _explained(group: list[ast.stmt], lines: list[str]) -> bool:
    first, last = group[0].lineno, group[-1].end_lineno or group[-1].lineno
    span = lines[first - 2:last] if first >= 2 else lines[:last]
    return any("#" in line for line in span)


def test_every_deferred_import_of_our_own_says_why() -> None:
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                 for line in unexplained_deferred_imports(path.read_text())]
    assert offenders == [], "imports inside functions that do not say why (STYLE.md): " + ", ".join(offenders)


def test_the_rule_sees_what_it_should() -> None:
    source = '''
def plain():
    from bulkgen.config import Paths
    import json

def said():
    # here: torch loads only when a bench runs
    import torch

    from bulkgen.engine.engine import Engine

def on_its_line():
    from bulkgen.worker import Worker  # a cycle: worker imports this module

def third_party_only():
    import numpy

def nested():
    if True:
        from . import sibling
'''
    assert unexplained_deferred_imports(source) == [3, 20]


def run_time_imports(path: Path) -> set[str]:
    """The bulkgen modules a file imports at run time: at its top (under if and try too) and inside its functions
    (a deferred import still runs); not those under `if TYPE_CHECKING`."""
    name = _module_name(path)
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for statement in body:
            if isinstance(statement, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(statement.test):
                    visit(statement.body)
                visit(statement.orelse)
            elif isinstance(statement, ast.Import):
                found.update(alias.name for alias in statement.names if alias.name.startswith("bulkgen"))
            elif isinstance(statement, ast.ImportFrom):
                base = statement.module or ""
                if statement.level:  # relative: from the file's package
                    package = name.split(".")[:-statement.level] if path.name != "__init__.py" else \
                        name.split(".")[:len(name.split(".")) - statement.level + 1]
                    base = ".".join([*package, *([base] if base else [])])
                if not base.startswith("bulkgen"):
                    continue
                for alias in statement.names:  # `from bulkgen.engine import attention` imports a module
                    sub = f"{base}.{alias.name}"
                    found.add(sub if _module_path(sub) is not None else base)
            else:  # the bodies of functions, classes, loops, with, try and its handlers
                for field in ("body", "orelse", "finalbody"):
                    if isinstance(inner := getattr(statement, field, None), list):
                        visit(inner)
                for handler in getattr(statement, "handlers", ()):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return {module for module in found if _module_path(module) is not None} - {name}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_path(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    return {_module_name(path): run_time_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


DEVICE_ROOMS = ("bulkgen.engine.cpu", "bulkgen.engine.gpu")
ENGINE_LEAVES = ("bulkgen.engine.metadata",)  # what the device rooms may import of the engine


def test_no_device_room_imports_the_engine_core() -> None:
    back = [f"{module} -> {imported}" for module, imports in import_graph().items()
            if module.startswith(DEVICE_ROOMS) for imported in sorted(imports)
            if imported.startswith("bulkgen.engine") and not imported.startswith(DEVICE_ROOMS)
            and imported not in (*ENGINE_LEAVES, "bulkgen.engine")]
    assert back == [], "device rooms import only the step's types of the engine (metadata.py): " + ", ".join(back)


def says_why_it_is_long(source: str) -> bool:
    """Whether a file's top (its opening comments and docstring) says why it is over 300 lines."""
    tree = ast.parse(source)
    docstring = ast.get_docstring(tree, clean=False) or ""
    comments = "\n".join(line for line in source.splitlines()[:5] if line.startswith("#"))
    return "over 300 lines" in " ".join((comments + "\n" + docstring).lower().split())


def test_a_long_file_says_why_at_its_top() -> None:
    """A file of bulkgen over 300 lines says why it is whole, in its opening comment or docstring (STYLE.md)."""
    unsaid = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
              if len((source := path.read_text()).splitlines()) > 300 and not says_why_it_is_long(source)]
    assert unsaid == [], "files over 300 lines without the reason at their top: " + ", ".join(unsaid)


def test_every_worker_and_engine_option_is_one_flag_of_run_with_the_fields_default() -> None:
    """`bulkgen run`'s flags are named as WorkerOptions' and EngineConfig's fields (so the Python API's keywords are
    the CLI's, underscored), and each flag's default is its field's: written once."""
    from dataclasses import fields  # here: a test's own imports

    from bulkgen.cli.run import WORKER_FLAGS, run
    from bulkgen.config import EngineConfig
    from bulkgen.worker import WorkerOptions

    params = {param.name: param for param in run.params}
    engine_flags = {f.name for f in fields(EngineConfig)} & set(params)  # the rest are the API's (fast_forward, ...)
    assert len(engine_flags) >= 14
    for options, names in ((WorkerOptions(), WORKER_FLAGS), (EngineConfig(), engine_flags)):
        for name in sorted(names):
            assert name in params, f"{name}: no flag of `bulkgen run`"
            default = params[name].default
            if default is None or type(default).__name__ == "Sentinel":  # no default: the field's own rule (None)
                assert getattr(options, name) is None, name
            else:
                assert default == getattr(options, name), name
    assert WORKER_FLAGS == {f.name for f in fields(WorkerOptions)} - {"job_ids", "poll_s", "max_kept_rows"}
