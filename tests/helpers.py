"""Small helpers shared by tests: Parquet files and CLI calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner, Result
from sqlalchemy import func, select

from bulkgen.cli import cli


def write_parquet(path: Path, columns: dict[str, list[Any]] | pa.Table) -> Path:
    table = columns if isinstance(columns, pa.Table) else pa.table(columns)
    pq.write_table(table, path)
    return path


def invoke(*args: Any, expect: int | None = 0) -> Result:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if expect is not None:
        assert result.exit_code == expect, f"exit {result.exit_code}, output:\n{result.output}"
    return result


def invoke_json(*args: Any) -> Any:
    return json.loads(invoke(*args, "--json").stdout)


def count_rows(db_url: str, model: type) -> int:
    from bulkgen.store import open_store

    store = open_store(db_url)
    with store.session_scope() as session:
        return session.scalar(select(func.count()).select_from(model))
