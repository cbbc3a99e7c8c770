"""OpenAI batch files: submitted as they go to OpenAI, run, and exported in OpenAI's output format, which
the openai package's own types accept; whole-file errors refuse the file, per-line errors fail their line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bulkgen.store.models import Job
from tests.helpers import count_rows, invoke, invoke_json, write_parquet


def _line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def batch(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, str]:
    model = str(tiny_model_dir)
    lines = [
        _line("chat-1", {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
                         "temperature": 0}),
        _line("text-1", {"model": model, "prompt": "river stone river", "max_tokens": 6, "temperature": 0},
              url="/v1/completions"),
        _line("chat-n", {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                         "n": 2, "temperature": 0.8, "seed": 7, "max_completion_tokens": 5, "stop": ["\n\n"]}),
        _line("embed", {"model": model, "input": "x"}, url="/v1/embeddings"),
        _line("other-model", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}),
        _line("too-hot", {"model": model, "messages": [{"role": "user", "content": "x"}], "temperature": 3}),
        _line("logprobs", {"model": model, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 4,
                           "temperature": 0, "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5}),
    ]
    return _write(tmp_path / "batch.jsonl", lines), model


def test_a_batch_file_runs_and_exports_in_openais_format(tmp_path: Path, db_url: str, batch, tiny_model_dir: Path
                                                         ) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    path, model = batch
    job = invoke_json("submit", path)  # the job's model: the one the first line names
    assert job["num_rows"] == 7 and job["num_requests"] == 8 and job["num_failed"] == 3
    invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    invoke("export", job["job_id"], "--format", "openai", "-o", out, "--errors", errors)
    good, bad = _read(out), _read(errors)
    assert [g["custom_id"] for g in good] == ["chat-1", "text-1", "chat-n", "logprobs"]  # input order
    assert [b["custom_id"] for b in bad] == ["embed", "other-model", "too-hot"]
    for line in good:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        parsed = (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)
        assert parsed.model == model and parsed.usage.total_tokens == parsed.usage.prompt_tokens + \
            parsed.usage.completion_tokens
        assert all(c.finish_reason in ("stop", "length") for c in parsed.choices)
    chat_n = good[2]["response"]["body"]
    assert len(chat_n["choices"]) == 2 and [c["index"] for c in chat_n["choices"]] == [0, 1]
    assert good[0]["response"]["body"]["choices"][0]["finish_reason"] == "length"  # 8 tokens of a random model
    content = good[3]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "url '/v1/embeddings' is not supported" in bad[0]["error"]["message"]
    assert "not this job's model" in bad[1]["error"]["message"] and "temperature" in bad[2]["error"]["message"]
    assert all(b["response"] is None and b["error"]["code"] for b in bad)

    # one file without --errors: every line, in input order
    everything = tmp_path / "all.jsonl"
    invoke("export", job["job_id"], "--format", "openai", "-o", everything)
    assert [line["custom_id"] for line in _read(everything)] == ["chat-1", "text-1", "chat-n", "embed",
                                                                 "other-model", "too-hot", "logprobs"]

    # a greedy completions line gives what the same prompt gives as a Parquet row
    data = write_parquet(tmp_path / "p.parquet", {"prompt": ["river stone river"]})
    same = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 6)
    invoke("run", same["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", same["job_id"], "-o", tmp_path / "p.out.parquet")
    assert good[1]["response"]["body"]["choices"][0]["text"] == pq.read_table(tmp_path / "p.out.parquet")[
        "output"][0].as_py()


def test_a_file_as_openai_writes_it_runs_every_line_on_the_model_given(tmp_path: Path, db_url: str,
                                                                       tiny_model_dir: Path) -> None:
    """Every line names OpenAI's model (or another): --model runs them all; the export keeps each line's name."""
    from openai.types.chat import ChatCompletion

    lines = [_line(f"r{i}", {"model": name, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4,
                             "temperature": 0})
             for i, name in enumerate(["gpt-4o-mini", "gpt-4o-mini", "gpt-4.1-nano"])]
    path = _write(tmp_path / "openai.jsonl", lines)
    job = invoke_json("submit", path, "--model", tiny_model_dir)
    assert job["num_failed"] == 0 and job["model_path"] == str(tiny_model_dir.resolve())
    invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    out = tmp_path / "out.jsonl"
    invoke("export", job["job_id"], "--format", "openai", "-o", out)
    bodies = [ChatCompletion.model_validate(line["response"]["body"]) for line in _read(out)]
    assert [b.model for b in bodies] == ["gpt-4o-mini", "gpt-4o-mini", "gpt-4.1-nano"]
    assert all(len(b.choices) == 1 and b.usage.completion_tokens > 0 for b in bodies)


def test_a_line_seed_gives_the_same_samples_wherever_the_line_is(tmp_path: Path, db_url: str,
                                                                 tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    seeded = _line("s", {"model": model, "prompt": "alpha beta", "max_tokens": 6, "seed": 11, "n": 2},
                   url="/v1/completions")
    filler = _line("f", {"model": model, "prompt": "gamma", "max_tokens": 3}, url="/v1/completions")
    texts = []
    for name, lines in (("a", [seeded, filler]), ("b", [filler, seeded])):
        job = invoke_json("submit", _write(tmp_path / f"{name}.jsonl", lines))
        invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
        invoke("export", job["job_id"], "--format", "openai", "-o", tmp_path / f"{name}.out.jsonl")
        line = next(x for x in _read(tmp_path / f"{name}.out.jsonl") if x["custom_id"] == "s")
        texts.append([c["text"] for c in line["response"]["body"]["choices"]])
    assert texts[0] == texts[1] and len(texts[0]) == 2


@pytest.mark.parametrize(("lines", "words"), [
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}', "not json"],
     "line 2 is not JSON"),
    ([{"custom_id": "a", "method": "POST", "url": "/v1/completions"}], "line 1 has no body"),
    ([_line("a", {"prompt": "x"}, "/v1/completions"), _line("b", {"prompt": "y"}, "/v1/completions"),
      _line("a", {"prompt": "z"}, "/v1/completions")], "line 3 repeats custom_id 'a' (first on line 1)"),
    ([_line("a", {"prompt": "x", "model": "gpt-4o-mini"}, "/v1/completions")],
     "first line names model 'gpt-4o-mini', which bulkgen cannot load: give --model"),
])
def test_whole_file_errors_refuse_it_with_nothing_written(tmp_path: Path, db_url: str, tiny_model_dir: Path,
                                                          lines: list, words: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    flags = [] if "gpt-4o-mini" in words else ["--model", tiny_model_dir]
    result = invoke("submit", path, *flags, expect=2)
    assert words in result.output and "Traceback" not in result.output
    assert count_rows(db_url, Job) == 0


def test_a_table_job_exports_in_openais_format_too(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    from openai.types.chat import ChatCompletion

    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["alpha beta", ""], "id": ["a", "b"]})
    job = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 4, "--id-column", "id")
    invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job["job_id"], "--format", "openai", "-o", tmp_path / "out.jsonl")
    first, second = _read(tmp_path / "out.jsonl")
    assert first["custom_id"] == "a" and ChatCompletion.model_validate(first["response"]["body"]).model == \
        str(tiny_model_dir)
    assert second["custom_id"] == "b" and second["error"]["message"] == "prompt is empty"
