"""`bulkgen plan`: the replay of the real scheduler against a real run of the same job (the worker's export is the
reference: its output tokens and the prompt tokens it computed), its flags and its errors."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers import invoke, invoke_json, write_parquet


def _fewshot_prompts(seed: int = 0) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    words = "the of a and to in is that for it as with was on be by this".split()
    prompts, budgets = [], []
    for _ in range(3):
        document = " ".join(rng.choice(words) for _ in range(120))
        for q in range(8):
            prompts.append(f"{document}\n\nQuestion {q}: {' '.join(rng.choice(words) for _ in range(q + 2))}?")
            budgets.append(rng.randint(4, 24))
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[i] for i in order], [budgets[i] for i in order]


@pytest.mark.usefixtures("db_url")
def test_plan_predicts_what_the_run_then_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A few-shot job (three documents, eight questions each, shuffled; EOS ignored): the plan's output tokens equal
    the run's, its prompt tokens computed are within 10 % of what the run computed (the export's num_prompt_tokens
    less num_cached_tokens: the replay's claims are sized once, the worker's every second). Candidates give one
    prediction each, two sequences at once a batch of at most two."""
    prompts, budgets = _fewshot_prompts()
    data = write_parquet(tmp_path / "in.parquet", {"prompt": prompts, "n": budgets})
    engine = ("--kv-cache-memory", "4MiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")
    job_id = invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens-column", "n",
                         "--ignore-eos")["job_id"]
    planned = invoke_json("plan", job_id, *engine)
    assert {"seconds", "output_tokens", "prompt_tokens_computed", "peak_kv_blocks", "mean_batch"} <= set(planned)
    assert planned["output_tokens"] == sum(budgets) and not planned["upper_bound"]
    candidates = invoke_json("plan", job_id, *engine[2:], "--max-num-seqs", "2,8", "--kv-cache-memory",
                             "1MiB,4MiB")["candidates"]
    assert [(c["max_num_seqs"], c["kv_cache_blocks"] < 1000) for c in candidates] == [(2, True)] * 2 + [(8, True)] * 2
    assert all(c["mean_batch"] <= 2 for c in candidates[:2]) and candidates[3]["seconds"] == planned["seconds"]
    ran = invoke_json("run", job_id, *engine, "--no-progress")
    # the run counts its engine steps and its drafts: a sequence of budget B takes B steps less its kept draft tokens
    assert 0 <= ran["accepted_tokens"] <= ran["drafted_tokens"]
    assert max(budgets) - ran["accepted_tokens"] <= ran["steps"], ran
    out = tmp_path / "out.parquet"
    invoke("export", job_id, "-o", out)
    rows = pq.read_table(out).to_pylist()
    computed = sum(r["num_prompt_tokens"] - r["num_cached_tokens"] for r in rows)
    assert sum(r["num_output_tokens"] for r in rows) == planned["output_tokens"]
    assert abs(planned["prompt_tokens_computed"] - computed) <= 0.1 * computed, (planned, computed)
    assert computed < 0.6 * sum(r["num_prompt_tokens"] for r in rows), "the documents were reused"
    # (a tiny model's steps are milliseconds and the run's own start and commits a few tenths of a second: its time
    # is checked against real models in BENCHMARKS.md; here, only that it is of the run's order)
    assert 0 < planned["seconds"] - planned["engine_load_s"] <= 2 * ran["seconds"] + 1, (planned, ran["seconds"])
    assert "no pending requests" in invoke("plan", job_id, expect=2).output
    # the report holds the latest plan (the candidates' run came last: its first, 2 sequences, 1 MiB) against the run
    report = invoke_json("report", job_id)["jobs"][0]["plan"]
    assert report["options"]["max_num_seqs"] == 2 and report["options"]["kv_cache_memory"] == "1.0 MiB"
    assert report["actual"]["output_tokens"] == sum(budgets) == report["predicted"]["output_tokens"]
    assert report["actual"]["prompt_tokens_computed"] == computed and report["actual"]["mean_batch"] > 2
    page = tmp_path / "report.html"
    invoke("report", job_id, "-o", page)
    assert "Plan against the run" in page.read_text()


def test_plan_refuses_bad_candidates_in_one_line(db_url: str) -> None:
    for args, says in ((("1", "--max-num-seqs", "8,x"), "--max-num-seqs"),
                       (("1", "--kv-cache-memory", "lots"), "--kv-cache-memory"),
                       (("1", "--packing", "lpt,random"), "--packing must be one of")):
        result = invoke("plan", *args, expect=2)
        assert says in result.output and "Traceback" not in result.output


def test_the_step_cost_fit_finds_the_knee_and_the_costs_of_steps_timed_by_them() -> None:
    """Steps timed by a known cost (a knee of 8 rows): the fit gives it back, and predicts a step of a shape it did
    not see."""
    from bulkgen.plan import StepCost, StepFeatures, _fit

    truth = StepCost(0.002, 0.0015, 0.0004, 6e-7, 8, 0.0, 1, 1)
    rng = random.Random(0)
    measured = []
    for _ in range(200):
        decode = rng.choice([rng.randint(1, 12), rng.randint(1, 128)])
        prefill = rng.choice([0, 0, rng.randint(1, 512)])
        attended = decode * rng.randint(16, 1024) + prefill
        features = StepFeatures(decode, prefill, decode + (prefill > 0), attended, prefill * rng.randint(1, 800))
        measured.append((features, truth.seconds(features)))
    coefficients, knee = _fit(measured)
    assert knee == 8
    for expected, got in zip((truth.base, truth.per_row, truth.per_sampled, truth.per_pair), coefficients,
                             strict=True):
        assert got == pytest.approx(expected, rel=1e-3, abs=1e-9)
    fitted = StepCost(*coefficients, knee, 0.0, 1, 1)
    one_row = StepFeatures(1, 0, 1, 300, 0)  # one row costs what the knee's 8 do
    assert fitted.seconds(one_row) == pytest.approx(truth.seconds(one_row))
    assert fitted.seconds(one_row) > 8 * truth.per_row
