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


def test_the_readmes_python_section_runs_as_written(backend: str, tmp_path: Path, tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every code block of the README's Python section, pasted as is (the default database, the model named by
    BULKGEN_MODEL, a prompts.parquet with a question column): every job it submits ends completed."""
    import re
    import warnings

    from bulkgen import api

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BULKGEN_DB", raising=False)
    monkeypatch.setenv("BULKGEN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BULKGEN_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(api, "_SUBMITTED", {})
    write_parquet(tmp_path / "prompts.parquet", {"question": ["What is a river?", "Name a stone."]})
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the example as written warns of nothing
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
    jobs = [value for value in namespace.values() if isinstance(value, bulkgen.Job)]
    assert len(jobs) == 3 and len({job.db for job in jobs}) == 2
    for job in jobs:
        assert job.status()["status"] == "completed", job
        assert None not in job.results().column("output").to_pylist()
    assert namespace["table"].column("question").to_pylist() == ["What is a river?", "Name a stone."]

    # run() without db, while a job this process submitted lies in another database: it says so
    with pytest.warns(UserWarning, match=r"works the default database .* job\(s\) 1 in sqlite:///jobs.db"):
        bulkgen.run()


def test_a_one_token_output_has_its_first_token_no_later_than_its_end(backend: str, tmp_path: Path, db_url: str,
                                                                      tiny_model_dir: Path) -> None:
    """time_to_first_token_s <= latency_s, from one clock, however short the output."""
    job = bulkgen.submit(PROMPTS[:2], model=str(tiny_model_dir), max_new_tokens=1, db=db_url)
    job.run(kv_cache_memory="16MiB")
    rows = job.results().to_pylist()
    assert [r["num_output_tokens"] for r in rows] == [1, 1]
    assert all(0 < r["time_to_first_token_s"] <= r["latency_s"] for r in rows), rows


def test_a_model_directory_without_a_tokenizer_says_so(backend: str, tmp_path: Path, db_url: str,
                                                       tiny_model_dir: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, bare / name)
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["x"]})
    result = invoke("submit", data, "--model", bare, expect=2)
    assert f"{bare} has no tokenizer (tokenizer.json / tokenizer_config.json)" in result.output
    assert "sentencepiece" not in result.output
