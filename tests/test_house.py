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
