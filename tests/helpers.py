"""Small helpers shared by tests: Parquet files, CLI calls, Hugging Face's greedy generate as the reference."""

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
    from bulkgen.store.db import open_store

    store = open_store(db_url)
    with store.session_scope() as session:
        return session.scalar(select(func.count()).select_from(model))


def hf_greedy(model_dir: Path, workload: list[tuple[list[int], int]], exact_length: bool = False) -> list[list[int]]:
    """Hugging Face generate(), greedy, one prompt at a time: the new token ids of each (prompt, max_new)
    (exact_length: EOS never ends one early, as bulkgen's ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt, max_new in workload:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       min_new_tokens=max_new if exact_length else None, do_sample=False)
            out.append(generated[0, len(prompt):].tolist())
    return out
