"""Progress that tells the truth: tokens counted as generated, an ETA from the tokens still to generate,
and a first line as soon as the run starts."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

from bulkgen.progress import Progress
from tests.helpers import invoke_json, write_parquet
from tests.zygote import run_bulkgen


def test_tokens_count_as_generated_and_the_eta_follows_them() -> None:
    stream = io.StringIO()
    progress = Progress(total=10, done=0, budget_left=10 * 100, log_every_s=0.0, stream=stream)
    time.sleep(0.05)
    progress.generated(50)  # no request has finished yet: the rate and the ETA still show
    line = stream.getvalue().splitlines()[-1]
    assert "0/10 requests · 50 tokens generated" in line and " 0.0 output tok/s" not in line
    assert progress.output_rate > 0 and progress.eta_s is not None
    # 950 budget tokens left to go at the current rate
    assert abs(progress.eta_s - 950 / progress.output_rate) < 1e-6
    assert "ETA <=" in progress.line(), "an upper bound until a request shows it uses its whole budget"
    # Two requests finish having used their whole budgets: the budgets are what is left to generate
    progress.generated(150)
    progress.finished(2, 200, 200)
    assert progress.budget_left == 800 and "ETA <=" not in progress.line()
    assert abs(progress.eta_s - (800 - 0) / progress.output_rate) < 1e-6
    # One ends early (EOS): from now on the ETA is an upper bound again
    progress.generated(10)
    progress.finished(1, 10, 100)
    assert "ETA <=" in progress.line() and abs(progress.eta_s - 700 / progress.output_rate) < 1e-6
    progress.finished(7, 0, 700)
    assert progress.eta_s is None and "10/10 requests" in progress.line()


def test_a_run_off_a_terminal_says_what_it_starts_with_and_shows_tokens_before_any_finish(
        tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": [f"Count to {i}." for i in range(6)]})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 300, "--ignore-eos")["job_id"]
    # --log-every 0: a line every step. 300 tokens with EOS ignored are 300 steps before any request can
    # finish, so the lines before the first finish are there by construction, on a machine of any speed.
    done = run_bulkgen(["run", "--log-every", "0", "--kv-cache-memory", "4MiB"], timeout=300,
                       env={**os.environ, "BULKGEN_DB": db_url})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    first = lines[0]
    assert first.startswith("bulkgen run: model ") and "KV cache" in first and "tokens)" in first
    assert f"jobs {job_id}: 6 requests queued" in first
    assert "C:" in first or "torch:" in first, "the kernel paths taken"
    early = [line for line in lines if line.startswith("bulkgen run: 0/6 requests")]
    with_tokens = [line for line in early if " 0 tokens generated" not in line and "ETA -" not in line]
    assert len(with_tokens) >= 299, lines[:8]  # a line each decode step before the last
