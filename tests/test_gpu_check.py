"""`.ci/gpu-check`, rehearsed on a CPU as CI can (REHEARSAL=1: Triton's interpreter, the suite's tiny model): a
lent GPU gives one call, so the script must bring back every stage's figures, written as it goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton")


# A GPU machine's image has torch, transformers, triton, click and pyarrow but none of the database packages: every
# stage (and the suite's engines, each in a process of its own) must run without them
BLOCK_DB_PACKAGES = """
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sqlalchemy", "alembic", "psycopg", "llguidance"):
            raise ImportError(f"{name} is not installed on this machine (blocked by the test)")
sys.meta_path.insert(0, _Absent())
"""


def test_the_gpu_check_rehearsed_on_a_cpu_brings_back_every_stage(tmp_path: Path) -> None:
    """Every stage, in Python processes that cannot import the database packages (as on a GPU machine's image)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_DB_PACKAGES)
    env = {**os.environ, "PYTHONPATH": str(site)}
    blocked = subprocess.run([sys.executable, "-c", "import sqlalchemy"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "blocked by the test" in blocked.stderr
    out = tmp_path / "out"
    done = subprocess.run([str(ROOT / ".ci" / "gpu-check"), "--quick"], env={**env, "OUT": str(out),
                          "REHEARSAL": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["info", "kernels", "attention", "launches", "suite"]
    assert all(": exit 0 " in line for line in summary), (summary, (out / "kernels.log").read_text()[-3000:],
                                                          (out / "suite.log").read_text()[-3000:])
    tests = ET.parse(out / "kernels.xml").getroot().iter("testsuite")
    suite = next(tests)
    assert int(suite.get("tests")) >= 3 and int(suite.get("failures")) == int(suite.get("errors")) == 0
    attention = json.loads((out / "attention.json").read_text())
    # 4 sequences x 48 tokens of K and V, 8 KV heads x 128 dims, float32
    assert attention["bytes_read"] == 2 * 4 * 48 * 8 * 128 * 4 and attention["ms"] > 0
    launches = (out / "launches.log").read_text()
    assert "2 layers: " in launches and "triton._decode_kernel" in launches, launches
    report = json.loads((out / "suite.json").read_text())
    assert report["prompt_tokens"] == [16, 96] and report["output_tokens"] == [8, 32]
    rows = {r["engine"]: r for r in report["rows"]}
    assert list(rows) == ["bulkgen", "hf-cb", "hf-static-sorted"], "in order"
    assert not any(r.get("error") for r in rows.values()), rows
    assert rows["bulkgen"]["num_requests"] == 6 and rows["hf-cb"]["num_requests"] == 3
    assert all(r["identical_share"] == 1.0 for r in rows.values()), "the same seeded weights in every process"
    assert rows["bulkgen"]["decode_step_ms"] > 0 and rows["bulkgen"]["roofline_ms"] > 0


def test_a_suite_killed_midway_keeps_the_rows_it_measured(tmp_path: Path) -> None:
    """The suite writes its JSON after each engine: killed once the first row is there (as a stage's time limit
    would), the file holds that row, whole."""
    path = tmp_path / "suite.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "bulkgen", "bench", "suite", "--suite-models", "tiny", "--suite-requests", "4",
         "--suite-peer-requests", "2", "--hf-batch-size", "2", "--dtype", "float32", "--kv-cache-memory", "8MiB",
         "--json", str(path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not path.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    rows = json.loads(path.read_text())["rows"]
    assert rows and rows[0]["engine"] == "bulkgen" and rows[0]["output_tok_per_s"] > 0


def test_the_suites_cuda_graph_entry_runs_bulkgen_with_graphs_and_the_same_tokens(tmp_path: Path) -> None:
    """bulkgen-graphs, the quick check's last suite entry, is bulkgen with decode graphs (run eagerly here, in Triton's
    interpreter, on prompts short enough for it): the same tokens as bulkgen on the Triton path."""
    from bulkgen.bench.child import RUNNERS
    from bulkgen.bench.workload import Workload

    workload = Workload("short", [0, 1, 2], [[5, 6, 7], [8] * 20, [9, 10]], [6, 3, 9])
    spec = {"suite_model": "tiny", "dtype": "float32",
            "engine_config": {"attention_backend": "triton", "dtype": "float32", "kv_cache_memory": 2**22,
                              "block_size": 16, "max_num_seqs": 4}}
    plain = RUNNERS["bulkgen"](spec, workload)
    graphs = RUNNERS["bulkgen-graphs"](spec, workload)
    assert graphs["output_token_ids"] == plain["output_token_ids"]
    assert [len(t) for t in graphs["output_token_ids"]] == [6, 3, 9]


def test_unknown_suite_engines_and_bad_lengths_are_refused_before_anything_runs(tmp_path: Path) -> None:
    from tests.helpers import invoke

    out = tmp_path / "suite.json"
    result = invoke("bench", "suite", "--suite-models", "tiny", "--suite-engines", "bulkgen,vllm-gpu", "--json", out,
                    expect=2)
    assert "unknown suite engine(s) ['vllm-gpu']" in result.output
    for flag, value in (("--suite-prompt-tokens", "64-8"), ("--suite-output-tokens", "many"),
                        ("--suite-output-tokens", "0-4")):
        result = invoke("bench", "suite", "--suite-models", "tiny", flag, value, "--json", out, expect=2)
        assert f"{value!r} is not a range of token counts: give MIN-MAX" in result.output and flag in result.output
    assert not out.exists()
