"""The Python API: what the CLI gives, with the same names.

    import bulkgen
    job = bulkgen.submit("prompts.parquet", prompt_column="question", max_new_tokens=128)
    bulkgen.run()                         # the worker loop, until the queue is empty
    job.status()["counts"]                # as `bulkgen status --json`
    table = job.results()                 # as `bulkgen export`: a pyarrow.Table, input order
    bulkgen.generate(["Hello", "Hi"], max_new_tokens=16)   # in memory, no database: for notebooks and tests

Options are the CLI's flags with underscores (`prompt_column`, `max_new_tokens`, `kv_cache_memory="2GiB"`,
...); errors are the exception types the CLI turns into exit codes (bulkgen.errors: ConfigError, InputError,
ModelError, StoreError, NotFoundError, all BulkgenError).
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bulkgen.config import EngineConfig, Paths, SamplingParams, request_sampling, request_seed
from bulkgen.engine.protocol import FinishReason
from bulkgen.errors import ConfigError
from bulkgen.io.export import RESULT_SCHEMA, export_job
from bulkgen.io.rows import check_columns
from bulkgen.jobspec import JobSpec, build_spec
from bulkgen.outage import open_store_waiting
from bulkgen.packing import admission_for, order
from bulkgen.prompts import PromptRenderer
from bulkgen.resolve import default_model, resolve_model
from bulkgen.store import jobs as job_ops
from bulkgen.store.db import open_store
from bulkgen.store.models import unpack_ids
from bulkgen.store.packings import DEFAULT_PACKING
from bulkgen.submission import submit_job
from bulkgen.worker import Worker, WorkerOptions

OUTPUT_COLUMNS = ("output", "finish_reason", "num_prompt_tokens", "num_output_tokens", "error")  # as export's


@dataclass(frozen=True)
class Job:
    """A submitted job in a database."""

    id: int
    db: str

    def status(self) -> dict[str, Any]:
        """As `bulkgen status JOB --json`: status, counts by state, tokens, throughput, ..."""
        with open_store(self.db).session_scope() as session:
            return job_ops.describe_jobs(session, [job_ops.get_job(session, self.id)])[0]

    def results(self, include_inputs: bool = True, include_token_ids: bool = False) -> Any:
        """As `bulkgen export`: a pyarrow.Table, one row per request in input order, the input's columns
        joined (what is committed so far, if the job is still running)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.parquet"
            export_job(open_store(self.db), self.id, out, include_inputs=include_inputs,
                       include_token_ids=include_token_ids)
            return pq.read_table(out)

    def cancel(self) -> int:
        """As `bulkgen cancel`: the requests cancelled."""
        with open_store(self.db).session_scope(write=True) as session:
            return job_ops.cancel_job(session, self.id)

    def retry(self) -> int:
        """As `bulkgen retry`: the failed requests queued again."""
        with open_store(self.db).session_scope(write=True) as session:
            return job_ops.retry_job(session, self.id)

    def run(self, progress: bool = False, **options: Any) -> dict[str, Any]:
        """As `bulkgen run JOB --db ITS_DB`: this job, in its own database, until nothing of it is pending."""
        return run([self.id], db=self.db, progress=progress, **options)


_SUBMITTED: dict[str, list[int]] = {}  # the jobs this process submitted, by database: run() without db says so


def submit(source: str | Path | Any | Sequence[Any], db: str | None = None, **options: Any) -> Job:
    """Submit a job, as `bulkgen submit`. `source`: a path (Parquet, JSONL, CSV, an OpenAI batch file or a job
    file), a pyarrow.Table, or a list of prompts (strings) or of conversations (lists of {role, content}).
    A table or list is kept as a Parquet file under bulkgen's data folder (export joins its columns)."""
    path = _as_file(source, options)
    url = db or Paths().default_db_url
    spec = build_spec(path, {k: v for k, v in options.items() if v is not None})
    report = submit_job(open_store(url), spec)
    _SUBMITTED.setdefault(url, []).append(report.job_id)
    return Job(report.job_id, url)


def run(job_ids: Sequence[int | Job] | None = None, db: str | None = None, progress: bool = False,
        **options: Any) -> dict[str, Any]:
    """Run queued jobs (all, or these: ids or Jobs) until nothing of them is pending, as `bulkgen run`; returns
    its summary (as `bulkgen run --json`). The database: `db`, else the one the Jobs given live in, else the
    default (BULKGEN_DB or bulkgen's data folder). Options: the engine's (dtype, kv_cache_memory, max_num_seqs,
    ...) and the worker's (lease_seconds, commit_every, packing, ...): `bulkgen run`'s flags, with underscores."""
    ids, db = _jobs_and_db(job_ids, db)
    engine_keys = {f.name for f in fields(EngineConfig)}
    worker_keys = {f.name for f in fields(WorkerOptions)} - {"job_ids", "progress"}
    unknown = sorted(set(options) - engine_keys - worker_keys)
    if unknown:
        raise ConfigError(f"unknown run option(s) {unknown}; engine: {sorted(engine_keys)}, worker: "
                          f"{sorted(worker_keys)}")
    engine = EngineConfig.from_options({k: v for k, v in options.items() if k in engine_keys})
    worker = WorkerOptions(job_ids=ids, progress=progress, **{k: v for k, v in options.items() if k in worker_keys})
    store = open_store_waiting(db, worker.db_outage_s)
    return Worker(store, engine, worker).run().to_dict()


def _jobs_and_db(jobs: Sequence[int | Job] | None, db: str | None) -> tuple[tuple[int, ...], str]:
    """The job ids and the database run() works; a warning where jobs this process submitted lie elsewhere."""
    jobs = list(jobs or ())
    homes = {job.db for job in jobs if isinstance(job, Job)}
    if db is None and len(homes) > 1:
        raise ConfigError(f"the jobs given live in {len(homes)} databases ({', '.join(sorted(homes))}): run each "
                          "database's jobs on their own (job.run() runs one job in its database)")
    if db is not None and homes - {db}:
        raise ConfigError(f"job(s) given live in {', '.join(sorted(homes - {db}))}, not in db={db!r}")
    url = db or (homes.pop() if homes else Paths().default_db_url)
    if db is None and not jobs:
        elsewhere = {home: ids for home, ids in _SUBMITTED.items() if home != url}
        if elsewhere:
            where = "; ".join(f"job(s) {', '.join(map(str, ids))} in {home}" for home, ids in elsewhere.items())
            warnings.warn(f"bulkgen.run() works the default database {url}, but this process submitted {where}: "
                          "pass db=..., or call job.run()", stacklevel=3)
    return tuple(job.id if isinstance(job, Job) else int(job) for job in jobs), url


def generate(prompts: Sequence[Any], model: str | None = None, engine: dict[str, Any] | None = None,
             **sampling: Any) -> list[dict[str, Any]]:
    """Run prompts (strings, or conversations: lists of {role, content}) through the engine in memory, no
    database; one dict per prompt, in order, with export's output columns (output, finish_reason,
    num_prompt_tokens, num_output_tokens, error). `sampling`: max_new_tokens, temperature, top_p, ..., seed;
    `chat=True` renders string prompts with the chat template; `engine`: EngineConfig's fields."""
    prompts = list(prompts)
    if not prompts:
        return []
    chat = bool(sampling.pop("chat", False))
    system_prompt = sampling.pop("system_prompt", None)
    conversations = not isinstance(prompts[0], str)
    column = "messages" if conversations else "prompt"
    stage = Generate(model=model, prompt_column=None if conversations else "prompt",
                     messages_column="messages" if conversations else None, chat=chat, system_prompt=system_prompt,
                     sampling=sampling, engine=engine)
    table = stage(pa.table({column: prompts}))
    return table.select(list(OUTPUT_COLUMNS)).to_pylist()


def _as_file(source: Any, options: dict[str, Any]) -> Path:
    """A path as it is; a table or list written once to a Parquet file of its own."""
    if isinstance(source, (str, Path)):
        return Path(source)
    if isinstance(source, pa.Table):
        table = source
    elif isinstance(source, Sequence) and source:
        if all(isinstance(p, str) for p in source):
            table = pa.table({"prompt": list(source)})
            options.setdefault("prompt_column", "prompt")
        elif all(isinstance(p, list) for p in source):
            table = pa.table({"messages": list(source)})
            options.setdefault("messages_column", "messages")
        else:
            raise ConfigError("submit takes a list of prompts (strings) or of conversations (lists of {role, "
                              "content}), not a mix")
    else:
        raise ConfigError(f"submit takes a path, a pyarrow.Table or a non-empty list of prompts; got "
                          f"{type(source).__name__}")
    folder = Paths().data_dir / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"input-{uuid.uuid4().hex[:12]}.parquet"
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


class Generate:
    """bulkgen's engine over tables in memory, no database: `bulkgen.generate` calls it, and it is the Ray Data
    stage (`dataset.map_batches(Generate, fn_constructor_kwargs={...}, batch_format="pyarrow", concurrency=N,
    num_gpus=1)`, or `bulkgen.ray.generate(dataset, ...)`). Each table comes back with export's output columns
    added (output, finish_reason, num_prompt_tokens, num_output_tokens,
    error): prompts rendered and checked as `submit` does, run together through one continuous-batching
    engine (one per Ray actor). A bad row gets its error and the batch goes on.

    Options are submit's and run's: model, prompt_column / messages_column, chat, system_prompt,
    max_new_tokens_column, sampling (a dict of SamplingParams fields: max_new_tokens, temperature, top_p,
    ..., seed), engine (a dict of EngineConfig fields: dtype, kv_cache_memory, max_num_seqs, ...). A sampled
    row's seed derives from the job seed and the row's prompt, so it does not depend on Ray's batching."""

    def __init__(self, model: str | None = None, prompt_column: str | None = None,
                 messages_column: str | None = None, chat: bool = False, system_prompt: str | None = None,
                 max_new_tokens_column: str | None = None, sampling: dict[str, Any] | None = None,
                 engine: dict[str, Any] | None = None, packing: str = DEFAULT_PACKING) -> None:
        from bulkgen.engine.engine import Engine  # here: `import bulkgen` stays free of torch

        self.spec = JobSpec(input=Path("<ray dataset>"), model=model or default_model(), prompt_column=prompt_column,
                            messages_column=messages_column, chat=chat, system_prompt=system_prompt,
                            max_new_tokens_column=max_new_tokens_column,
                            sampling=SamplingParams.from_dict({"seed": 0, **(sampling or {})}))
        resolved = resolve_model(self.spec.model)
        self.renderer = PromptRenderer(self.spec, resolved.path)
        self.packing = packing
        self.engine = Engine(resolved.path, EngineConfig.from_options(engine or {}), tokenizer=self.renderer.tokenizer,
                             admission=admission_for(packing, True))

    def __call__(self, batch: Any) -> Any:
        table = batch if isinstance(batch, pa.Table) else pa.table(batch)
        check_columns(table.schema, self.spec.columns, "the table")
        rows = self.renderer.table_rows(0, table.combine_chunks().to_batches()[0] if table.num_rows else
                                        pa.RecordBatch.from_pylist([], schema=table.schema), first_row=0)
        out: dict[str, list[Any]] = {name: [None] * table.num_rows for name in OUTPUT_COLUMNS}
        job = self.spec.sampling
        entries = []
        for row in rows:
            i = row["row"]
            out["num_prompt_tokens"][i] = row["num_prompt_tokens"]
            if row["error"] is not None:
                out["error"][i] = row["error"]
                continue
            ids = unpack_ids(row["prompt_token_ids"])
            # the seed follows the prompt, not its place in a batch that Ray cut
            entries.append((i, ids, request_sampling(job, (row["params"] or {}).get("sampling"),
                                                     max_new_tokens=row["max_new_tokens"],
                                                     seed=request_seed(job.seed, ids))))
        # in the packer's order, as a worker claims them (lpt: shared prompt prefixes together)
        for i, ids, params in order(entries, self.packing, prompt_len=lambda e: len(e[1]),
                                    max_new=lambda e: e[2].max_new_tokens, prompt_ids=lambda e: e[1]):
            self.engine.add(i, ids, params)
        while self.engine.has_unfinished():
            for result in self.engine.step():
                i = result.request_id
                if result.finish_reason == FinishReason.ERROR:  # as export: the error, no output
                    out["error"][i] = result.error or "generation failed"
                else:
                    out["output"][i] = result.text
                    out["num_output_tokens"][i] = len(result.output_token_ids)
                out["finish_reason"][i] = result.finish_reason
        for name in OUTPUT_COLUMNS:  # typed as export types them
            column = pa.array(out[name], type=RESULT_SCHEMA.field(name).type)
            table = table.set_column(table.schema.get_field_index(name), name, column) \
                if name in table.column_names else table.append_column(name, column)
        return table
