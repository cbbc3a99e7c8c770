"""JSONL and CSV inputs: streamed like Parquet, with the same column flags, up-front checks and per-row
failures, and export joining their columns back in input order."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq

from bulkgen.store.models import Job, Request
from tests.helpers import count_rows, invoke, invoke_json, write_parquet

PROMPTS = ["Hello there", "123", None, "", "river stone river stone", "What is 2+2?"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _run_and_export(job_id: int, path: Path) -> list[dict]:
    invoke("run", job_id, "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job_id, "-o", path)
    return pq.read_table(path).to_pylist()


def test_jsonl_and_csv_rows_give_what_the_same_parquet_rows_give(tmp_path: Path, db_url: str,
                                                                 tiny_model_dir: Path) -> None:
    rows = [{"text": p, "key": f"k{i}", "budget": 4 + i} for i, p in enumerate(PROMPTS)]
    parquet = write_parquet(tmp_path / "in.parquet", {k: [r[k] for r in rows] for k in rows[0]})
    jsonl = _jsonl(tmp_path / "in.jsonl", rows)
    # CSV has no null: an empty field is null, so the empty prompt is null there too
    comma = _csv(tmp_path / "in.csv", [{**r, "text": "" if r["text"] is None else r["text"]} for r in rows])
    flags = ["--prompt-column", "text", "--id-column", "key", "--max-new-tokens-column", "budget", "--model",
             tiny_model_dir]
    exported = {}
    for source in (parquet, jsonl, comma):
        job = invoke_json("submit", source, *flags)
        assert job["num_rows"] == len(PROMPTS) and job["num_failed"] == 2, job
        exported[source.suffix] = _run_and_export(job["job_id"], tmp_path / f"out{source.suffix}.parquet")
    want = exported[".parquet"]
    for suffix in (".jsonl", ".csv"):
        got = exported[suffix]
        assert [r["row"] for r in got] == list(range(len(PROMPTS)))
        for column in ("custom_id", "status", "output", "finish_reason", "num_output_tokens", "key", "budget"):
            assert [r[column] for r in got] == [r[column] for r in want], (suffix, column)
        assert got[1]["text"] == "123" and got[1]["status"] == "completed"  # a number-like CSV prompt is text
        assert got[2]["error"] == "prompt is null"

    # and out as CSV: read back by Python's own csv module, the same rows (lists as JSON text)
    import csv
    import json

    job_id = invoke_json("list", "--json")[-1]["id"]  # the Parquet job
    out = tmp_path / "out.csv"
    invoke("export", job_id, "-o", out, "--include-token-ids")
    with open(out, newline="", encoding="utf-8") as handle:
        read = list(csv.DictReader(handle))
    assert [int(r["row"]) for r in read] == [r["row"] for r in want]
    assert [r["output"] or None for r in read] == [r["output"] if r["output"] != "" else None for r in want]
    assert [r["status"] for r in read] == [r["status"] for r in want]
    completed = [r for r in read if r["status"] == "completed"]
    assert all(len(json.loads(r["output_token_ids"])) == int(r["num_output_tokens"]) for r in completed)


def test_a_jsonl_key_first_seen_late_is_left_out_and_a_changed_type_refuses_the_file(
        tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    rows = [{"prompt": f"item {i}"} for i in range(3)] + [{"prompt": "late", "extra": 1}]
    job = invoke_json("submit", _jsonl(tmp_path / "late.jsonl", rows), "--model", tiny_model_dir)
    assert job["num_requests"] == 4
    bad = _jsonl(tmp_path / "typed.jsonl", [{"prompt": "a"}, {"prompt": 5}])
    result = invoke("submit", bad, "--model", tiny_model_dir, expect=2)
    assert "not a readable JSONL file" in result.output and "Traceback" not in result.output
    assert count_rows(db_url, Job) == 1 and count_rows(db_url, Request) == 4  # the refused file left nothing


def test_bad_row_files_are_refused_before_anything_is_written(tmp_path: Path, db_url: str,
                                                               tiny_model_dir: Path) -> None:
    cases = [
        (_jsonl(tmp_path / "a.jsonl", [{"question": "x"}]), [], "has no column 'prompt'"),
        (_csv(tmp_path / "b.csv", [{"question": "x"}]), [], "its columns are: question"),
        (tmp_path / "empty.jsonl", [], "has no rows"),
        (tmp_path / "broken.jsonl", [], "broken.jsonl line 2 is not JSON"),
        (tmp_path / "comma.jsonl", [], 'comma.jsonl line 3 is not JSON (Expecting property name enclosed in double '
                                       'quotes at column 20): \'{"prompt": "three",}\''),
        (tmp_path / "latin1.csv", [], "latin1.csv line 3 is not UTF-8 text (byte 0xe9 at column 4)"),
        (tmp_path / "notes.txt", [], "cannot tell the format of notes.txt"),
        (_csv(tmp_path / "c.csv", [{"prompt": "x", "n": "many"}]), ["--max-new-tokens-column", "n"],
         "not a readable CSV file"),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "fine"}\n{"prompt": \n')
    (tmp_path / "notes.txt").write_text("just some text\n")
    (tmp_path / "comma.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three",}\n')
    (tmp_path / "latin1.csv").write_bytes("prompt\nfine\ncaf\u00e9 au lait\n".encode("latin-1"))
    for path, flags, words in cases:
        result = invoke("submit", path, *flags, "--model", tiny_model_dir, expect=2)
        assert words in result.output, (path.name, result.output)
    assert count_rows(db_url, Job) == 0


def test_the_format_is_told_by_content_or_forced(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    rows = _jsonl(tmp_path / "rows.data", [{"prompt": "a b c"}, {"prompt": "d e"}])
    assert invoke_json("submit", rows, "--model", tiny_model_dir)["num_rows"] == 2
    comma = tmp_path / "rows.txt"
    comma.write_text("prompt\nhello\nworld\n")
    assert invoke_json("submit", comma, "--input-format", "csv", "--model", tiny_model_dir)["num_rows"] == 2
