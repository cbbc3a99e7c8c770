"""submit: the happy paths, every bad input refused before writing, and bad rows failing alone."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from bulkgen.store.db import open_store
from bulkgen.store.models import Job, Request, RequestState, unpack_ids
from tests.conftest import REPO
from tests.helpers import count_rows, invoke, invoke_json, write_parquet


def requests_of(db_url: str, job_id: int) -> list[Request]:
    store = open_store(db_url)
    with store.session_scope() as session:
        return list(session.query(Request).filter_by(job_id=job_id).order_by(Request.row, Request.sample))


def test_submit_prompts_and_status(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"q": ["Hello there", "What is 2+2?"], "key": ["a", "b"]})
    out = invoke_json("submit", data, "--prompt-column", "q", "--id-column", "key", "--model", tiny_model_dir,
                      "--max-new-tokens", 7, "--name", "t")
    assert out["job_id"] == 1 and out["num_requests"] == 2 and out["num_failed"] == 0
    status = invoke_json("status", 1)
    assert status["id"] == 1 and status["status"] == "queued" and status["total"] == 2
    assert status["counts"] == {"pending": 2, "running": 0, "completed": 0, "failed": 0, "cancelled": 0}
    listed = invoke_json("list")
    assert [j["id"] for j in listed] == [1] and listed[0]["counts"]["pending"] == 2
    reqs = requests_of(db_url, 1)
    assert [r.custom_id for r in reqs] == ["a", "b"]
    assert [r.max_new_tokens for r in reqs] == [7, 7]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert unpack_ids(reqs[0].prompt_token_ids) == tok("Hello there")["input_ids"]
    assert reqs[0].num_prompt_tokens == len(unpack_ids(reqs[0].prompt_token_ids))
    assert len({r.seed for r in reqs}) == 2  # each request its own seed
    human = invoke("status", 1).output
    assert "2 pending" in human and "queued" in human


def test_chat_rendering_messages_and_samples(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    messages = [[{"role": "user", "content": "Hi"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    data = write_parquet(tmp_path / "m.parquet", {"messages": messages})
    out = invoke_json("submit", data, "--messages-column", "messages", "--model", tiny_model_dir,
                      "--temperature", 0.8, "--n", 3, "--seed", 7, "--system-prompt", "You are terse.")
    reqs = requests_of(db_url, out["job_id"])
    assert [(r.row, r.sample) for r in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert "You are terse." in reqs[0].prompt and reqs[0].prompt.rstrip().endswith("assistant")
    assert "Be brief." in reqs[3].prompt and "You are terse." not in reqs[3].prompt  # own system kept
    assert len({r.seed for r in reqs}) == 6
    # Same job seed → same request seeds; another seed → others.
    again = invoke_json("submit", data, "--messages-column", "messages", "--model", tiny_model_dir,
                        "--temperature", 0.8, "--n", 3, "--seed", 7)
    assert [r.seed for r in requests_of(db_url, again["job_id"])] == [r.seed for r in reqs]


def test_job_file_and_flag_override(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "d.parquet", {"prompt": ["one", "two", "three"]})
    job_file = tmp_path / "job.toml"
    job_file.write_text(f'name = "from-file"\ninput = "d.parquet"\nmodel = "{tiny_model_dir}"\n'
                        'max_new_tokens = 11\nstop = ["\\n\\n"]\n[sampling]\ntop_k = 5\n')
    out = invoke_json("submit", job_file, "--max-new-tokens", 3)
    store = open_store(db_url)
    with store.session_scope() as session:
        job = session.get(Job, out["job_id"])
        assert job.name == "from-file"
        assert job.spec["sampling"]["max_new_tokens"] == 3  # the flag wins
        assert job.spec["sampling"]["stop"] == ["\n\n"] and job.spec["sampling"]["top_k"] == 5
    assert [r.max_new_tokens for r in requests_of(db_url, out["job_id"])] == [3, 3, 3]


def test_demo_job_file_submits(db_url: str, default_model_dir: Path) -> None:
    out = invoke_json("submit", REPO / "jobs" / "demo.toml")
    assert out["num_requests"] == out["num_rows"] >= 200 and out["num_failed"] == 0
    first = requests_of(db_url, out["job_id"])[0]
    assert first.custom_id == "ex-0000" and "<|im_start|>user" in first.prompt


def test_per_row_failures_do_not_stop_the_job(tmp_path: Path, db_url: str, tiny_short_model_dir: Path) -> None:
    long_prompt = "word " * 200  # far beyond the 64-token context
    data = write_parquet(tmp_path / "rows.parquet",
                         {"prompt": ["fine", None, "   ", long_prompt, "also fine"], "budget": [4, 4, 4, 4, None]})
    out = invoke_json("submit", data, "--model", tiny_short_model_dir, "--max-new-tokens-column", "budget",
                      "--max-new-tokens", 9)
    assert out["num_requests"] == 5 and out["num_failed"] == 3
    reqs = requests_of(db_url, out["job_id"])
    states = [r.state for r in reqs]
    assert states == ["pending", "failed", "failed", "failed", "pending"]
    assert reqs[1].error == "prompt is null"
    assert reqs[2].error == "prompt is empty"
    assert "exceeds the model's context of 64 tokens" in reqs[3].error
    assert [r.max_new_tokens for r in reqs][::4] == [4, 9]  # a null budget falls back to the flag
    status = invoke("status", out["job_id"]).output
    assert "failed row 1: prompt is null" in status


BAD_INPUTS = [
    ("missing file", lambda d: ("submit", d / "absent.parquet"), "does not exist"),
    ("not parquet", lambda d: ("submit", _text_file(d)), "is not a Parquet file"),
    ("missing column", lambda d: ("submit", _good(d), "--prompt-column", "text"),
     "has no column 'text' (--prompt-column); its columns are: prompt, n"),
    ("wrong type", lambda d: ("submit", _good(d), "--prompt-column", "n"), "holds int64, not text"),
    ("messages type", lambda d: ("submit", _good(d), "--messages-column", "prompt"), "needs a list of"),
    ("empty file", lambda d: ("submit", _empty(d)), "has no rows"),
    ("unknown model", lambda d: ("submit", _good(d), "--model", "no-such-model"), "unknown model 'no-such-model'"),
    ("negative temperature", lambda d: ("submit", _good(d), "--temperature", -0.5), "temperature must be >= 0"),
    ("top-p zero", lambda d: ("submit", _good(d), "--top-p", 0), "top-p must be in (0, 1]"),
    ("top-p above one", lambda d: ("submit", _good(d), "--top-p", 1.5), "top-p must be in (0, 1]"),
    ("max-new-tokens zero", lambda d: ("submit", _good(d), "--max-new-tokens", 0), "max-new-tokens must be"),
    ("top-k negative", lambda d: ("submit", _good(d), "--top-k", -1), "top-k must be"),
    ("min-p one", lambda d: ("submit", _good(d), "--min-p", 1), "min-p must be in [0, 1)"),
    ("repetition penalty", lambda d: ("submit", _good(d), "--repetition-penalty", 0), "repetition-penalty must"),
    ("greedy n", lambda d: ("submit", _good(d), "--n", 2), "identical greedy samples"),
    ("both columns", lambda d: ("submit", _good(d), "--prompt-column", "prompt", "--messages-column", "m"),
     "not both"),
    ("system without chat", lambda d: ("submit", _good(d), "--system-prompt", "x"), "needs chat rendering"),
    ("budget too big", lambda d: ("submit", _good(d), "--max-new-tokens", 5000), "leaves no room"),
    ("bad job file", lambda d: ("submit", _bad_toml(d)), "cannot read job file"),
    ("unknown job key", lambda d: ("submit", _unknown_key_toml(d)), "unknown job setting(s) ['colour']"),
    ("job file: chat as text", lambda d: ("submit", _toml(d, 'chat = "yes"')), 'chat = "yes" must be true or false'),
    ("job file: stop as a number", lambda d: ("submit", _toml(d, "stop = 5")),
     "stop = 5 must be a string or a list of strings"),
    ("job file: input as a number", lambda d: ("submit", _toml(d, "input = 5", with_input=False)),
     "input = 5 must be a string"),
    ("job file: column as a list", lambda d: ("submit", _toml(d, 'prompt_column = ["a"]')),
     'prompt_column = ["a"] must be a string'),
    ("job file: sampling key", lambda d: ("submit", _toml(d, '[sampling]\ntop_p = "high"')),
     'top_p = "high" must be a number'),
    ("no valid row", lambda d: ("submit", write_parquet(d / "nulls.parquet", pa.table(
        {"prompt": pa.array([None] * 3000, pa.string())})), "--max-new-tokens", 8),
     "can run: all 3000 rows are bad (row 0: prompt is null)"),
    ("no valid message", lambda d: ("submit", write_parquet(d / "m.parquet", {"m": [[{"role": "user", "content": 5}]]}),
                                    "--messages-column", "m", "--max-new-tokens", 8),
     "content (a string or a list of parts)"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_before_anything_is_written(case, tmp_path: Path, db_url: str,
                                                         tiny_short_model_dir: Path) -> None:
    _name, make_args, message = case
    args = list(make_args(tmp_path))
    if "--model" not in args:
        args += ["--model", tiny_short_model_dir]
    result = invoke(*args, expect=2)
    assert message in result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1  # one line
    assert count_rows(db_url, Job) == 0
    assert count_rows(db_url, Request) == 0


def _good(d: Path) -> Path:
    return write_parquet(d / "good.parquet", {"prompt": ["a", "b"], "n": [1, 2]})


def _text_file(d: Path) -> Path:
    path = d / "data.parquet"
    path.write_text("prompt\nhello\n")
    return path


def _empty(d: Path) -> Path:
    return write_parquet(d / "empty.parquet", pa.table({"prompt": pa.array([], pa.string())}))


def _bad_toml(d: Path) -> Path:
    path = d / "bad.toml"
    path.write_text("name = [unclosed\n")
    return path


def _toml(d: Path, body: str, with_input: bool = True) -> Path:
    _good(d)
    path = d / "job.toml"
    path.write_text(('input = "good.parquet"\n' if with_input else "") + body + "\n")
    return path


def _unknown_key_toml(d: Path) -> Path:
    _good(d)
    path = d / "unknown.toml"
    path.write_text('input = "good.parquet"\ncolour = "blue"\n')
    return path


def test_a_stretch_of_bad_rows_fails_alone(tmp_path: Path, db_url: str, tiny_short_model_dir: Path) -> None:
    """A whole 2,048-row batch with no valid row (it used to crash the tokenizer) fails row by row, and the
    rest of the file is submitted."""
    prompts = [None] * 2048 + ["fine", "also fine"]
    data = write_parquet(tmp_path / "stretch.parquet", pa.table({"prompt": pa.array(prompts, pa.string())}))
    out = invoke_json("submit", data, "--model", tiny_short_model_dir, "--max-new-tokens", 8)
    assert out["num_requests"] == 2050 and out["num_failed"] == 2048
    assert [r.state for r in requests_of(db_url, out["job_id"])][-3:] == ["failed", "pending", "pending"]


def test_categorical_prompts_are_text(tmp_path: Path, db_url: str, tiny_short_model_dir: Path) -> None:
    """A dictionary-encoded string column (what pandas writes for a categorical) reads as its strings."""
    column = pa.array(["tell me a joke", "a poem", "tell me a joke"]).dictionary_encode()
    data = write_parquet(tmp_path / "cat.parquet", pa.table({"prompt": column}))
    out = invoke_json("submit", data, "--model", tiny_short_model_dir, "--max-new-tokens", 8)
    assert out["num_failed"] == 0
    assert [r.prompt for r in requests_of(db_url, out["job_id"])] == column.to_pylist()


def test_cancel_and_retry(tmp_path: Path, db_url: str, tiny_short_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "r.parquet", {"prompt": ["ok", None, "ok too", "far too long " * 40]})
    job_id = invoke_json("submit", data, "--model", tiny_short_model_dir, "--max-new-tokens", 8)["job_id"]
    # retry re-queues only requests a run can change: a null prompt, or one too long for the model, stays failed
    # (refused at submit for its input), and status and retry say so rather than point to a retry
    assert invoke_json("status", job_id)["num_retryable"] == 0
    assert "2 refused at submit for their input" in invoke("status", job_id).output
    assert "bulkgen retry" not in invoke("status", job_id).output
    said = invoke("retry", job_id).output
    assert "0 requests back" in said and "2 failed request(s) stay failed: refused at submit" in said
    assert invoke_json("retry", job_id) == {"job_id": job_id, "requeued": 0, "not_retried": 2}
    assert invoke_json("cancel", job_id)["cancelled"] == 2
    status = invoke_json("status", job_id)
    assert status["status"] == "cancelled" and status["counts"]["cancelled"] == 2
    assert invoke_json("retry", job_id)["requeued"] == 2
    status = invoke_json("status", job_id)
    assert status["status"] == "queued" and status["counts"]["pending"] == 2 and status["counts"]["failed"] == 2
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        req = session.query(Request).filter_by(job_id=job_id, row=0).one()
        req.state, req.error, req.attempts = RequestState.FAILED.value, "boom", 3
    assert invoke_json("retry", job_id)["requeued"] == 1
    with store.session_scope() as session:
        req = session.query(Request).filter_by(job_id=job_id, row=0).one()
        assert (req.state, req.error, req.attempts) == ("pending", None, 0)
