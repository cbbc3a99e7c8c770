"""`bulkgen report`, `status --watch` and `report --serve` on real jobs run by real `bulkgen run` processes: a
300-row job with failures, one killed with SIGKILL and resumed, a sampled JSON-schema job; figures checked
against `status --json`, the export and `jsonschema` (outside references), the page opened in headless Chromium."""

from __future__ import annotations

import json
import os
import pty
import random
import re
import select as select_fd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from sqlalchemy import delete

from bulkgen.bench.report_scale import make_big_job, measure
from bulkgen.recorder import Recorder
from bulkgen.report.figures import build_report
from bulkgen.store.db import open_store
from bulkgen.store.models import RunSample
from tests.helpers import invoke, invoke_json, write_parquet
from tests.test_worker_process import (
    RUN_FLAGS,
    export_rows,
    make_job,
    make_two_work,
    num_results,
    start_worker,
    still_running,
    wait_for_results,
)
from tests.zygote import bulkgen_process, run_bulkgen

ARTIFACTS = Path(os.environ.get("BULKGEN_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / ".artifacts"))
SAMPLE_FLAGS = ["--sample-every", "0.3"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
PLOTS = ["throughput", "lengths", "timing", "finish", "engine"]


def run_worker(db: str, *extra: str) -> subprocess.CompletedProcess:
    done = run_bulkgen(["run", "--db", db, *RUN_FLAGS, *SAMPLE_FLAGS, *extra], timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    """One SQLite store with three finished jobs: `plain` (300 rows; two refused at submit, the longest prompts
    refused by the run's --max-model-len), `resumed` (killed with SIGKILL mid-run, resumed after a pause) and
    `schema` (a JSON schema, temperature 0.8)."""
    root = tmp_path_factory.mktemp("report")
    db = f"sqlite:///{root / 'report.db'}"
    rng = random.Random(3)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "river"]) for _ in range(rng.randint(2, 60)))
               for _ in range(300)]
    prompts[5], prompts[17] = None, ""
    data = write_parquet(root / "plain.parquet", {"prompt": prompts, "n": list(range(300))})
    plain = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 24, "--db", db)["job_id"]
    run_worker(db, "--max-model-len", "48")

    (root / "resumed").mkdir()
    resumed = make_job(root / "resumed", tiny_model_dir, db)
    first = start_worker(db, "--max-num-seqs", "4", *SAMPLE_FLAGS)
    before = num_results(db)  # job 1's
    wait_for_results(db, before + 100, first)  # long enough to have written samples: the page shows both runs' rates
    still_running(first, "killed")
    first.send_signal(signal.SIGKILL)
    first.wait()
    time.sleep(6.5)  # longer than a gap's floor (5 s): the page must show the pause
    run_worker(db)

    rows = [f"Describe item {i} as JSON." for i in range(40)]
    data = write_parquet(root / "schema.parquet", {"prompt": rows})
    schema = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 40, "--temperature", 0.8,
                         "--json-schema", json.dumps(SCHEMA), "--db", db)["job_id"]
    run_worker(db)
    return {"db": db, "root": root, "plain": plain, "resumed": resumed, "schema": schema}


def report_json(db: str, *job_ids: int) -> dict:
    return invoke_json("report", *job_ids, "--db", db)


def test_figures_agree_with_status_and_the_export(jobs: dict) -> None:
    db = jobs["db"]
    for name in ("plain", "resumed", "schema"):
        job_id = jobs[name]
        figures = report_json(db, job_id)["jobs"][0]
        status = invoke_json("status", job_id, "--db", db)
        assert figures["summary"] == status
        exported = export_rows(db, job_id, jobs["root"] / f"{name}.out.parquet")
        completed = [r for r in exported if r["status"] == "completed"]
        dist = figures["distributions"]
        assert dist["output_tokens"]["count"] == len(completed) == status["counts"]["completed"]
        assert dist["output_tokens"]["sum"] == sum(r["num_output_tokens"] for r in completed) \
            == status["num_output_tokens"]
        assert dist["prompt_tokens"]["count"] == len(exported) == status["total"]
        assert dist["latency_s"]["max"] == pytest.approx(max(r["latency_s"] for r in completed), abs=1e-4)
        assert sum(dist["output_tokens"]["histogram"]["counts"]) == len(completed)
        reasons = Counter(r["finish_reason"] for r in completed)
        reasons["error"] = sum(r["status"] == "failed" for r in exported)
        assert figures["finish_reasons"]["counts"] == {k: v for k, v in reasons.items() if v}
        failures = figures["failures"]
        assert failures["num_failed"] == reasons["error"] == sum(g["count"] for g in failures["groups"])
        by_row = {r["row"]: r for r in exported}
        for shown in figures["examples"]["first"] + figures["examples"]["random"]:
            assert shown["output"] == by_row[shown["row"]]["output"]
        assert [r["row"] for r in figures["examples"]["first"]] == [0, 1, 2, 3, 4]
        assert len(figures["examples"]["random"]) == 5


def test_failures_grouped_by_reason_with_the_retry_command(jobs: dict) -> None:
    figures = report_json(jobs["db"], jobs["plain"])["jobs"][0]
    failures = figures["failures"]
    reasons = [g["reason"] for g in failures["groups"]]
    assert any("null" in r for r in reasons) and any("empty" in r for r in reasons)
    too_long = [g for g in failures["groups"] if "context is 48 tokens" in g["reason"]]
    assert len(too_long) == 1 and too_long[0]["count"] > 1  # "has 50 tokens" and "has 61 tokens": one reason
    assert len(too_long[0]["examples"]) == min(3, too_long[0]["count"])
    assert failures["retry"] == f"bulkgen retry {jobs['plain']}"
    # refused by the run (its --max-model-len): a retry runs them again; refused at submit for their input: not
    assert too_long[0]["retryable"] and failures["num_retryable"] == too_long[0]["count"]
    assert not any(g["retryable"] for g in failures["groups"] if "null" in g["reason"] or "empty" in g["reason"])
    status = invoke("status", jobs["plain"], "--db", jobs["db"]).output
    assert f"{too_long[0]['count']} can run again: `bulkgen retry {jobs['plain']}`" in status
    assert "refused at submit for their input" in status
    # the tiny random model never says EOS: every output hits max_new_tokens, and the page says so
    assert figures["finish_reasons"]["length_share"] > 0.1 and "give the budget room" in \
        figures["finish_reasons"]["warning"]


def test_the_samples_add_up_to_what_was_committed(jobs: dict) -> None:
    """One worker, one job, nothing lost: its samples' tokens are the committed tokens exactly, and its
    finished requests those completed plus those the run refused."""
    figures = report_json(jobs["db"], jobs["plain"])["jobs"][0]
    store = open_store(jobs["db"])
    with store.session_scope() as session:
        from bulkgen.store.runs import job_samples

        samples = job_samples(session, jobs["plain"])
    assert len(samples) >= 3
    assert sum(s.num_output_tokens for s in samples) == figures["summary"]["num_output_tokens"]
    refused_at_run = sum(g["count"] for g in figures["failures"]["groups"] if "context is 48" in g["reason"])
    assert sum(s.num_finished for s in samples) == figures["summary"]["counts"]["completed"] + refused_at_run
    assert all(0 < s.max_kv_usage <= 1 and s.max_running <= 32 for s in samples)
    series = figures["throughput"]["series"]
    assert [s["worker_id"] for s in series][-1] == "all" and len(series) == 2
    worker = series[0]
    integral = sum(r * t for r, t in zip(worker["output_tok_per_s"], worker["seconds_run"], strict=True))
    assert integral == pytest.approx(figures["summary"]["num_output_tokens"], rel=0.01)
    assert series[-1]["output_tok_per_s"] == worker["output_tok_per_s"]
    assert max(worker["seconds_run"]) <= figures["throughput"]["bin_s"] + 1e-3
    (run,) = figures["runs"]
    assert run["status"] == "stopped" and run["settings"]["kv_cache_tokens"] > 0
    assert "model" in run["settings"]["engine"] and run["settings"]["packing"]


def test_a_killed_and_resumed_job_shows_its_gap_and_both_runs(jobs: dict) -> None:
    figures = report_json(jobs["db"], jobs["resumed"])["jobs"][0]
    runs = figures["runs"]
    assert len(runs) == 2
    assert runs[0]["status"].startswith("lost") and runs[1]["status"] == "stopped"
    assert sum(r["num_committed"] for r in runs) == figures["summary"]["counts"]["completed"] == 300
    (gap,) = figures["throughput"]["gaps"]
    assert 6.0 <= gap["seconds"] < 60
    assert [s["worker_id"] for s in figures["throughput"]["series"]] == sorted(r["worker_id"] for r in runs) + ["all"]
    assert len(figures["engine"]["series"]) == 2


def test_json_schema_validity_against_jsonschema(jobs: dict) -> None:
    figures = report_json(jobs["db"], jobs["schema"])["jobs"][0]
    exported = export_rows(jobs["db"], jobs["schema"], jobs["root"] / "schema.check.parquet")
    complete = [r for r in exported if r["status"] == "completed" and r["finish_reason"] != "length"]
    valid = 0
    for r in complete:
        try:
            jsonschema.validate(json.loads(r["output"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    checked = figures["json_schema"]
    assert checked["checked_with"] == "jsonschema"
    assert checked["num_outputs"] == 40 and checked["num_complete"] == len(complete) > 0
    assert checked["num_valid"] == valid == len(complete)  # constrained: every complete output is valid
    assert checked["valid_share"] == round(valid / 40, 4)
    assert report_json(jobs["db"], jobs["plain"])["jobs"][0]["json_schema"] is None


def test_page_is_self_contained(jobs: dict, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = invoke("report", jobs["plain"], jobs["resumed"], jobs["schema"], "-o", out, "--db", jobs["db"])
    assert str(out) in result.output
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?https?:|@import""", page)
    assert page.count('<img class="plot"') == 3 * len(PLOTS)
    assert page.count('data:image/svg+xml;base64,') == 3 * len(PLOTS)
    assert "bulkgen retry" in page and "give the budget room" in page and "complete and valid" in page
    assert "http-equiv=\"refresh\"" not in page  # a finished job's page does not reload


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_the_page_in_headless_chromium(jobs: dict, tmp_path: Path) -> None:
    """Loads without errors, every plot present, decoded and drawn at a size; a screenshot kept as an artifact."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium: `apt-get install chromium` (Debian) to open the report in a real browser")
    out = tmp_path / "report.html"
    invoke("report", jobs["plain"], jobs["resumed"], jobs["schema"], "-o", out, "--db", jobs["db"])
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000"]
    dom = subprocess.run([*flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body([^>]*)>", dom.stdout)
    assert body, dom.stderr[-2000:]
    marks = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
    assert marks == {"loaded": "1", "plots": str(3 * len(PLOTS)), "plots-empty": "0", "errors": "0"}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report.png"
    subprocess.run([*flags, "--window-size=1200,2400", f"--screenshot={shot}", out.as_uri()], capture_output=True,
                   timeout=120, check=True)
    from PIL import Image, ImageStat

    image = Image.open(shot).convert("L")
    assert image.size == (1200, 2400)
    assert ImageStat.Stat(image).stddev[0] > 20  # drawn, not a blank page


def test_status_watch_on_a_terminal_redraws_and_ends_with_the_job(jobs: dict) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "bulkgen", "status", str(jobs["plain"]), "--watch",
                             "--db", jobs["db"]], stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    screen = b""
    while select_fd.select([leader], [], [], 30)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        screen += chunk
    assert proc.wait(timeout=30) == 0
    os.close(leader)
    text = screen.decode()
    assert text.startswith("\x1b[H\x1b[2J")
    assert "100%" in text and "completed" in text and f"bulkgen retry {jobs['plain']}" in text


def test_report_refuses_what_it_cannot_do(jobs: dict, tmp_path: Path) -> None:
    missing = invoke("report", 999, "--db", jobs["db"], expect=2)
    assert "no job 999" in missing.output
    both = invoke("report", jobs["plain"], "--serve", "-o", tmp_path / "x.html", "--db", jobs["db"], expect=2)
    assert "--serve" in both.output and not (tmp_path / "x.html").exists()
    invoke("report", "-1", "--db", jobs["db"], expect=2)
    # a page that cannot be written: one line, exit 2, before anything is built
    nowhere = invoke("report", jobs["plain"], "-o", tmp_path / "missing" / "r.html", "--db", jobs["db"], expect=2)
    assert "the directory" in nowhere.output and "does not exist" in nowhere.output
    assert "Traceback" not in nowhere.output and len(nowhere.output.strip().splitlines()) == 1
    unwritable = invoke("report", jobs["plain"], "-o", "/proc/r.html", "--db", jobs["db"], expect=2)
    assert "cannot write in /proc" in unwritable.output and "Traceback" not in unwritable.output


def test_without_job_ids_the_unfinished_jobs_or_else_the_newest(jobs: dict, tmp_path: Path,
                                                                 tiny_model_dir: Path) -> None:
    assert [j["id"] for j in report_json(jobs["db"])["jobs"]] == [jobs["schema"]]  # all finished: the newest
    db = f"sqlite:///{tmp_path / 'none.db'}"
    assert "no jobs yet" in invoke("report", "--db", db, expect=2).output
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["a b", "c d"]})
    queued = [invoke_json("submit", data, "--model", tiny_model_dir, "--db", db)["job_id"] for _ in range(2)]
    assert [j["id"] for j in report_json(db)["jobs"]] == queued



def test_the_settings_shown_are_the_ones_the_job_has(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A budget from a column, a system prompt, own ids: the report shows them, not an unused default budget."""
    db = f"sqlite:///{tmp_path / 'settings.db'}"
    data = write_parquet(tmp_path / "in.parquet", {"q": ["a b", "c d"], "budget": [3, 5], "key": ["x", "y"]})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--db", db, "--prompt-column", "q", "--chat",
                         "--system-prompt", "Be brief.", "--id-column", "key", "--max-new-tokens-column",
                         "budget")["job_id"]
    settings = report_json(db, job_id)["jobs"][0]["settings"]
    assert settings["max_new_tokens_column"] == "budget" and settings["id_column"] == "key"
    assert settings["system_prompt"] == "Be brief." and settings["prompt_column"] == "q" and settings["chat"]
    assert settings["sampling"]["max_new_tokens"] == "from column budget (128 where a cell is empty)"


def test_a_job_not_run_yet_and_a_job_without_samples(jobs: dict, tmp_path: Path, tiny_model_dir: Path) -> None:
    db = f"sqlite:///{tmp_path / 'fresh.db'}"
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["one two", "three four five"]})
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 4, "--db", db)["job_id"]
    figures = report_json(db, job_id)["jobs"][0]
    assert figures["runs"] == [] and figures["throughput"]["series"] == [] and not figures["is_final"]
    assert figures["distributions"]["prompt_tokens"]["count"] == 2
    assert figures["distributions"]["output_tokens"] == {"count": 0}
    out = tmp_path / "fresh.html"
    invoke("report", job_id, "-o", out, "--db", db)
    assert "No worker has run this job yet" in out.read_text()
    run_worker(db)
    with open_store(db).session_scope(write=True) as session:  # as a job run before samples were kept
        session.execute(delete(RunSample))
    figures = report_json(db, job_id)["jobs"][0]
    assert figures["throughput"]["source"] == "commits"
    tokens = invoke_json("status", job_id, "--db", db)["num_output_tokens"]
    assert sum(figures["throughput"]["series"][-1]["output_tok_per_s"]) * figures["throughput"]["bin_s"] == \
        pytest.approx(tokens)
    invoke("report", job_id, "-o", out, "--db", db)
    assert out.read_text().count('<img class="plot"') == 4  # no engine plot without samples


def test_recorder_shares_an_interval_between_jobs_and_skips_idle_ones() -> None:
    from bulkgen.engine.protocol import EngineStats

    stats = EngineStats()
    recorder = Recorder("w", interval_s=60)
    recorder.serving([1, 2], stats)
    recorder.close()
    assert recorder.pending == []  # nothing ran: no row
    for _ in range(4):
        stats.num_output_tokens += 10
        stats.num_running, stats.kv_usage = 5, 0.5
        recorder.step(stats)
    recorder.finished(1, 30)
    recorder.finished(2, 10, failed=True)
    recorder.close()
    one, two = recorder.pending
    assert (one["job_id"], one["num_output_tokens"], one["num_finished"], one["num_failed"]) == (1, 30, 1, 0)
    assert (two["job_id"], two["num_output_tokens"], two["num_finished"], two["num_failed"]) == (2, 10, 1, 1)
    assert one["mean_running"] == 5 and one["max_kv_usage"] == 0.5 and one["num_steps"] == 4
    recorder.written(1)
    assert recorder.pending == [two]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_live_view_with_two_workers(tmp_path: Path, tiny_model_dir: Path, make_db) -> None:
    """`status --watch --json` and `report --serve` follow two workers on one PostgreSQL queue to the end."""
    db = make_db("live")
    job_id = make_job(tmp_path, tiny_model_dir, db)
    serve = bulkgen_process(["report", str(job_id), "--serve", "--port", "0", "--refresh", "1", "--db", db],
                            stderr=subprocess.PIPE, text=True)
    url = next(found.group(0) for line in serve.stderr
               if (found := re.search(r"http://127\.0\.0\.1:\d+/", line)))
    watch = bulkgen_process(["status", str(job_id), "--watch", "--json", "--interval", "0.3", "--db", db],
                            stdout=subprocess.PIPE, text=True)
    workers = [start_worker(db, "--max-num-seqs", "4", *SAMPLE_FLAGS) for _ in range(2)]
    try:
        make_two_work(db, lambda: all(w.poll() is None for w in workers))
        live_page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert 'http-equiv="refresh" content="1"' in live_page
        for w in workers:
            assert w.wait(timeout=300) == 0, w.stderr.read()
        lines = [json.loads(line) for line in watch.communicate(timeout=60)[0].splitlines()]
        assert watch.returncode == 0
        figures = json.loads(urllib.request.urlopen(url + "report.json", timeout=30).read())["jobs"][0]
        final_page = urllib.request.urlopen(url, timeout=30).read().decode()
    finally:
        for proc in (*workers, watch, serve):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
    completed = [line["counts"]["completed"] for line in lines]
    assert completed == sorted(completed) and completed[-1] == 300 and lines[-1]["status"] == "completed"
    assert max(len(line["recent"]["workers"]) for line in lines) == 2
    assert any(line["recent"]["output_tok_per_s"] for line in lines)
    assert lines[-1] == {**invoke_json("status", job_id, "--db", db), "recent": lines[-1]["recent"]}
    assert [r["status"] for r in figures["runs"]] == ["stopped", "stopped"]
    assert len(figures["throughput"]["series"]) == 3 and figures["summary"]["counts"]["completed"] == 300
    assert "http-equiv=\"refresh\"" not in final_page and f"Job {job_id}" in final_page


def test_report_of_a_big_job(tmp_path: Path) -> None:
    """A 20,000-row job (`bulkgen bench report` times 100,000): every request counted, the samples a small
    share of the store."""
    store = open_store(f"sqlite:///{tmp_path / 'big.db'}")
    job_id = make_big_job(store, 20_000, num_workers=2, hours=1)
    figures = measure(store, job_id)
    assert figures["num_requests"] == 20_000 and figures["samples_share"] < 0.03
    job = build_report(store, [job_id])["jobs"][0]
    assert job["distributions"]["prompt_tokens"]["count"] == 20_000
    assert job["failures"]["num_failed"] == job["summary"]["counts"]["failed"] > 0
    assert len(job["failures"]["groups"]) == 1
    assert len(job["throughput"]["series"]) == 3 and job["throughput"]["bin_s"] == 60
