"""JSON-schema constrained outputs (llguidance): every complete output parses and validates, a schema that
cannot compile is refused at submit (or fails its row alone), unconstrained rows beside constrained ones
are untouched, and OpenAI batch lines' response_format works the same."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest

from bulkgen.store.db import open_store
from bulkgen.store.models import Job, Request
from tests.helpers import count_rows, invoke, invoke_json, write_parquet

# what is tested here is generation, not the store (whose tests run on both databases): SQLite alone
pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
          "required": ["name", "ok", "kind"], "additionalProperties": False}
PROMPTS = ["Describe a river.", "Name a stone.", "alpha beta", "What is 2+2?", "Give JSON."]


def _export(job_id: int, path: Path) -> list[dict]:
    invoke("run", job_id, "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job_id, "-o", path)
    return pq.read_table(path).to_pylist()


def test_every_complete_output_is_valid_json_of_its_schema(tmp_path: Path, db_url: str, tiny_model_dir: Path
                                                           ) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    data = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    job = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 80, "--json-schema", schema_file)
    rows = _export(job["job_id"], tmp_path / "out.parquet")
    complete = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(complete) >= 4, [(r["finish_reason"], r["output"]) for r in rows]
    for r in complete:
        jsonschema.validate(json.loads(r["output"]), SCHEMA)


def test_per_row_schemas_and_unconstrained_rows_beside_them(tmp_path: Path, db_url: str, tiny_model_dir: Path
                                                            ) -> None:
    object_schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
                                "required": ["n"], "additionalProperties": False})
    schemas = [json.dumps(SCHEMA), None, '{"type": "strin"}', object_schema, None]
    data = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS, "schema": schemas})
    job = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 40, "--json-schema-column",
                      "schema")
    assert job["num_failed"] == 1
    rows = _export(job["job_id"], tmp_path / "out.parquet")
    assert "strin" in rows[2]["error"] and rows[2]["status"] == "failed"
    for i in (0, 3):
        if rows[i]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(rows[i]["output"]), json.loads(schemas[i]))
    # the unconstrained rows give what they give in a job without any schema
    plain = invoke_json("submit", write_parquet(tmp_path / "plain.parquet", {"prompt": PROMPTS}), "--model",
                        tiny_model_dir, "--max-new-tokens", 40)
    reference = _export(plain["job_id"], tmp_path / "plain.out.parquet")
    assert [rows[i]["output"] for i in (1, 4)] == [reference[i]["output"] for i in (1, 4)]


def test_a_schema_that_cannot_compile_is_refused_at_submit(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    result = invoke("submit", data, "--model", tiny_model_dir, "--json-schema", '{"type": "strin"}', expect=2)
    assert "cannot be compiled" in result.output and "strin" in result.output
    result = invoke("submit", data, "--model", tiny_model_dir, "--json-schema", "no-such-file.json", expect=2)
    assert "neither a JSON object nor a file" in result.output
    assert count_rows(db_url, Job) == 0


def test_openai_response_format(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)

    def line(custom_id: str, response_format: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 80,
                         "temperature": 0, "response_format": response_format}}

    lines = [line("schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
             line("object", {"type": "json_object"}),
             line("broken", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = invoke_json("submit", path)
    invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job["job_id"], "--format", "openai", "-o", tmp_path / "out.jsonl")
    out = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    first = out["schema"]["response"]["body"]["choices"][0]
    if first["finish_reason"] == "stop":
        jsonschema.validate(json.loads(first["message"]["content"]), SCHEMA)
    second = out["object"]["response"]["body"]["choices"][0]
    if second["finish_reason"] == "stop":
        assert isinstance(json.loads(second["message"]["content"]), dict)
    assert "cannot be compiled" in out["broken"]["error"]["message"]


def test_a_model_with_fewer_logits_than_its_tokenizer_fails_schema_rows_with_the_reason(
        tmp_path: Path, db_url: str, default_model_dir: Path) -> None:
    """llguidance needs a logit for each of the tokenizer's tokens: where the model has fewer, each constrained
    row fails with that reason (it crashed the worker before), and the job ends."""
    from tests.test_model_families import tiny_model

    model_dir = tiny_model(tmp_path / "small-vocab", default_model_dir, "LlamaConfig", vocab_size=1024)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    data = write_parquet(tmp_path / "rows.parquet", {"prompt": ["Hi", "Hello"]})
    job = invoke_json("submit", data, "--model", model_dir, "--max-new-tokens", 8, "--json-schema", schema)["job_id"]
    invoke("run", job, "--kv-cache-memory", "4MiB", "--no-progress")
    status = invoke_json("status", job)
    assert status["counts"]["failed"] == 2
    store = open_store(db_url)
    with store.session_scope() as session:
        errors = [r.error for r in session.query(Request).filter_by(job_id=job)]
    assert all("the model has 1024 and its tokenizer 49152" in e for e in errors)
