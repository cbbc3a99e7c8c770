# Whole (over 300 lines): every figure of a job's report is read in one session from the job's outcomes; the page and
# the plots are modules of their own.
"""A job's report as data: the same figures the page plots, and what `bulkgen report --json` prints.

Read from the store only: the job's summary (the very dict `bulkgen status --json` prints, so the two agree),
every request's outcome in a few columns (one query, no text: a 100,000-row job's report takes about a second),
the workers' interval samples (throughput, running sequences, KV use over time) and their settings, a page of
failures and sample rows, and for constrained jobs each output checked against its schema.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from bulkgen.engine.protocol import FinishReason
from bulkgen.errors import NotFoundError
from bulkgen.store import jobs as job_ops
from bulkgen.store import queue as q
from bulkgen.store import report as reads
from bulkgen.store import runs
from bulkgen.store.db import Store
from bulkgen.store.models import FINAL_JOB_STATES, RequestState, WorkerStatus, iso_utc, utcnow

LENGTH_WARNING_SHARE = 0.1  # more than this share cut by max_new_tokens: the page says "give the budget room"
NUM_EXAMPLES = 5
NUM_HISTOGRAM_BINS = 30
LOST_AFTER_S = 300.0  # a worker elsewhere silent this long is reported lost (one here: as soon as its process is gone)
GAP_FLOOR_S = 5.0  # no work for longer than this (and three samples) is a gap


def build_report(store: Store, job_ids: list[int], num_examples: int = NUM_EXAMPLES) -> dict[str, Any]:
    with store.session_scope() as session:
        jobs = [job_report(session, job_id, num_examples) for job_id in job_ids]
    return {"generated_at": iso_utc(utcnow()), "jobs": jobs}


def current_jobs(store: Store) -> list[int]:
    """The jobs a report without job ids shows: those not finished yet, oldest first, or else the newest job."""
    with store.session_scope() as session:
        jobs = job_ops.list_jobs(session)
    if not jobs:
        raise NotFoundError("no jobs yet: `bulkgen submit FILE` creates one")
    return sorted(job.id for job in jobs if job.status not in FINAL_JOB_STATES) or [jobs[0].id]


def job_report(session: Session, job_id: int, num_examples: int = NUM_EXAMPLES) -> dict[str, Any]:
    job = job_ops.get_job(session, job_id)
    summary = runs.job_summary(session, job)
    outcomes = reads.outcomes(session, job_id)
    samples = runs.job_samples(session, job_id)
    rates = throughput(samples, [] if samples else reads.commits(session, job_id))
    return {
        "id": job_id,
        "summary": summary,
        "settings": _settings(job),
        "runs": _runs(session, job_id),
        "throughput": rates,
        "engine": engine_series(samples, rates),
        "distributions": distributions(outcomes),
        "finish_reasons": finish_reasons(outcomes, asked_for_length=bool(job.spec["sampling"].get("ignore_eos"))),
        "failures": failure_groups(reads.failures(session, job_id), job_id),
        "json_schema": schema_validity(session, job_id, job.spec.get("sampling", {}).get("json_schema"),
                                       job.spec.get("json_schema_column")),
        "examples": examples(session, job_id, num_examples),
        "plan": plan_against_run(job, summary, samples),
        "is_final": job.status in FINAL_JOB_STATES,
    }


def plan_against_run(job: Any, summary: dict[str, Any], samples: list[Any]) -> dict[str, Any] | None:
    """The job's latest `bulkgen plan` (plan.py) beside what its runs did: time from the first claim to the last
    commit (the plan's seconds less the engine's load it counted), output tokens, prompt tokens computed and mean
    batch (the run samples'); None where it was never planned."""
    if not job.plan:
        return None
    steps = sum(s.num_steps for s in samples)
    actual = {"seconds": summary["elapsed_s"], "output_tokens": summary["num_output_tokens"],
              "prompt_tokens_computed": int(sum(s.num_prompt_tokens for s in samples)) if samples else None,
              "mean_batch": round(sum(s.mean_running * s.num_steps for s in samples) / steps, 2) if steps else None}
    predicted = job.plan["predicted"]
    run_s = max(predicted["seconds"] - job.plan.get("engine_load_s", 0.0), 0.0)
    return {**job.plan, "predicted_run_s": round(run_s, 1), "actual": actual}


# ---------------------------------------------------------------------------------------------- settings, runs

SPEC_SETTINGS = ("input_format", "n", "chat", "system_prompt", "prompt_column", "messages_column", "id_column",
                 "max_new_tokens_column", "json_schema_column", "add_special_tokens")  # as the job has them


def _settings(job: Any) -> dict[str, Any]:
    """The settings the job has: what submit was given and the defaults that apply (a budget taken from a column
    or from each line of an OpenAI batch file says so, and what a row without one gets)."""
    spec = job.spec
    sampling = dict(spec.get("sampling") or {})
    if sampling.get("json_schema"):
        sampling["json_schema"] = "(set: see the JSON schema section)"
    budget = sampling.get("max_new_tokens")
    if spec.get("max_new_tokens_column"):
        sampling["max_new_tokens"] = f"from column {spec['max_new_tokens_column']} ({budget} where a cell is empty)"
    elif spec.get("input_format") == "openai":
        sampling["max_new_tokens"] = f"each line's max_tokens ({budget} where a line has none)"
    own = {key: spec.get(key) for key in SPEC_SETTINGS if spec.get(key) not in (None, False)}
    revision = {"model_revision": job.model_revision} if job.model_revision else {}
    return {"model": job.model, "model_path": job.model_path, **revision, "input": job.input_path,
            "input_columns": job.input_columns, **own, "sampling": sampling}


def _runs(session: Session, job_id: int) -> list[dict[str, Any]]:
    """Each worker that worked on the job: when, how it ended, what it committed, what it ran with."""
    out = []
    for worker, num_committed, num_tokens in runs.job_workers(session, job_id):
        if worker.status == WorkerStatus.STOPPED:
            ended = "stopped"
        elif worker.status == WorkerStatus.DEAD or q.is_gone(worker.hostname, worker.pid) or \
                (utcnow() - worker.heartbeat_at).total_seconds() > LOST_AFTER_S:
            ended = f"lost: no heartbeat since {iso_utc(worker.heartbeat_at)} (killed, or its machine went away)"
        else:
            ended = "running"
        out.append({"worker_id": worker.id, "hostname": worker.hostname, "pid": worker.pid,
                    "started_at": iso_utc(worker.started_at), "last_seen": iso_utc(worker.heartbeat_at),
                    "status": ended, "num_committed": num_committed, "num_output_tokens": num_tokens,
                    "settings": worker.settings})
    return out


# ---------------------------------------------------------------------------------------------- over time

def _bin_seconds(span_s: float, finest_s: float) -> int:
    """Per minute once a run is long enough to have a shape (coarser past 12 hours); finer for a short one,
    but never finer than its samples."""
    for bin_s in (1, 2, 5, 10, 30, 60, 300, 900, 3600):
        if bin_s >= 0.9 * finest_s and (span_s / bin_s <= 60 or bin_s >= 60 and span_s / bin_s <= 720):
            return bin_s
    return 3600


def throughput(samples: list[Any], commits: list[Any]) -> dict[str, Any]:
    """Output tokens a second in bins (a minute, where the run is long), per worker and in all, and the gaps
    where nothing ran. From the workers' samples; for a job run without them (before they were recorded),
    from the results' commit times ("source": "commits")."""
    if samples:
        events = [(s.started_at, s.seconds, s.worker_id, s.num_output_tokens, s.num_finished) for s in samples]
        source = "samples"
    else:
        events = [(c.finished_at, 0.0, c.worker_id or "-", c.num_output_tokens, 1) for c in commits]
        source = "commits"
    if not events:
        return {"source": source, "bin_s": None, "start": None, "series": [], "gaps": []}
    start = min(e[0] for e in events)
    end = max(e[0] + timedelta(seconds=e[1]) for e in events)
    finest = float(np.median([e[1] for e in events])) if source == "samples" else 10.0
    bin_s = _bin_seconds((end - start).total_seconds(), finest)
    num_bins = int((end - start).total_seconds() // bin_s) + 1
    tokens: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(num_bins))
    finished: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(num_bins))
    covered: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(num_bins))
    for at, seconds, worker, num_tokens, num_finished in events:
        begin = (at - start).total_seconds()
        if seconds <= 0:  # a commit: a moment
            i = min(int(begin // bin_s), num_bins - 1)
            tokens[worker][i] += num_tokens
            finished[worker][i] += num_finished
            continue
        for i in range(int(begin // bin_s), min(int((begin + seconds) // bin_s) + 1, num_bins)):
            overlap = min(begin + seconds, (i + 1) * bin_s) - max(begin, i * bin_s)
            if overlap > 0:  # a sample across two bins: each its share
                tokens[worker][i] += num_tokens * overlap / seconds
                finished[worker][i] += num_finished * overlap / seconds
                covered[worker][i] += overlap
    # A worker's rate in a bin is over the time it ran there (a run's first and last bins are partly empty);
    # all workers' rate is the sum of theirs. Commit times say nothing of that: over the whole bin.
    spans = {w: np.clip(covered[w], 1e-9, bin_s) if source == "samples" else np.full(num_bins, float(bin_s))
             for w in tokens}
    rates = {w: tokens[w] / spans[w] for w in tokens}
    series = [{"worker_id": w, "output_tok_per_s": _round(rates[w]),
               "requests_per_s": _round(finished[w] / spans[w], 3),
               "seconds_run": _round(covered[w], 3) if source == "samples" else None} for w in sorted(tokens)]
    series.append({"worker_id": "all", "output_tok_per_s": _round(sum(rates.values())),
                   "requests_per_s": _round(sum(finished[w] / spans[w] for w in tokens), 3)})
    return {"source": source, "bin_s": bin_s, "start": iso_utc(start), "end": iso_utc(end), "series": series,
            "gaps": gaps(events) if source == "samples" else []}


def gaps(events: list[tuple]) -> list[dict[str, Any]]:
    """Stretches where no worker ran anything for the job, longer than three samples (a stop and a resume, a
    worker killed and its successor, the database away)."""
    spans = sorted((at, at + timedelta(seconds=seconds)) for at, seconds, *_ in events)
    typical = float(np.median([seconds for _, seconds, *_ in events]))
    out, covered = [], spans[0][1]
    for begin, finish in spans[1:]:
        if (begin - covered).total_seconds() > max(3 * typical, GAP_FLOOR_S):
            out.append({"from": iso_utc(covered), "to": iso_utc(begin),
                        "seconds": round((begin - covered).total_seconds(), 1)})
        covered = max(covered, finish)
    return out


def engine_series(samples: list[Any], throughput: dict[str, Any]) -> dict[str, Any]:
    """Per worker, in the throughput's bins: running sequences (mean over the bin's steps), KV blocks held
    (the bin's highest share) and preemptions; None in bins where the worker ran nothing."""
    out: dict[str, Any] = {"num_samples": len(samples), "num_preemptions": int(sum(s.num_preemptions for s in samples)),
                           "series": []}
    if not samples or throughput["bin_s"] is None:
        return out
    start, bin_s = datetime.fromisoformat(throughput["start"].rstrip("Z")), throughput["bin_s"]
    num_bins = len(throughput["series"][-1]["output_tok_per_s"])
    by_worker: dict[str, list[Any]] = defaultdict(list)
    for s in samples:
        by_worker[s.worker_id].append(s)
    for worker, mine in sorted(by_worker.items()):
        steps, running, kv, preempted = (np.zeros(num_bins) for _ in range(4))
        for s in mine:
            i = min(int(((s.started_at - start).total_seconds() + s.seconds / 2) // bin_s), num_bins - 1)
            steps[i] += s.num_steps
            running[i] += s.mean_running * s.num_steps
            kv[i] = max(kv[i], s.max_kv_usage)
            preempted[i] += s.num_preemptions
        ran = steps > 0
        out["series"].append({
            "worker_id": worker,
            "mean_running": [round(r / n, 2) if n else None for r, n in zip(running, steps, strict=True)],
            "max_kv_usage": [round(float(k), 4) if r else None for k, r in zip(kv, ran, strict=True)],
            "num_preemptions": [int(p) for p in preempted]})
    return out


# ---------------------------------------------------------------------------------------------- per request

def distributions(outcomes: list[Any]) -> dict[str, Any]:
    """Prompt tokens (every request), output tokens, time to first token and latency (committed results)."""
    columns = {"prompt_tokens": [o.num_prompt_tokens for o in outcomes],
               "output_tokens": [o.num_output_tokens for o in outcomes if o.finish_reason is not None],
               "time_to_first_token_s": [o.time_to_first_token_s for o in outcomes
                                         if o.time_to_first_token_s is not None],
               "latency_s": [o.latency_s for o in outcomes if o.latency_s is not None]}
    return {name: describe(np.asarray(values, dtype=float), integer=name.endswith("tokens"))
            for name, values in columns.items()}


def describe(values: np.ndarray, integer: bool) -> dict[str, Any]:
    if values.size == 0:
        return {"count": 0}
    low, high = float(values.min()), float(values.max())
    if integer:
        step = max(1, int(np.ceil((high - low + 1) / NUM_HISTOGRAM_BINS)))
        edges = np.arange(low, high + step + 1, step) - 0.5
    else:
        edges = np.linspace(low, high if high > low else low + 1e-3, NUM_HISTOGRAM_BINS + 1)
    counts, edges = np.histogram(values, bins=edges)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    exact = int if integer else (lambda v: round(float(v), 4))  # token counts stay whole numbers
    return {"count": int(values.size), "sum": exact(values.sum()), "mean": round(float(values.mean()), 4),
            "min": exact(low), "p50": round(float(p50), 4), "p90": round(float(p90), 4),
            "p99": round(float(p99), 4), "max": exact(high),
            "histogram": {"edges": _round(edges, 4), "counts": [int(c) for c in counts]}}


def finish_reasons(outcomes: list[Any], asked_for_length: bool = False) -> dict[str, Any]:
    """Completed results by finish reason, failed requests as "error"; shares of the finished; a warning when
    more than a tenth were cut by max_new_tokens (none where the job asked for that: --ignore-eos)."""
    counts: dict[str, int] = defaultdict(int)
    unfinished = 0
    for o in outcomes:
        if o.finish_reason is not None:
            counts[o.finish_reason] += 1
        elif o.state == RequestState.FAILED.value:
            counts[FinishReason.ERROR] += 1
        else:
            unfinished += 1
    finished = sum(counts.values())
    shares = {reason: round(n / finished, 4) for reason, n in counts.items()} if finished else {}
    completed = finished - counts.get(FinishReason.ERROR, 0)
    length_share = counts.get(FinishReason.LENGTH, 0) / completed if completed else 0.0
    warning = (f"{counts[FinishReason.LENGTH]:,} of {completed:,} outputs ({length_share:.0%}) were cut by "
               "max_new_tokens: give the budget room (--max-new-tokens)") \
        if length_share > LENGTH_WARNING_SHARE and not asked_for_length else None
    return {"counts": dict(sorted(counts.items())), "shares": dict(sorted(shares.items())), "num_finished": finished,
            "num_unfinished": unfinished, "length_share": round(length_share, 4), "warning": warning}


def failure_groups(failed: list[Any], job_id: int, num_examples: int = 3) -> dict[str, Any]:
    """Failed requests grouped by reason (numbers in the message aside: "the prompt has 5000 tokens" and
    "... 7000 tokens" are one reason), largest first, with a few rows each and the command that retries them."""
    groups: dict[tuple[str, bool], list[Any]] = defaultdict(list)
    for f in failed:
        groups[re.sub(r"\d+", "N", f.error or "unknown"), bool(f.retryable)].append(f)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0].row))
    num_retryable = sum(1 for f in failed if f.retryable)
    return {"num_failed": len(failed), "num_retryable": num_retryable,
            "retry": f"bulkgen retry {job_id}" if num_retryable else None,
            "groups": [{"reason": g[0].error or "unknown", "count": len(g), "retryable": bool(g[0].retryable),
                        "examples": [{"row": f.row, "sample": f.sample, "custom_id": f.custom_id, "error": f.error}
                                     for f in g[:num_examples]]} for g in ordered]}


def schema_validity(session: Session, job_id: int, job_schema: str | None, schema_column: str | None,
                    page_size: int = 5000) -> dict[str, Any] | None:
    """For a constrained job: how many committed outputs are complete (ended by the grammar or a stop, not
    cut by max_new_tokens) and valid JSON against their schema (the `jsonschema` package where installed,
    else parsed only)."""
    if job_schema is None and schema_column is None:
        return None
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    validators: dict[str, Any] = {}
    num_outputs = num_complete = num_valid = 0
    invalid: list[dict[str, Any]] = []
    after = 0
    while page := reads.constrained_page(session, job_id, after, page_size):
        after = page[-1].id
        for _, text, finish_reason, params in page:
            schema = ((params or {}).get("sampling") or {}).get("json_schema") or job_schema
            if schema is None:
                continue
            num_outputs += 1
            if finish_reason == FinishReason.LENGTH:
                continue
            num_complete += 1
            problem = _schema_problem(text, schema, validators, jsonschema)
            if problem is None:
                num_valid += 1
            elif len(invalid) < NUM_EXAMPLES:
                invalid.append({"text": text[:300], "problem": problem})
    return {"num_outputs": num_outputs, "num_complete": num_complete, "num_valid": num_valid,
            "complete_share": round(num_complete / num_outputs, 4) if num_outputs else None,
            "valid_share": round(num_valid / num_outputs, 4) if num_outputs else None,
            "checked_with": "jsonschema" if jsonschema is not None else "json.loads (install jsonschema to validate)",
            "invalid_examples": invalid}


def _schema_problem(text: str, schema: str, validators: dict[str, Any], jsonschema: Any) -> str | None:
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if jsonschema is None:
        return None
    if schema not in validators:
        loaded = json.loads(schema)
        validators[schema] = jsonschema.validators.validator_for(loaded)(loaded)
    error = next(iter(validators[schema].iter_errors(value)), None)
    return None if error is None else f"{error.message} (at {'/'.join(map(str, error.absolute_path)) or 'top'})"


def examples(session: Session, job_id: int, num_examples: int) -> dict[str, list[dict[str, Any]]]:
    """The first rows and rows at random (the same ones each time for a job), prompt beside output."""
    total = reads.num_rows(session, job_id)
    first = list(range(min(num_examples, total)))
    rest = range(len(first), total)
    chosen = sorted(random.Random(job_id).sample(rest, min(num_examples, len(rest))))

    def shown(row_ids: list[int]) -> list[dict[str, Any]]:
        return [{"row": r.row, "sample": r.sample, "state": r.state, "prompt": r.prompt, "output": r.text,
                 "finish_reason": r.finish_reason, "num_output_tokens": r.num_output_tokens, "error": r.error}
                for r in reads.rows(session, job_id, row_ids)] if row_ids else []

    return {"first": shown(first), "random": shown(chosen)}


def _round(values: Any, digits: int = 2) -> list[float]:
    return [round(float(v), digits) for v in values]
