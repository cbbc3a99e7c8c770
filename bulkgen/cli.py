"""The `bulkgen` command line. The only place that turns errors into messages and exit codes:
0 success, 2 usage or input error, 1 anything else."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bulkgen.config import Paths, SamplingParams
from bulkgen.errors import BulkgenError
from bulkgen.packing import DEFAULT_POLICY, POLICIES

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
JOB_ID_RULE = "a job id is a positive integer (see `bulkgen list`)"


class JobIdType(click.ParamType):
    name = "JOB_ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value)
        if not text.isdigit() or int(text) < 1:
            self.fail(f"{JOB_ID_RULE}, got {text!r}", param, ctx)
        return int(text)


JOB_ID = JobIdType()


class JobCommand(click.Command):
    """A command taking job ids: `status -1` is a bad job id, not an unknown option `-1`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if exc.option_name.lstrip("-").isdigit():
                raise click.BadParameter(f"{JOB_ID_RULE}, got {exc.option_name!r}", ctx=ctx,
                                         param_hint="JOB_ID") from exc
            raise


class BulkgenGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BulkgenError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=BulkgenGroup, context_settings=CONTEXT)
@click.version_option(package_name="bulkgen")
def cli() -> None:
    """bulkgen: run a language model over a whole dataset as a resumable overnight job.

    \b
    Example:
      bulkgen submit examples/data/prompts.parquet --chat --max-new-tokens 128 --name demo
      bulkgen run
      bulkgen export 1 -o demo.out.parquet
    """


def db_option(func: Callable) -> Callable:
    @click.option("--db", "db_url", envvar="BULKGEN_DB", metavar="URL",
                  help="Database URL (env BULKGEN_DB). Default: sqlite:///~/.local/share/bulkgen/bulkgen.db")
    @functools.wraps(func)
    def wrapper(*args: Any, db_url: str | None, **kwargs: Any) -> Any:
        return func(*args, db_url=db_url or Paths().default_db_url, **kwargs)

    return wrapper


def json_option(func: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def open_db(db_url: str):
    from bulkgen.store import open_store

    return open_store(db_url)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# ---------------------------------------------------------------------------------------------- submit


@cli.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--name", help="A name for the job.")
@click.option("--model", help="Alias, .gguf file or Hugging Face directory. Default: smollm2-135m-instruct.")
@click.option("--prompt-column", help="Column of raw prompt text (default: prompt).")
@click.option("--messages-column", help="Column of chat messages: a list of {role, content}.")
@click.option("--id-column", help="Column of your own row ids, kept in the results.")
@click.option("--max-new-tokens-column", help="Integer column with each row's own token budget.")
@click.option("--system-prompt", help="System message put before each conversation (chat rendering).")
@click.option("--chat/--no-chat", default=None, help="Render raw prompts as a user message with the chat template.")
@click.option("--n", type=int, help="Samples per row (needs --temperature > 0). Default 1.")
@click.option("--max-new-tokens", type=int, help="Tokens to generate at most per request. Default 128.")
@click.option("--temperature", type=float, help="0 (default) is greedy.")
@click.option("--top-p", type=float, help="Nucleus sampling, in (0, 1]. Default 1.")
@click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 (default) is off.")
@click.option("--min-p", type=float, help="Drop tokens below min-p × the top probability; 0 is off.")
@click.option("--repetition-penalty", type=float, help="> 1 discourages repeats; 1 (default) is off.")
@click.option("--frequency-penalty", type=float, help="OpenAI's: in [-2, 2], minus this x each token's count in "
                                                    "the output so far; 0 (default) is off.")
@click.option("--presence-penalty", type=float, help="OpenAI's: in [-2, 2], minus this for each token already in the "
                                                   "output; 0 (default) is off.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); removed from the output.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable).")
@click.option("--seed", type=int, help="Job seed; each request derives its own from it. Default 0.")
@click.option("--ignore-eos/--no-ignore-eos", default=None, help="Generate exactly max-new-tokens (benchmarks).")
@click.option("--logprobs", type=int, help="Keep the chosen token's log-probability and this many alternatives.")
@click.option("--json-schema", metavar="FILE_OR_JSON",
              help="Every output is JSON valid against this schema (a file, or the schema's JSON text).")
@click.option("--json-schema-column", help="String column with each row's own JSON schema.")
@click.option("--add-special-tokens/--no-add-special-tokens", default=None,
              help="Tokenizer special tokens (BOS). Default: on for raw text, off for chat-rendered text.")
@click.option("--input-format", type=click.Choice(("auto", "parquet", "jsonl", "csv", "openai")),
              help="What the input file is. Default auto: .parquet, .jsonl/.ndjson, .csv by name (else by its "
                   "first bytes); a JSONL file of OpenAI batch requests is read as one.")
@json_option
@db_option
def submit(source: Path, as_json: bool, db_url: str, **options: Any) -> None:
    """Submit a Parquet, JSONL or CSV file of rows (or a job file, jobs/*.toml) as a job.

    Checks the file, its columns and every flag before writing anything. A bad row (null or empty
    prompt, a prompt too long for the model) becomes a failed request with its reason; the rest of
    the job goes on. Flags override a job file's settings.

    \b
    Example:
      bulkgen submit data.parquet --prompt-column question --max-new-tokens 256 --name qa
      bulkgen submit data.parquet --messages-column messages --temperature 0.7 --n 4
      bulkgen submit jobs/demo.toml --max-new-tokens 64
      bulkgen submit rows.jsonl --prompt-column text        # or rows.csv: streamed, same checks
    """
    from bulkgen.jobspec import build_spec
    from bulkgen.submission import submit_job

    spec = build_spec(source, options)
    store = open_db(db_url)
    with _row_progress("submit", unit="rows", enabled=not as_json) as advance:
        report = submit_job(store, spec, log=lambda m: click.echo(m, err=True), on_rows=advance)
    if as_json:
        emit_json(report.to_dict())
        return
    failed = f", {report.num_failed} refused (see `bulkgen status {report.job_id}`)" if report.num_failed else ""
    click.echo(f"job {report.job_id}: {report.num_requests} requests from {report.num_rows} rows{failed}; "
               f"{report.num_prompt_tokens:,} prompt tokens; submitted in {report.seconds:.1f} s")
    click.echo(f"next: bulkgen run {report.job_id}")


# ----------------------------------------------------------------------------------------- list, status


@cli.command("list", context_settings=CONTEXT)
@click.option("--limit", type=int, default=50, show_default=True, help="Newest jobs first, at most this many.")
@json_option
@db_option
def list_cmd(limit: int, as_json: bool, db_url: str) -> None:
    """List jobs, newest first, with their progress.

    \b
    Example:
      bulkgen list
      bulkgen list --json | jq '.[] | select(.status == "running") | .id'
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope() as session:
        summaries = job_ops.describe_jobs(session, job_ops.list_jobs(session, limit))
    if as_json:
        emit_json(summaries)
        return
    if not summaries:
        click.echo("no jobs yet: `bulkgen submit FILE.parquet` creates one")
        return
    click.echo(f"{'ID':>4}  {'NAME':<20} {'STATUS':<10} {'DONE':>13} {'FAILED':>7}  {'CREATED':<20} MODEL")
    for s in summaries:
        done = f"{s['counts']['completed']}/{s['total']}"
        click.echo(f"{s['id']:>4}  {(s['name'] or '-')[:20]:<20} {s['status']:<10} {done:>13} "
                   f"{s['counts']['failed']:>7}  {s['created_at']:<20} {s['model']}")


@cli.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@json_option
@db_option
def status(job_id: int, as_json: bool, db_url: str) -> None:
    """Show a job: requests by state, tokens so far, throughput and ETA.

    \b
    Example:
      bulkgen status 1
      bulkgen status 1 --json | jq .counts.completed
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope() as session:
        summary = job_ops.describe_jobs(session, [job_ops.get_job(session, job_id)])[0]
        errors = job_ops.first_errors(session, job_id) if not as_json else []
    if as_json:
        emit_json(summary)
        return
    c = summary["counts"]
    click.echo(f"job {summary['id']}" + (f" ({summary['name']})" if summary["name"] else "")
               + f": {summary['status']} · model {summary['model']}")
    click.echo(f"requests: {summary['total']} total · {c['completed']} completed · {c['failed']} failed · "
               f"{c['pending']} pending · {c['running']} running · {c['cancelled']} cancelled")
    rate = f" · {summary['output_tok_per_s']} output tok/s" if summary["output_tok_per_s"] is not None else ""
    eta = f" · ETA {_duration(summary['eta_s'])}" if summary["eta_s"] is not None else ""
    click.echo(f"tokens: {summary['num_prompt_tokens']:,} prompt · {summary['num_output_tokens']:,} output"
               f"{rate}{eta}")
    for row, sample, error in errors:
        click.echo(f"  failed row {row}" + (f" sample {sample}" if sample else "") + f": {error}")


# ------------------------------------------------------------------------------------------ run, export


def engine_options(func: Callable) -> Callable:
    """Engine limits shared by `run` and `bench` (defaults: EngineConfig's own)."""
    from bulkgen.config import ATTENTION_BACKENDS, DTYPES, EngineConfig

    default = EngineConfig()
    options = [
        click.option("--dtype", type=click.Choice(DTYPES), default=default.dtype,
                     show_default=True, help="Weights, activations and KV cache."),
        click.option("--device", default=default.device, show_default=True, help="cpu, cuda, cuda:N or auto."),
        click.option("--kv-cache-memory", metavar="SIZE",
                     help="KV cache size, e.g. 2GiB (default: 4GiB or a quarter of free RAM on CPU; "
                          "--gpu-memory-utilization on a GPU)."),
        click.option("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization,
                     show_default=True, help="Share of GPU memory for weights and KV cache."),
        click.option("--max-num-seqs", type=int, default=default.max_num_seqs, show_default=True,
                     help="Sequences running at once."),
        click.option("--max-num-batched-tokens", type=int, default=default.max_num_batched_tokens, show_default=True,
                     help="Tokens computed per engine step (the token budget)."),
        click.option("--max-model-len", type=int, help="Cap on prompt + output tokens (default: the model's)."),
        click.option("--block-size", type=int, default=default.block_size, show_default=True,
                     help="Tokens per KV block."),
        click.option("--attention-backend", type=click.Choice(ATTENTION_BACKENDS), default=default.attention_backend,
                     show_default=True, help="kernel: bulkgen's C kernels (CPU); torch: pure torch; triton: the "
                                             "Triton kernels (a GPU's default; on a CPU only in Triton's interpreter)."),
        click.option("--kernels", default=default.kernels, envvar="BULKGEN_KERNELS", show_default=True, metavar="SPEC",
                     help="CPU path of each kernel family (linear, gated_mlp, decode_attention, prefill_attention, "
                          "small_ops, sampler): auto (the faster, measured once on this machine), c, torch, or pairs such "
                          "as linear=torch,attention=c. Also read from BULKGEN_KERNELS."),
        click.option("--num-threads", type=int, help="CPU threads for torch (default: all cores)."),
        click.option("--prefix-caching/--no-prefix-caching", default=default.enable_prefix_caching, show_default=True,
                     help="Share KV blocks of common prompt prefixes."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=default.cuda_graphs, show_default=True,
                     help="GPU: replay decode steps as CUDA graphs captured per batch-size bucket "
                          "(1, 2, 4, ... --max-num-seqs)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_engine_config(options: dict[str, Any]):
    from bulkgen.config import EngineConfig, parse_size

    kv = options.pop("kv_cache_memory")
    return EngineConfig(
        dtype=options.pop("dtype"), device=options.pop("device"),
        kv_cache_memory=parse_size(kv) if kv else None,
        gpu_memory_utilization=options.pop("gpu_memory_utilization"),
        max_num_seqs=options.pop("max_num_seqs"), max_num_batched_tokens=options.pop("max_num_batched_tokens"),
        max_model_len=options.pop("max_model_len"), block_size=options.pop("block_size"),
        attention_backend=options.pop("attention_backend"), kernels=options.pop("kernels"),
        num_threads=options.pop("num_threads"),
        enable_prefix_caching=options.pop("prefix_caching"), cuda_graphs=options.pop("cuda_graphs"),
    )


@cli.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_ids", type=JOB_ID, nargs=-1)
@engine_options
@click.option("--lease-seconds", type=float, default=60.0, show_default=True,
              help="A request's lease; a worker that stops heart-beating loses its requests after this.")
@click.option("--commit-every", type=int, default=256, show_default=True, help="Commit after this many results...")
@click.option("--commit-interval", type=float, default=2.0, show_default=True, help="...or this many seconds.")
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="A request abandoned by this many crashed workers fails instead of returning.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGINT/SIGTERM: seconds running requests may take to finish before being released.")
@click.option("--packing", type=click.Choice(POLICIES), default=DEFAULT_POLICY, show_default=True,
              help="Admission order: lpt = most output tokens first; sorted = by prompt length; fifo = as submitted.")
@click.option("--kv-admission/--no-kv-admission", default=True, show_default=True,
              help="Admit a request only if the KV cache can hold it to its end (avoids preemption).")
@click.option("--wait", is_flag=True, help="Keep waiting for new jobs instead of exiting when the queue is empty.")
@click.option("--log-every", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds between progress lines when not on a terminal (0: a line every engine step).")
@click.option("--progress/--no-progress", default=True, help="Show progress on stderr.")
@click.option("-v", "--verbose", is_flag=True,
              help="Say more on stderr: the CPU, and which path (C or torch) each kernel family took and why.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Run the workers as Ray actors on a Ray cluster, all on this --db queue (bulkgen[ray]).")
@click.option("--workers", type=int, help="With --ray: how many workers (default: one per GPU Ray sees, else 1).")
@click.option("--ray-address", metavar="ADDR",
              help="With --ray: the cluster's head (default: a running cluster if any, else a local one).")
@click.option("--gpus-per-worker", type=float, help="With --ray: GPUs of each worker (default: 1 if the cluster "
                                                    "has GPUs, else 0).")
@click.option("--cpus-per-worker", type=float, default=1.0, show_default=True, help="With --ray: CPUs of each worker.")
@click.option("--max-restarts", type=int, default=3, show_default=True,
              help="With --ray: how often Ray restarts a worker whose process died.")
@json_option
@db_option
def run(job_ids: tuple[int, ...], as_json: bool, db_url: str, lease_seconds: float, commit_every: int,
        commit_interval: float, max_attempts: int, drain_timeout: float, packing: str, kv_admission: bool, wait: bool,
        log_every: float, progress: bool, verbose: bool, use_ray: bool, workers: int | None, ray_address: str | None,
        gpus_per_worker: float | None, cpus_per_worker: float, max_restarts: int, **engine: Any) -> None:
    """Run queued jobs (all, or the given ones) until the queue is empty.

    Results are committed as they finish: kill the worker at any moment and run it again, and it
    carries on where it stopped, losing only what was in flight. SIGINT or SIGTERM stop it cleanly
    (a second Ctrl-C stops at once). Several workers may share one database.

    \b
    Example:
      bulkgen run
      bulkgen run 3 --kv-cache-memory 2GiB --max-num-seqs 64
      nohup bulkgen run --wait > worker.log 2>&1 &
      bulkgen run -v --kernels linear=torch     # the linear layers in torch; say why each path
      bulkgen run --ray --db postgresql+psycopg://user@host/bulkgen   # a worker per GPU of the Ray cluster
    """
    import logging

    from bulkgen.worker import Worker, WorkerOptions

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if verbose:
        logging.getLogger("bulkgen").setLevel(logging.INFO)
    options = WorkerOptions(job_ids=job_ids, lease_s=lease_seconds, commit_rows=commit_every,
                            commit_interval_s=commit_interval, max_attempts=max_attempts,
                            drain_timeout_s=drain_timeout, packing=packing, kv_admission=kv_admission, wait=wait,
                            progress=progress and not as_json, log_every_s=log_every)
    engine_config = build_engine_config(engine)  # a bad flag is refused before the database is touched
    ray_flags = {"--workers": workers, "--ray-address": ray_address, "--gpus-per-worker": gpus_per_worker}
    if not use_ray and any(value is not None for value in ray_flags.values()):
        raise click.UsageError(f"{', '.join(k for k, v in ray_flags.items() if v is not None)} go with --ray")
    if use_ray:
        from bulkgen.ray import RayOptions, require_ray

        ray_options = RayOptions(workers, ray_address, gpus_per_worker, cpus_per_worker, max_restarts)
        require_ray()
    store = open_db(db_url)
    if job_ids:
        from bulkgen.store import jobs as job_ops

        with store.session_scope() as session:
            for job_id in job_ids:
                job_ops.get_job(session, job_id)
    if use_ray:
        _run_on_ray(store, db_url, engine_config, options, ray_options, progress and not as_json, as_json)
        return
    summary = Worker(store, engine_config, options).run()
    if as_json:
        emit_json(summary.to_dict())
    else:
        click.echo(summary.line(), err=True)


def _bench_queue(workers: str, dbs: tuple[str, ...], num_requests: int, max_num_seqs: int,
                 json_path: Path | None) -> None:
    import tempfile

    from bulkgen.bench.queue_capacity import run_queue_bench
    from bulkgen.store import open_store

    try:
        counts = [int(n) for n in workers.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or num_requests < 1:
        raise click.UsageError(f"--workers takes worker counts such as 1,2,4,8 and --queue-requests N >= 1; got "
                               f"{workers!r} and {num_requests}")
    with tempfile.TemporaryDirectory() as tmp:
        urls = list(dbs) or [f"sqlite:///{tmp}/queue.db"]
        for url in urls:
            open_store(url).close()  # a bad URL is one line before any worker starts
        click.echo(f"bulkgen bench --queue: {num_requests:,} requests a run, workers hold up to {max_num_seqs} each",
                   err=True)
        rows = run_queue_bench(urls, counts, num_requests, max_num_seqs, lambda m: click.echo(m, err=True))
    if json_path:
        json_path.write_text(json.dumps({"queue": rows}, indent=2) + "\n")


def _run_on_ray(store, db_url: str, engine_config, options, ray_options, progress: bool, as_json: bool) -> None:
    from bulkgen.ray import run_on_ray
    from bulkgen.store import queue as q

    summary = run_on_ray(store, db_url, engine_config, options, ray_options, progress)
    if as_json:
        emit_json(summary.to_dict())
    else:
        click.echo(summary.line(), err=True)
    if summary.errors:
        with store.session_scope() as session:
            jobs = list(options.job_ids) or [job.id for job in q.runnable_jobs(session)]
            left = q.queue_totals(session, jobs).num_pending if jobs else 0
        for error in summary.errors:
            click.echo(f"error: a worker stopped for good: {error}", err=True)
        if left:
            click.echo(f"error: {left} requests are left in the queue; `bulkgen run` again finishes them", err=True)
        sys.exit(1)


@cli.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="File to write: .parquet or .jsonl.")
@click.option("--include-inputs/--no-include-inputs", default=True, show_default=True,
              help="Join the input file's columns to each row.")
@click.option("--input", "input_path", type=click.Path(path_type=Path),
              help="Where the input file is now, if it moved since submit.")
@click.option("--include-token-ids", is_flag=True, help="Add the output token ids (output_token_ids column).")
@click.option("--format", "fmt", type=click.Choice(("auto", "parquet", "jsonl", "openai")), default="auto",
              show_default=True, help="auto: by the output's name (.parquet, .jsonl); openai: OpenAI's batch output "
                                      "format, a line per input line.")
@click.option("--errors", "errors_path", type=click.Path(path_type=Path),
              help="With --format openai: failed lines go to this file instead (as OpenAI's error file).")
@json_option
@db_option
def export(job_id: int, output: Path, include_inputs: bool, input_path: Path | None, include_token_ids: bool,
           fmt: str, errors_path: Path | None, as_json: bool, db_url: str) -> None:
    """Write a job's results, one row per request in input order, joined to the input columns.

    Columns: row, sample, custom_id, status, output, finish_reason, num_prompt_tokens,
    num_output_tokens, num_cached_tokens, error, time_to_first_token_s, latency_s, then the input
    columns (renamed input_NAME where a name clashes). Failed rows carry their error. A running job
    exports what is committed so far.

    \b
    Example:
      bulkgen export 1 -o demo.out.parquet
      bulkgen export 1 -o demo.out.jsonl --no-include-inputs
      bulkgen export 2 --format openai -o batch_output.jsonl --errors batch_errors.jsonl
    """
    from bulkgen.io.export import export_job, export_openai

    if errors_path is not None and fmt != "openai":
        raise click.UsageError("--errors goes with --format openai")
    store = open_db(db_url)
    if fmt == "openai":
        report = export_openai(store, job_id, output, errors_path)
    else:
        report = export_job(store, job_id, output, include_inputs=include_inputs, input_path=input_path,
                            include_token_ids=include_token_ids, fmt=None if fmt == "auto" else fmt)
    if as_json:
        emit_json(report.to_dict())
        return
    partial = " (the job is not finished: this is what is committed so far)" if report.is_partial else ""
    click.echo(f"job {job_id}: wrote {report.num_rows} rows to {report.path} ({report.num_completed} completed, "
               f"{report.num_failed} failed){partial}")


@cli.command(context_settings=CONTEXT)
@click.argument("workload", type=click.Path(path_type=Path), required=False)
@click.option("--synthetic", type=int, help="Instead of a file: N synthetic requests (prompts 60..1400 tokens).")
@click.option("--suite", type=click.Choice(["gpu"]),
              help="Instead of a workload: the GPU suite (random-weight models of three sizes, bfloat16, 1,024 "
                   "synthetic requests; bulkgen against transformers' generate_batch and static batches).")
@click.option("--suite-models", default=",".join(("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b")), show_default=True,
              help="The suite's models, comma-separated (also: tiny, for a smoke run on a CPU).")
@click.option("--suite-requests", type=int, default=1024, show_default=True,
              help="Requests bulkgen runs in the suite (its peers run --suite-peer-requests of them).")
@click.option("--suite-peer-requests", type=int, default=128, show_default=True)
@click.option("--make-workload", "make_workload", type=int, metavar="N",
              help="Write the benchmarks' workload of N requests to WORKLOAD (with --seed, for --model) and stop.")
@click.option("--limit", type=int, help="Only the first N rows of the workload file.")
@click.option("--chat", is_flag=True, help="The prompts are plain instructions: render them with the chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True,
              help="Budget for rows without a max_new_tokens column.")
@click.option("--model", default=None, help="Alias, .gguf file or Hugging Face directory (default model if not given).")
@click.option("--compare", default="hf-static-sorted", show_default=True,
              help="Peers, comma-separated, each optionally @dtype (or, for bulkgen, @policy, "
                   "@no-kv-admission, or @torch / @c for its CPU kernel paths): bulkgen, bulkgen-store, hf-static, "
                   "hf-static-sorted, hf-cb, vllm. Peers not installed are skipped.")
@click.option("--policy", type=click.Choice(POLICIES), default=DEFAULT_POLICY, show_default=True,
              help="bulkgen's packing policy.")
@click.option("--kv-admission/--no-kv-admission", default=True, show_default=True,
              help="Admit only what the KV cache can hold to the end.")
@click.option("--hf-batch-size", default="8", show_default=True,
              help="Batch sizes for the HF static peers, comma-separated; the fastest is kept.")
@click.option("--vllm-python", help="Python of a virtual environment with vLLM (default: ./vllm-venv/bin/python).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the results as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Write a PNG of bulkgen's tokens per step and KV use over time.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of a synthetic or made workload.")
@click.option("--reference", help="Engine (as named in the table) whose tokens the others are compared with "
                                  "(default: the first hf-* engine).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sample every engine's requests at this temperature (each request seeded by its index); an "
                   "engine named NAME@greedy stays greedy, and the Hugging Face peers always are.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="With --temperature: nucleus sampling.")
@click.option("--top-k", type=int, default=0, show_default=True, help="With --temperature: keep the k most likely.")
@click.option("--min-p", type=float, default=0.0, show_default=True,
              help="With --temperature: drop tokens below this share of the most likely one's probability.")
@click.option("--json-schema", "bench_schema", metavar="FILE_OR_JSON",
              help="The schema of bulkgen@json's outputs (default: an array no budget can finish).")
@click.option("--queue", "queue_bench", is_flag=True,
              help="Measure the queue alone: worker processes claim and commit through the real store with an "
                   "engine that finishes each request at once (no model); requests/s per worker count.")
@click.option("--workers", "queue_workers", default="1,2,4,8", show_default=True, metavar="N[,N...]",
              help="With --queue: worker processes, one measurement per count.")
@click.option("--db", "queue_dbs", multiple=True, metavar="URL",
              help="With --queue: the database(s) to measure, each a fresh one (default: a new SQLite file).")
@click.option("--queue-requests", type=int, default=20_000, show_default=True,
              help="With --queue: requests per measurement.")
@engine_options
def bench(workload: Path | None, synthetic: int | None, suite: str | None, suite_models: str, suite_requests: int,
          suite_peer_requests: int, make_workload: int | None, limit: int | None, chat: bool, max_new_tokens: int,
          model: str | None, compare: str, policy: str, kv_admission: bool, hf_batch_size: str,
          vllm_python: str | None, json_path: Path | None, plot_path: Path | None, seed: int, reference: str | None,
          temperature: float, top_p: float, top_k: int, min_p: float, bench_schema: str | None,
          queue_bench: bool, queue_workers: str, queue_dbs: tuple[str, ...], queue_requests: int,
          **engine: Any) -> None:
    """Benchmark bulkgen against its peers on one workload, all in one run, and print one table.

    Every engine generates exactly each row's max_new_tokens greedily (EOS masked), each in its own
    process, load time excluded. Columns: output and total tokens/s, wall time, tail (from 90 % of
    requests done to 100 %), peak memory of the process tree, preemptions, mean batch occupancy,
    padding, and the share of requests whose tokens are identical to the Hugging Face reference.

    \b
    Example:
      bulkgen bench --make-workload 256 w256.parquet --seed 0    # the workload of BENCHMARKS.md
      bulkgen bench w256.parquet --compare hf-static-sorted,vllm --json w256.json --plot w256.png
      bulkgen bench w256.parquet --kv-cache-memory 368MiB --compare vllm
      bulkgen bench w256.parquet --dtype bfloat16 --compare bulkgen@float32,vllm --reference bulkgen@float32
      bulkgen bench --synthetic 32 --compare bulkgen@fifo,hf-static,bulkgen-store
      bulkgen bench w256.parquet --kv-cache-memory 360MiB --compare bulkgen@fifo@no-kv-admission
      bulkgen bench w64.parquet --compare bulkgen@torch,vllm     # the C kernels against plain torch
      bulkgen bench w256.parquet --temperature 0.8 --top-p 0.95 --compare bulkgen@greedy,bulkgen@json,vllm
      bulkgen bench --suite gpu --json gpu.json                 # one command measures a GPU
      bulkgen bench --queue --workers 1,2,4,8 --db postgresql+psycopg://postgres@127.0.0.1/bench
    """
    from bulkgen.bench import workload as wl
    from bulkgen.bench.run import BenchOptions, format_table, parse_engines, plot, run_bench, write_json
    from bulkgen.resolve import DEFAULT_MODEL, load_tokenizer, resolve_model

    if suite is not None:
        _bench_suite(suite_models, suite_requests, suite_peer_requests, hf_batch_size, json_path, engine)
        return
    if queue_bench:
        _bench_queue(queue_workers, queue_dbs, queue_requests, engine["max_num_seqs"], json_path)
        return
    if (workload is None) == (synthetic is None):
        raise click.UsageError("give a workload file or --synthetic N (one of them)")
    if make_workload is not None and (workload is None or make_workload < 1):
        raise click.UsageError("--make-workload N needs N >= 1 and the file to write: bulkgen bench --make-workload "
                               "256 w256.parquet")
    resolved = resolve_model(model or DEFAULT_MODEL, log=lambda m: click.echo(m, err=True))
    tokenizer = load_tokenizer(resolved.path)
    if make_workload is not None:
        counts = wl.make_workload(tokenizer, make_workload, workload, seed)
        click.echo(f"wrote {workload}: {counts['num_requests']} requests, {counts['num_prompt_tokens']:,} prompt "
                   f"tokens, {counts['num_output_tokens']:,} output tokens (seed {seed}, model {resolved.name})")
        return
    if workload is not None:
        if not workload.is_file():
            raise click.BadParameter(f"{workload} does not exist", param_hint="WORKLOAD")
        data = wl.from_parquet(workload, tokenizer, limit, max_new_tokens=max_new_tokens, chat=chat)
    else:
        data = wl.synthetic(synthetic, len(tokenizer), seed)
    config = build_engine_config(engine)
    engines = parse_engines(compare, config.dtype)
    sampling = _bench_sampling(temperature, top_p, top_k, min_p)
    from bulkgen.jobspec import load_schema

    schema = load_schema(bench_schema) if bench_schema is not None else None
    vllm_blocks = None
    if config.kv_cache_memory is not None and any(run.name == "vllm" for run in engines):
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(resolved.path)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        element = 2 if config.dtype != "float32" else 4
        per_token = 2 * hf.num_hidden_layers * (hf.num_key_value_heads or hf.num_attention_heads) * head_dim * element
        vllm_blocks = max(1, config.kv_cache_memory // per_token // 128)
    from dataclasses import asdict

    options = BenchOptions(model_path=str(resolved.path), engines=engines, engine_config=asdict(config),
                           policy=policy, kv_admission=kv_admission,
                           hf_batch_sizes=[int(b) for b in hf_batch_size.split(",")], vllm_python=vllm_python,
                           vllm_num_blocks=vllm_blocks, num_threads=config.num_threads, reference=reference,
                           sampling=sampling, json_schema=None if schema is None else json.loads(schema))
    report = run_bench(data, options, log=lambda m: click.echo(m, err=True))
    d = report["workload"]
    click.echo(f"workload {d['name']}: {d['num_requests']} requests, {d['num_prompt_tokens']:,} prompt tokens "
               f"(min {d['prompt_tokens_min']}, mean {d['prompt_tokens_mean']}, max {d['prompt_tokens_max']}), "
               f"{d['num_output_tokens']:,} output tokens; model {resolved.name}; dtype {config.dtype}; "
               f"policy {policy}; {_sampling_text(sampling)}; {report['machine']}")
    click.echo(format_table(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        if plot(report, plot_path):
            click.echo(f"wrote {plot_path}", err=True)
        else:
            click.echo("no plot: install matplotlib (pip install bulkgen[bench])", err=True)


def _bench_sampling(temperature: float, top_p: float, top_k: int, min_p: float) -> dict[str, Any]:
    """The bench's sampling flags, checked as a request's are; {} for greedy."""
    if not temperature:
        if top_p != 1.0 or top_k or min_p:
            raise click.UsageError("--top-p, --top-k and --min-p need --temperature > 0 (without it every engine "
                                   "decodes greedily)")
        return {}
    checked = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return {"temperature": checked.temperature, "top_p": checked.top_p, "top_k": checked.top_k,
            "min_p": checked.min_p}


def _sampling_text(sampling: dict[str, Any]) -> str:
    if not sampling:
        return "greedy"
    return "sampled " + " ".join(f"{k.replace('_', '-')} {v:g}" for k, v in sampling.items()
                                 if (k, v) not in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)))


def _bench_suite(models: str, num_requests: int, peer_requests: int, hf_batch_size: str, json_path: Path | None,
                 engine: dict[str, Any]) -> None:
    from dataclasses import asdict

    from bulkgen.bench.run import child_runner
    from bulkgen.bench.suite import SUITE_ENGINES, SUITE_MODELS, format_suite, run_suite, write_suite_json

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SUITE_MODELS]
    if unknown or not names:
        raise click.BadParameter(f"unknown suite model(s) {unknown}; known: {', '.join(SUITE_MODELS)}",
                                 param_hint="--suite-models")
    if engine["dtype"] == "float32":
        engine["dtype"] = "bfloat16"  # the suite measures bfloat16 (a --dtype of float16 is kept)
    config = asdict(build_engine_config(engine))
    run = child_runner(timeout_s=3600, hf_batch_sizes=[int(b) for b in hf_batch_size.split(",")])
    report = run_suite(names, num_requests, peer_requests, list(SUITE_ENGINES), config, run,
                       log=lambda m: click.echo(m, err=True))
    click.echo(format_suite(report))
    if json_path:
        write_suite_json(report, json_path)
        click.echo(f"wrote {json_path}", err=True)


# ---------------------------------------------------------------------------------------- cancel, retry


@cli.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@json_option
@db_option
def cancel(job_id: int, as_json: bool, db_url: str) -> None:
    """Cancel a job: workers stop taking its requests; committed results stay.

    \b
    Example:
      bulkgen cancel 1
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope(write=True) as session:
        num_cancelled = job_ops.cancel_job(session, job_id)
    if as_json:
        emit_json({"job_id": job_id, "cancelled": num_cancelled})
    else:
        click.echo(f"job {job_id}: cancelled ({num_cancelled} requests not run)")


@cli.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@json_option
@db_option
def retry(job_id: int, as_json: bool, db_url: str) -> None:
    """Put a job's failed requests back in the queue (and a cancelled job's cancelled ones).

    \b
    Example:
      bulkgen retry 1 && bulkgen run 1
    """
    from bulkgen.store import jobs as job_ops

    store = open_db(db_url)
    with store.session_scope(write=True) as session:
        num_requeued = job_ops.retry_job(session, job_id)
    if as_json:
        emit_json({"job_id": job_id, "requeued": num_requeued})
    else:
        click.echo(f"job {job_id}: {num_requeued} requests back in the queue" +
                   ("; next: bulkgen run" if num_requeued else ""))


# ------------------------------------------------------------------------------------------------- db


@cli.group(cls=BulkgenGroup, context_settings=CONTEXT)
def db() -> None:
    """Manage the job database's schema (it is also upgraded automatically on open).

    \b
    Example:
      bulkgen db current
      bulkgen db upgrade --db postgresql+psycopg://user@host/bulkgen
    """


@db.command(context_settings=CONTEXT)
@db_option
def upgrade(db_url: str) -> None:
    """Bring the database schema to the newest revision.

    \b
    Example:
      bulkgen db upgrade
    """
    from bulkgen.store import migrate
    from bulkgen.store.db import create_db_engine, opening

    engine = create_db_engine(db_url)
    with opening(engine):
        migrate.upgrade(engine)
        revision = migrate.current_revision(engine)
    click.echo(f"{_hide_password(db_url)}: at revision {revision}")


@db.command(context_settings=CONTEXT)
@json_option
@db_option
def current(as_json: bool, db_url: str) -> None:
    """Show the database's schema revision and the newest one this bulkgen knows.

    \b
    Example:
      bulkgen db current
    """
    from bulkgen.store import migrate
    from bulkgen.store.db import create_db_engine, opening

    engine = create_db_engine(db_url)
    with opening(engine):
        revision = migrate.current_revision(engine)
    head = migrate.head_revision()
    if as_json:
        emit_json({"url": _hide_password(db_url), "current": revision, "head": head})
        return
    state = "up to date" if revision == head else f"behind head {head} (run `bulkgen db upgrade`)"
    click.echo(f"{_hide_password(db_url)}: revision {revision or '(empty)'}, {state}")


# ---------------------------------------------------------------------------------------------- helpers


class _row_progress:
    """A tqdm bar on a terminal, nothing otherwise (submit is quick next to a run)."""

    def __init__(self, desc: str, unit: str, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, leave=False)

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update if self.bar is not None else (lambda n: None)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def main() -> None:
    cli(prog_name="bulkgen")


if __name__ == "__main__":
    main()
