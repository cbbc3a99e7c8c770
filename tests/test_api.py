"""The Python API: submit / run / Job.status / Job.results with the CLI's names and results, and generate
in memory giving what a queued job gives."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import bulkgen
from tests.helpers import invoke, invoke_json, write_parquet

# what is tested here is generation, not the store (whose tests run on both databases): SQLite alone
pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

PROMPTS = ["Hello there", "river stone river", "", "What is 2+2?"]


def test_submit_run_status_results_are_the_clis(tmp_path: Path, db_url: str, tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKGEN_HOME", str(tmp_path / "home"))
    job = bulkgen.submit(PROMPTS, model=str(tiny_model_dir), max_new_tokens=8, name="api", db=db_url)
    assert isinstance(job, bulkgen.Job) and job.status()["status"] == "queued"
    summary = bulkgen.run([job.id], db=db_url, kv_cache_memory="16MiB")
    assert summary["completed"] == 3 and summary["failed"] == 0
    status = job.status()
    assert status["status"] == "completed" and status["counts"]["failed"] == 1  # the empty prompt, at submit
    table = job.results()
    assert table.column("row").to_pylist() == [0, 1, 2, 3] and table.column("prompt").to_pylist() == PROMPTS

    # the same rows through the CLI give the same results
    data = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    cli_job = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 8)["job_id"]
    invoke("run", cli_job, "--kv-cache-memory", "16MiB", "--no-progress")
    cli = bulkgen.Job(cli_job, db_url).results()
    for column in ("status", "output", "finish_reason", "num_output_tokens", "error"):
        assert table.column(column).to_pylist() == cli.column(column).to_pylist(), column

    # generate, in memory: the same outputs, the bad row its error
    generated = bulkgen.generate(PROMPTS, model=str(tiny_model_dir), max_new_tokens=8,
                                 engine={"kv_cache_memory": "16MiB"})
    assert [g["output"] for g in generated] == table.column("output").to_pylist()
    assert generated[2]["error"] == "prompt is empty" and generated[2]["output"] is None


def test_tables_conversations_and_errors(tmp_path: Path, db_url: str, tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKGEN_HOME", str(tmp_path / "home"))
    table = pa.table({"question": ["a b c", "d e"], "key": ["x", "y"]})
    job = bulkgen.submit(table, prompt_column="question", id_column="key", model=str(tiny_model_dir),
                         max_new_tokens=4, db=db_url)
    assert job.status()["total"] == 2
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hello"}]]
    chat_job = bulkgen.submit(chats, model=str(tiny_model_dir), max_new_tokens=4, db=db_url)
    bulkgen.run(db=db_url, kv_cache_memory="16MiB")
    assert job.results().column("key").to_pylist() == ["x", "y"]
    assert chat_job.results().column("status").to_pylist() == ["completed", "completed"]
    out = bulkgen.generate(chats, model=str(tiny_model_dir), max_new_tokens=4, engine={"kv_cache_memory": "16MiB"})
    assert [o["output"] for o in out] == chat_job.results().column("output").to_pylist()
    with pytest.raises(bulkgen.ConfigError, match="unknown job setting"):
        bulkgen.submit(["x"], model=str(tiny_model_dir), max_new_tokenz=4, db=db_url)
    with pytest.raises(bulkgen.ConfigError, match="unknown run option"):
        bulkgen.run(db=db_url, kv_cache=1)
    with pytest.raises(bulkgen.InputError, match="does not exist"):
        bulkgen.submit(tmp_path / "missing.parquet", db=db_url)
    with pytest.raises(bulkgen.NotFoundError):
        bulkgen.Job(999, db_url).status()


def test_the_in_memory_stage_checks_columns_as_submit_does(db_url: str, tiny_model_dir: Path) -> None:
    """A table without the prompt column, or with one of numbers, is refused with submit's words
    (InputError naming the flag and the columns), not a pyarrow KeyError."""
    from bulkgen.api import Generate

    stage = Generate(model=str(tiny_model_dir), prompt_column="question", sampling={"max_new_tokens": 2},
                     engine={"kv_cache_memory": "16MiB"})
    with pytest.raises(bulkgen.InputError, match=r"has no column 'question' \(--prompt-column\); its columns are: "
                                                 "prompt"):
        stage(pa.table({"prompt": ["a"]}))
    with pytest.raises(bulkgen.InputError, match="holds int64, not text"):
        stage(pa.table({"question": [1, 2]}))
    assert stage(pa.table({"question": ["a b"]})).column("finish_reason").to_pylist() == ["length"]
