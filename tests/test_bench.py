"""`bulkgen bench` runs each engine in its own process and reports one table, a JSON file and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import invoke


def test_bench_compares_engines_on_a_workload_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: " + "why? " * i}],
                                     add_generation_prompt=True, tokenize=False) for i in range(6)]
    workload = tmp_path / "w.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": texts,
                             "max_new_tokens": [5, 9, 3, 12, 7, 4]}), workload)
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = invoke("bench", workload, "--model", tiny_model_dir, "--compare", "hf-static-sorted,bulkgen-store,vllm",
                    "--kv-cache-memory", "8MiB", "--vllm-python", tmp_path / "no-such-python",
                    "--json", out_json, "--plot", out_png)
    assert "skipping vllm" in result.output
    table = result.stdout
    assert "out tok/s" in table and "bulkgen-store" in table
    report = json.loads(out_json.read_text())
    engines = {r["engine"]: r for r in report["results"]}
    assert set(engines) == {"bulkgen", "hf-static-sorted", "bulkgen-store"}
    for r in engines.values():
        assert r["output_tok_per_s"] > 0 and r["identical_share"] == 1.0 and r["all_budgets_met"]
    assert engines["bulkgen"]["preemptions"] == 0 and engines["bulkgen"]["padding_fraction"] == 0.0
    assert engines["hf-static-sorted"]["padding_fraction"] > 0
    assert report["workload"]["num_requests"] == 6 and report["workload"]["num_output_tokens"] == 40
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_bench_synthetic_and_bad_arguments(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = invoke("bench", "--synthetic", 3, "--model", tiny_model_dir, "--compare", "",
                    "--kv-cache-memory", "8MiB", "--packing", "fifo")
    assert "synthetic-3-seed0" in result.stdout and "bulkgen" in result.stdout
    assert "give a workload file or --synthetic" in invoke("bench", expect=2).output
    assert "unknown engine 'tgi'" in invoke("bench", "--synthetic", 2, "--model", tiny_model_dir,
                                             "--compare", "tgi", expect=2).output


def test_bench_peer_without_kv_admission_preempts(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`bulkgen@fifo@no-kv-admission` admits what has blocks now (as vLLM does) and so preempts in a cache
    too small for the job; the default admits only what fits to the end and never does; both keep every
    request's tokens."""
    from bulkgen.bench.run import EngineRun, parse_engines

    assert parse_engines("bulkgen@fifo@no-kv-admission,vllm@bfloat16", "float32") == [
        EngineRun("bulkgen", "float32", None, "bulkgen"),
        EngineRun("bulkgen", "float32", "fifo", "bulkgen@fifo@no-kv-admission", False),
        EngineRun("vllm", "bfloat16", None, "vllm@bfloat16")]
    assert parse_engines("bulkgen@no-speculate", "float32")[1].speculate == "off"  # --speculate off, that engine
    out_json = tmp_path / "bench.json"
    invoke("bench", "--synthetic", 12, "--model", tiny_model_dir, "--max-new-tokens", 48, "--block-size", 16,
           "--kv-cache-memory", "1MiB", "--compare", "bulkgen@fifo@no-kv-admission", "--reference", "bulkgen",
           "--json", out_json)
    engines = {r["engine"]: r for r in json.loads(out_json.read_text())["results"]}
    assert engines["bulkgen"]["preemptions"] == 0
    peer = engines["bulkgen@fifo@no-kv-admission"]
    assert peer["preemptions"] > 0
    assert peer["identical_share"] == 1.0, "recomputing a preempted sequence gives the same tokens"
    assert all(r["all_budgets_met"] for r in engines.values())
    assert "no-kv-admission" in invoke("bench", "--synthetic", 2, "--model", tiny_model_dir,
                                       "--compare", "vllm@no-kv-admission", expect=2).output


def test_the_roofline_counts_the_weights_and_the_kv_a_decode_step_reads() -> None:
    """Llama-3.1-8B's shape in bfloat16, 128 sequences with 128,000 tokens of context between them, on a device of
    4.8 TB/s and 989 TFLOP/s: by hand, 32 layers x (4096 x 128 x (2 x 32 + 2 x 8) + 3 x 4096 x 14336) weights and
    the LM head (128,256 x 4096; the embedding table is gathered, not read) = 7,504,658,432 weights, 2 bytes each,
    plus 131,072 bytes of K/V a token (32 layers x 2 x 8 heads x 128 dims x 2 bytes): 31,786,532,864 bytes, 6.622 ms.
    (The loaded model counted 0.3 M parameters once the lean forward had moved its weights out.)"""
    from transformers import LlamaConfig

    from bulkgen.bench.suite import SUITE_MODELS, decode_roofline
    from bulkgen.model import ModelShape

    shape = ModelShape.of(LlamaConfig(**SUITE_MODELS["llama-3.1-8b"]))
    steps = [[t, 128, 128, 128, 0.5, 128_000] for t in (0.0, 0.010, 0.020, 0.030)]
    got = decode_roofline(steps, shape, "bfloat16", {"bytes_per_s": 4.8e12, "flops_per_s": 989e12})
    assert got["bound"] == "memory" and got["decode_batch"] == 128
    assert abs(got["roofline_ms"] - 31_786_532_864 / 4.8e12 * 1e3) < 1e-9
    assert abs(got["decode_step_ms"] - 10.0) < 1e-6
    assert abs(got["step_over_roofline"] - 10.0 / got["roofline_ms"]) < 1e-9


def test_queue_bench_runs_workers_through_the_real_store(make_db, tmp_path: Path) -> None:
    """bulkgen bench queue: worker processes claim and commit through the store with no model; every
    request of each run lands once, and the figures come out per worker count."""
    from sqlalchemy import func, select

    from bulkgen.store.db import open_store
    from bulkgen.store.models import Request, Result

    url = make_db("queue")
    out = tmp_path / "queue.json"
    invoke("bench", "queue", "--workers", "1,2", "--queue-requests", "300", "--db", url, "--json", out)
    rows = json.loads(out.read_text())["queue"]
    assert [r["workers"] for r in rows] == [1, 2] and all(r["requests"] == 300 and r["requests_per_s"] > 0
                                                          for r in rows)
    with open_store(url).session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == 600
        assert session.scalar(select(func.max(Request.attempts))) == 1
    assert "--workers takes worker counts" in invoke("bench", "queue", "--workers", "0", expect=2).output
    assert "--workers takes worker counts" in invoke("bench", "queue", "--workers", "x", expect=2).output


def test_bench_group_names_one_command_each(tmp_path: Path) -> None:
    """`bench make-workload N FILE` writes the workload, the same rows for the same seed; `bench` with a file and
    no command name is `bench compare`, whose flags are its own (the old --make-workload, --queue, --suite are
    gone: one line, exit 2); a bad workload path is one line, exit 2."""
    invoke("bench", "make-workload", "6", tmp_path / "a.parquet", "--seed", "3")
    invoke("bench", "make-workload", "6", tmp_path / "b.parquet", "--seed", "3")
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
    assert pq.read_table(tmp_path / "a.parquet").num_rows == 6
    for flag in ("--make-workload", "--queue", "--suite"):
        assert "No such option" in invoke("bench", tmp_path / "a.parquet", flag, expect=2).output
    helps = invoke("bench", "--help").output
    assert all(name in helps for name in ("compare", "suite", "queue", "make-workload"))
    missing = invoke("bench", tmp_path / "nope.parquet", expect=2).output
    assert "does not exist" in missing
    assert invoke("bench", "compare", tmp_path / "nope.parquet", expect=2).output == missing


FAKE_VLLM = '''"""A stand-in for vLLM with its interface: records what it was asked, returns budget-long outputs."""
import json
import os
import queue  # torch imports it: it must be the standard library's, not a module of bulkgen's
import sys

assert hasattr(queue, "Queue") and "bulkgen" not in (queue.__file__ or ""), queue.__file__
assert not any(p.endswith(os.path.join("bulkgen", "bench")) for p in sys.path), sys.path
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Out:
    def __init__(self, request_id, n):
        self.request_id, self.finished = request_id, True
        self.outputs = [type("Completion", (), {"token_ids": [7] * n})()]


class _Engine:
    def __init__(self):
        self.pending = []

    def add_request(self, request_id, prompt, params):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
            log.write(json.dumps(params.kwargs) + "\\n")
        self.pending.append(_Out(request_id, params.kwargs["max_tokens"]))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return done


class LLM:
    def __init__(self, model, dtype, seed, **kwargs):
        self.llm_engine = _Engine()

    def generate(self, prompts, params, use_tqdm=False):
        return []
'''


def test_the_vllm_peer_starts_as_the_bench_starts_it_and_gets_the_runs_sampling(tmp_path: Path,
                                                                                  tiny_model_dir: Path) -> None:
    """The vLLM child runs as a script under another Python: nothing of bulkgen's may shadow the standard
    library there, and it must get the run's sampling settings (no per-request seed: vLLM's CPU build fails
    requests that carry one)."""
    import os
    import sys

    fake = tmp_path / "fake-site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n")
    python = tmp_path / "vllm-python"  # an environment's Python that has vllm (the bench drops PYTHONPATH)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    log = tmp_path / "vllm-requests.jsonl"
    os.environ["FAKE_VLLM_LOG"] = str(log)
    try:
        out_json = tmp_path / "bench.json"
        result = invoke("bench", "--synthetic", 4, "--model", tiny_model_dir, "--compare", "vllm,vllm@greedy",
                        "--max-new-tokens", 6, "--kv-cache-memory", "8MiB", "--vllm-python", python,
                        "--temperature", 0.8, "--top-p", 0.95, "--json", out_json)
    finally:
        del os.environ["FAKE_VLLM_LOG"]
    engines = {r["engine"]: r for r in json.loads(out_json.read_text())["results"]}
    assert not any("error" in r for r in engines.values()), engines
    assert set(engines) == {"bulkgen", "vllm", "vllm@greedy"} and "sampled temperature 0.8 top-p 0.95" in result.stdout
    asked = [json.loads(line) for line in log.read_text().splitlines()]
    sampled, greedy = asked[:4], asked[4:]
    assert len(sampled) == 4 and not any("seed" in a for a in asked)
    assert all(a["temperature"] == 0.8 and a["top_p"] == 0.95 and a["ignore_eos"] for a in sampled)
    assert all(a["temperature"] == 0 and "seed" not in a for a in greedy)


def test_bench_sampling_flags_are_checked_before_anything_runs(tiny_model_dir: Path) -> None:
    result = invoke("bench", "--synthetic", 2, "--model", tiny_model_dir, "--top-p", 0.9, expect=2)
    assert "--temperature" in result.output
    result = invoke("bench", "--synthetic", 2, "--model", tiny_model_dir, "--temperature", 0.8, "--top-p", 1.5,
                    expect=2)
    assert "top-p must be in (0, 1]" in result.output


def test_queue_bench_stops_waiting_for_a_dead_worker() -> None:
    """A worker process that dies without its count ends the bench's wait (it hung for good in CI when a
    worker failed at its first job)."""
    import multiprocessing
    import sys

    from bulkgen.bench.queue_capacity import _result
    from bulkgen.errors import BulkgenError

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=sys.exit, args=(3,))
    proc.start()
    with pytest.raises(BulkgenError, match=r"worker process died \(exit 3\)"):
        _result(results, [proc], timeout_s=60)
