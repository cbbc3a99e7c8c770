"""The worker in-process: results, per-request errors, leases, retry, export order and joins."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from sqlalchemy import func, select

from bulkgen.config import EngineConfig
from bulkgen.store import queue as q
from bulkgen.store.db import open_store
from bulkgen.store.models import Job, Request, Result
from bulkgen.worker import Worker, WorkerOptions
from tests.helpers import invoke, invoke_json, write_parquet

ENGINE = EngineConfig(kv_cache_memory=16 * 2**20, max_num_seqs=16)


def submit(tmp_path: Path, model: Path, prompts: list, *args) -> int:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": prompts, "key": [f"k{i}" for i in range(len(prompts))]})
    return invoke_json("submit", data, "--model", model, "--id-column", "key", *args)["job_id"]


def run_worker(db_url: str, engine: EngineConfig = ENGINE, **options) -> dict:
    options.setdefault("progress", False)
    return Worker(open_store(db_url), engine, WorkerOptions(**options)).run().to_dict()


PROMPTS = [f"Tell me about number {i}." * (1 + i % 5) for i in range(40)]


def test_run_completes_a_job_and_export_joins_inputs_in_order(tmp_path: Path, db_url: str,
                                                              tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS, "--max-new-tokens", 12)
    summary = run_worker(db_url)
    assert summary["completed"] == 40 and summary["failed"] == 0 and summary["jobs"] == [job_id]
    status = invoke_json("status", job_id)
    assert status["status"] == "completed" and status["counts"]["completed"] == 40
    assert status["num_output_tokens"] == summary["num_output_tokens"] > 0
    out = tmp_path / "out.parquet"
    report = invoke_json("export", job_id, "-o", out)
    assert report["num_rows"] == 40 and not report["partial"]
    rows = pq.read_table(out).to_pylist()
    assert [r["row"] for r in rows] == list(range(40))
    assert [r["prompt"] for r in rows] == PROMPTS and [r["key"] for r in rows] == [f"k{i}" for i in range(40)]
    assert [r["custom_id"] for r in rows] == [f"k{i}" for i in range(40)]
    assert all(r["status"] == "completed" and r["output"] is not None and r["error"] is None for r in rows)
    assert all(r["finish_reason"] in ("length", "eos") and 1 <= r["num_output_tokens"] <= 12 for r in rows)
    # JSONL carries the same rows; without inputs, only the result columns.
    jsonl = tmp_path / "out.jsonl"
    invoke("export", job_id, "-o", jsonl, "--no-include-inputs", "--include-token-ids")
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["output"] for r in lines] == [r["output"] for r in rows]
    assert "prompt" not in lines[0] and len(lines[0]["output_token_ids"]) == lines[0]["num_output_tokens"]


def test_results_equal_the_engine_alone(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    from bulkgen.config import SamplingParams
    from bulkgen.engine.engine import Engine
    from bulkgen.store.models import unpack_ids

    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:10], "--max-new-tokens", 9)
    run_worker(db_url)
    store = open_store(db_url)
    with store.session_scope() as session:
        pairs = session.execute(select(Request.prompt_token_ids, Result.token_ids).join(Result)
                                .where(Request.job_id == job_id).order_by(Request.row)).all()
    engine = Engine(tiny_model_dir, ENGINE)
    prompts = [unpack_ids(p) for p, _ in pairs]
    direct = {o.request_id: o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=9))}
    assert [unpack_ids(t) for _, t in pairs] == [direct[i] for i in range(10)]


def test_per_request_errors_fail_alone_and_retry_reruns_them(tmp_path: Path, db_url: str,
                                                             tiny_model_dir: Path) -> None:
    prompts = ["short", "a much longer prompt " * 8, "also short"]
    job_id = submit(tmp_path, tiny_model_dir, prompts, "--max-new-tokens", 5)
    # This run's context is too small for the long prompt: that request fails, the others complete.
    summary = run_worker(db_url, EngineConfig(kv_cache_memory=16 * 2**20, max_model_len=20))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    status = invoke_json("status", job_id)
    assert status["status"] == "completed" and status["counts"]["failed"] == 1
    out = tmp_path / "failed.parquet"
    invoke("export", job_id, "-o", out)
    rows = pq.read_table(out).to_pylist()
    assert rows[1]["status"] == "failed" and "model's context is 20 tokens" in rows[1]["error"]
    assert rows[1]["output"] is None and rows[0]["output"] is not None
    assert invoke_json("retry", job_id)["requeued"] == 1
    assert run_worker(db_url)["completed"] == 1
    assert invoke_json("status", job_id)["counts"] == {"pending": 0, "running": 0, "completed": 3,
                                                       "failed": 0, "cancelled": 0}


def test_non_finite_logits_fail_only_their_request(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    poisoned = tmp_path / "poisoned"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    bad_token = tok("zebra")["input_ids"][0]
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_token] = float("nan")
    model.save_pretrained(poisoned)
    tok.save_pretrained(poisoned)
    job_id = submit(tmp_path, poisoned, ["hello there", "zebra crossing", "good morning"], "--max-new-tokens", 4)
    summary = run_worker(db_url)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    store = open_store(db_url)
    with store.session_scope() as session:
        failed = session.scalars(select(Request).where(Request.job_id == job_id, Request.state == "failed")).one()
        assert failed.row == 1 and "non-finite logits" in failed.error


def test_expired_leases_are_reclaimed_and_repeat_offenders_fail(tmp_path: Path, db_url: str,
                                                                 tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:6], "--max-new-tokens", 4)
    store = open_store(db_url)
    with store.session_scope(write=True) as session:  # a worker on another host claims and vanishes
        ghost = q.claim(session, "elsewhere:1:ghost", [job_id], 3, lease_s=0.01)
        session.execute(Request.__table__.update().where(Request.id == ghost[0].id).values(attempts=3))
    assert len(ghost) == 3
    summary = run_worker(db_url, max_attempts=3)
    assert summary["completed"] == 5
    with store.session_scope() as session:
        requests = {r.id: r for r in session.scalars(select(Request).where(Request.job_id == job_id))}
    assert requests[ghost[0].id].state == "failed" and "abandoned 3 times" in requests[ghost[0].id].error
    assert {requests[g.id].attempts for g in ghost[1:]} == {2}
    assert invoke_json("status", job_id)["counts"]["completed"] == 5


def test_a_dead_local_worker_loses_its_leases_at_once(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:4], "--max-new-tokens", 4)
    dead = subprocess.Popen(["true"])
    dead.wait()
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        q.register_worker(session, "dead-one")
        session.execute(q.update(q.Worker).where(q.Worker.id == "dead-one").values(pid=dead.pid))
        q.claim(session, "dead-one", [job_id], 4, lease_s=3600)  # an hour-long lease
    assert run_worker(db_url)["completed"] == 4


def test_export_of_a_running_job_writes_what_is_committed(tmp_path: Path, db_url: str,
                                                          tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:5], "--max-new-tokens", 4)
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        claimed = q.claim(session, "w", [job_id], 2, lease_s=60, packing="fifo")
        q.commit_results(session, "w", [{"request_id": c.id, "job_id": job_id, "text": f"out {c.row}",
                                         "token_ids": b"", "finish_reason": "length", "num_prompt_tokens": 3,
                                         "num_output_tokens": 4} for c in claimed[:1]], [])
    out = tmp_path / "partial.parquet"
    result = invoke("export", job_id, "-o", out)
    assert "not finished" in result.output
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["completed", "running", "pending", "pending", "pending"]
    assert rows[0]["output"] == "out 0" and rows[1]["output"] is None
    assert not list(tmp_path.glob(".partial.parquet.*"))  # the temporary file is gone


def test_export_checks_its_input(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:3], "--max-new-tokens", 2)
    moved = tmp_path / "moved.parquet"
    (tmp_path / "in.parquet").rename(moved)
    result = invoke("export", job_id, "-o", tmp_path / "x.parquet", expect=2)
    assert "is gone" in result.output and "--input" in result.output
    assert not (tmp_path / "x.parquet").exists()
    invoke("export", job_id, "-o", tmp_path / "x.parquet", "--input", moved)
    assert pq.read_table(tmp_path / "x.parquet").column("key").to_pylist() == ["k0", "k1", "k2"]
    assert "name it .parquet, .jsonl or .csv" in invoke("export", job_id, "-o", tmp_path / "x.txt", expect=2).output


def test_export_files_get_the_umask_mode_and_bad_places_are_refused(tmp_path: Path, db_url: str,
                                                                    tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:2], "--max-new-tokens", 2)
    old = os.umask(0o022)
    try:
        invoke("export", job_id, "-o", tmp_path / "shared.parquet")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.parquet").stat().st_mode) == 0o644, "what a plain open() gives"
    (tmp_path / "dir.parquet").mkdir()
    cases = [(tmp_path / "missing" / "x.parquet", "does not exist; create it first"),
             (tmp_path / "dir.parquet", "it is a directory"),
             (Path("/proc/bulkgen-export.parquet"), "export to a directory you can write")]  # even root cannot
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases.append((locked / "x.parquet", "export to a directory you can write"))
    for out, message in cases:
        result = invoke("export", job_id, "-o", out, expect=2)
        assert message in result.output and result.output.count("\n") == 1, result.output


def test_samples_export_in_row_then_sample_order(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:3], "--max-new-tokens", 6, "--n", 2,
                    "--temperature", 1.0, "--logprobs", 1)
    run_worker(db_url)
    out = tmp_path / "samples.parquet"
    invoke("export", job_id, "-o", out)
    rows = pq.read_table(out).to_pylist()
    assert [(r["row"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r["key"] for r in rows] == ["k0", "k0", "k1", "k1", "k2", "k2"]
    assert len(json.loads(rows[0]["logprobs"])) == rows[0]["num_output_tokens"]


def test_cancelled_job_is_not_run(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS[:3], "--max-new-tokens", 2)
    invoke("cancel", job_id)
    assert run_worker(db_url)["completed"] == 0
    store = open_store(db_url)
    with store.session_scope() as session:
        assert session.get(Job, job_id).status == "cancelled"


@pytest.mark.parametrize("bad", [{"lease_seconds": 0}, {"max_attempts": 0}, {"packing": "random"}])
def test_bad_worker_options(bad: dict) -> None:
    from bulkgen.errors import ConfigError

    with pytest.raises(ConfigError):
        WorkerOptions(**bad)


def test_claims_are_sized_to_running_capacity_and_a_fair_share() -> None:
    from bulkgen.packing import claim_target

    shape = q.QueueShape(num_pending=10_000, num_running=0, mean_tokens=400.0, num_live_workers=1)
    assert claim_target(256, 8192, shape) == 20 + 5 + 1, "the KV cache runs ~20 such requests at once"
    assert claim_target(16, 10**6, shape) == 16 + 4 + 1, "max_num_seqs caps what runs at once"
    small = q.QueueShape(num_pending=40, num_running=0, mean_tokens=60.0, num_live_workers=2)
    assert claim_target(256, 10**6, small) == 20, "two live workers: half of a small job each"
    later = q.QueueShape(num_pending=20, num_running=20, mean_tokens=60.0, num_live_workers=2)
    assert claim_target(256, 10**6, later) == 20
    assert claim_target(256, 10**6, q.QueueShape(0, 0, 0.0, 0)) == 1


def test_two_workers_share_a_small_job(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    """Two workers start on one 40-request job, which either could run at once: each takes its share. Their two
    model loads leave transformers' loader as it was (its tie_weights swap, done on the class, is not thread-safe:
    unguarded, every later model with tied embeddings in this process loaded its output layer uninitialized)."""
    import threading

    from transformers.modeling_utils import PreTrainedModel

    tie_weights = PreTrainedModel.tie_weights
    job_id = submit(tmp_path, tiny_model_dir, PROMPTS, "--max-new-tokens", 24)
    summaries: list[dict] = []
    threads = [threading.Thread(target=lambda: summaries.append(run_worker(db_url))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(s["completed"] for s in summaries) == [20, 20], summaries
    assert PreTrainedModel.tie_weights is tie_weights, "two loads at once left tie_weights a no-op"
    assert invoke_json("status", job_id)["counts"]["completed"] == 40
    store = open_store(db_url)
    with store.session_scope() as session:
        assert session.scalar(select(func.max(Request.attempts))) == 1, "nobody claimed a request twice"

