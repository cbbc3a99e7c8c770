"""`bulkgen bench`: bulkgen against its peers on one workload (`bench WORKLOAD ...`, the same as
`bench compare`), the GPU suite (`bench suite`), the queue alone (`bench queue`), the benchmarks' workload
file (`bench make-workload`) and `bulkgen report` on a big job (`bench report`): one command each. (Over 300
lines: one noun, as the CLI's rule has it; its commands share their options: the model, the seed, the JSON path,
the HF batch sizes, the engine's.)"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bulkgen.bench import workload as wl
from bulkgen.bench.report import format_table, plot, write_json
from bulkgen.bench.run import VLLM_BLOCK_TOKENS, BenchOptions, child_runner, parse_engines, run_bench
from bulkgen.bench.suite import (
    GPU_MODELS,
    SUITE_ENGINES,
    SUITE_MODELS,
    SUITE_RUNNERS,
    format_suite,
    run_suite,
    write_suite_json,
)
from bulkgen.cli.options import CONTEXT, BulkgenGroup, engine_config, engine_options
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.jobspec import load_schema
from bulkgen.model import ModelShape, load_tokenizer, read_config
from bulkgen.resolve import default_model, resolve_model
from bulkgen.store.packings import DEFAULT_PACKING, PACKINGS


class BenchGroup(BulkgenGroup):
    """A group whose first form needs no command name: `bench WORKLOAD ...` is `bench compare WORKLOAD ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["compare", *args]
        return super().parse_args(ctx, args)


def _apply(options: list[Callable]) -> Callable[[Callable], Callable]:
    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func
    return decorate


JSON_PATH = click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the results as JSON here.")
HF_BATCH_SIZE = click.option("--hf-batch-size", default="8", show_default=True,
                             help="Batch sizes for the HF static peers, comma-separated; the fastest is kept.")
SEED = click.option("--seed", type=int, default=0, show_default=True, help="Seed of a synthetic or made workload.")
MODEL = click.option("--model", default=None,
                     help="Alias, .gguf file or Hugging Face directory (default model if not given).")
SUITE_OPTIONS = _apply([
    click.option("--suite-models", default=",".join(GPU_MODELS),
                 show_default=True, help="The suite's models, comma-separated (also: tiny, for a smoke run on a CPU)."),
    click.option("--suite-requests", type=int, default=1024, show_default=True,
                 help="Requests bulkgen runs in the suite (its peers run --suite-peer-requests of them)."),
    click.option("--suite-peer-requests", type=int, default=128, show_default=True),
    click.option("--suite-prompt-tokens", default="128-1024", show_default=True, metavar="MIN-MAX",
                 help="The range of the suite's prompt lengths (each drawn uniformly)."),
    click.option("--suite-output-tokens", default="128-512", show_default=True, metavar="MIN-MAX",
                 help="The range of the suite's output budgets (each drawn uniformly)."),
    click.option("--suite-engines", default=",".join(SUITE_ENGINES), show_default=True,
                 help="The suite's engines, in order, comma-separated (also: bulkgen-graphs, bulkgen with CUDA-graph "
                      "decode)."),
])
QUEUE_OPTIONS = _apply([
    click.option("--workers", "queue_workers", default="1,2,4,8", show_default=True, metavar="N[,N...]",
                 help="Worker processes, one measurement per count."),
    click.option("--db", "queue_dbs", multiple=True, metavar="URL",
                 help="The database(s) to measure, each a fresh one (default: a new SQLite file)."),
    click.option("--queue-requests", type=int, default=20_000, show_default=True, help="Requests per measurement."),
])


@click.group(cls=BenchGroup, context_settings=CONTEXT)
def bench() -> None:
    """Benchmarks: bulkgen against its peers (`bench WORKLOAD ...`), the GPU suite, the queue alone.

    \b
    Example:
      bulkgen bench make-workload 256 w256.parquet --seed 0    # the workload of BENCHMARKS.md
      bulkgen bench w256.parquet --compare hf-static-sorted,vllm --json w256.json --plot w256.png
      bulkgen bench suite --json gpu.json                     # one command measures a GPU
      bulkgen bench queue --workers 1,2,4,8 --db postgresql+psycopg://postgres@127.0.0.1/bench
    """


@bench.command(context_settings=CONTEXT)
@click.argument("workload", type=click.Path(path_type=Path), required=False)
@click.option("--synthetic", type=int, help="Instead of a file: N synthetic requests (prompts 60..1400 tokens).")
@click.option("--limit", type=int, help="Only the first N rows of the workload file.")
@click.option("--chat", is_flag=True, help="The prompts are plain instructions: render them with the chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True,
              help="Budget for rows without a max_new_tokens column.")
@MODEL
@click.option("--compare", default="hf-static-sorted", show_default=True,
              help="Peers, comma-separated, each optionally @dtype (or, for bulkgen, @packing, "
                   "@no-kv-admission, or @torch / @c for its CPU kernel paths): bulkgen, bulkgen-store, hf-static, "
                   "hf-static-sorted, hf-cb, vllm. Peers not installed are skipped.")
@click.option("--packing", type=click.Choice(PACKINGS), default=DEFAULT_PACKING, show_default=True,
              help="bulkgen's packing (as `run --packing`).")
@click.option("--kv-admission/--no-kv-admission", default=True, show_default=True,
              help="Admit only what the KV cache can hold to the end.")
@HF_BATCH_SIZE
@click.option("--vllm-python", help="Python of a virtual environment with vLLM (default: ./vllm-venv/bin/python).")
@JSON_PATH
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Write a PNG of bulkgen's tokens per step and KV use over time.")
@SEED
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
@engine_options
def compare(workload: Path | None, synthetic: int | None, limit: int | None, chat: bool, max_new_tokens: int,
            model: str | None, compare: str, packing: str, kv_admission: bool, hf_batch_size: str,
            vllm_python: str | None, json_path: Path | None, plot_path: Path | None, seed: int,
            reference: str | None, temperature: float, top_p: float, top_k: int, min_p: float,
            bench_schema: str | None, **engine: Any) -> None:
    """Benchmark bulkgen against its peers on one workload, all in one run, and print one table.

    Every engine generates exactly each row's max_new_tokens greedily (EOS masked), each in its own
    process, load time excluded. Columns: output and total tokens/s, wall time, tail (from 90 % of
    requests done to 100 %), peak memory of the process tree, preemptions, mean batch occupancy,
    padding, and the share of requests whose tokens are identical to the Hugging Face reference.

    \b
    Example:
      bulkgen bench w256.parquet --compare hf-static-sorted,vllm --json w256.json --plot w256.png
      bulkgen bench w256.parquet --kv-cache-memory 368MiB --compare vllm
      bulkgen bench w256.parquet --dtype bfloat16 --compare bulkgen@float32,vllm --reference bulkgen@float32
      bulkgen bench --synthetic 32 --compare bulkgen@fifo,hf-static,bulkgen-store
      bulkgen bench w256.parquet --kv-cache-memory 360MiB --compare bulkgen@fifo@no-kv-admission
      bulkgen bench w64.parquet --compare bulkgen@torch,vllm     # the C kernels against plain torch
      bulkgen bench w256.parquet --temperature 0.8 --top-p 0.95 --compare bulkgen@greedy,bulkgen@json,vllm
    """
    if (workload is None) == (synthetic is None):
        raise click.UsageError("give a workload file or --synthetic N (one of them)")
    resolved = resolve_model(model or default_model(), log=lambda m: click.echo(m, err=True))
    tokenizer = load_tokenizer(resolved.path)
    if workload is not None:
        if not workload.is_file():
            raise click.BadParameter(f"{workload} does not exist", param_hint="WORKLOAD")
        data = wl.from_parquet(workload, tokenizer, limit, max_new_tokens=max_new_tokens, chat=chat)
    else:
        data = wl.synthetic(synthetic, len(tokenizer), seed)
    config = _resolved_dtype(engine_config(engine), resolved.path)
    engines = parse_engines(compare, config.dtype)
    sampling = _sampling(temperature, top_p, top_k, min_p)
    schema = load_schema(bench_schema) if bench_schema is not None else None
    vllm_blocks = None
    if config.kv_cache_memory is not None and any(run.name == "vllm" for run in engines):
        per_token = ModelShape.of(read_config(resolved.path)).kv_bytes_per_token(config.dtype)
        vllm_blocks = max(1, config.kv_cache_memory // per_token // VLLM_BLOCK_TOKENS)
    options = BenchOptions(model_path=str(resolved.path), engines=engines, engine_config=dataclasses.asdict(config),
                           packing=packing, kv_admission=kv_admission,
                           hf_batch_sizes=[int(b) for b in hf_batch_size.split(",")], vllm_python=vllm_python,
                           vllm_num_blocks=vllm_blocks, num_threads=config.num_threads, reference=reference,
                           sampling=sampling, json_schema=None if schema is None else json.loads(schema))
    report = run_bench(data, options, log=lambda m: click.echo(m, err=True))
    d = report["workload"]
    click.echo(f"workload {d['name']}: {d['num_requests']} requests, {d['num_prompt_tokens']:,} prompt tokens "
               f"(min {d['prompt_tokens_min']}, mean {d['prompt_tokens_mean']}, max {d['prompt_tokens_max']}), "
               f"{d['num_output_tokens']:,} output tokens; model {resolved.name}; dtype {config.dtype}; "
               f"packing {packing}; {_sampling_text(sampling)}; {report['machine']}")
    click.echo(format_table(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        if plot(report, plot_path):
            click.echo(f"wrote {plot_path}", err=True)
        else:
            click.echo("no plot: install matplotlib (pip install bulkgen[bench])", err=True)


@bench.command(context_settings=CONTEXT)
@SUITE_OPTIONS
@HF_BATCH_SIZE
@JSON_PATH
@engine_options
def suite(suite_models: str, suite_requests: int, suite_peer_requests: int, suite_prompt_tokens: str,
          suite_output_tokens: str, suite_engines: str, hf_batch_size: str, json_path: Path | None,
          **engine: Any) -> None:
    """The GPU suite: random-weight models of three sizes, bfloat16, 1,024 synthetic requests; bulkgen
    against transformers' generate_batch and static batches.

    \b
    Example:
      bulkgen bench suite --json gpu.json
      bulkgen bench suite --suite-models tiny --suite-requests 16 --suite-output-tokens 8-32   # a smoke run on a CPU
    """
    _suite(suite_models, suite_requests, suite_peer_requests, suite_engines, hf_batch_size, json_path, engine,
           suite_prompt_tokens, suite_output_tokens)


@bench.command(context_settings=CONTEXT)
@QUEUE_OPTIONS
@click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Requests each worker holds.")
@JSON_PATH
def queue(queue_workers: str, queue_dbs: tuple[str, ...], queue_requests: int, max_num_seqs: int,
          json_path: Path | None) -> None:
    """Measure the queue alone: worker processes claim and commit through the real store with an engine
    that finishes each request at once (no model); requests/s per worker count.

    \b
    Example:
      bulkgen bench queue --workers 1,2,4,8 --db postgresql+psycopg://postgres@127.0.0.1/bench
    """
    _queue(queue_workers, queue_dbs, queue_requests, max_num_seqs, json_path)


@bench.command("make-workload", context_settings=CONTEXT)
@click.argument("num_requests", type=int)
@click.argument("workload", type=click.Path(path_type=Path))
@SEED
@MODEL
def make_workload_cmd(num_requests: int, workload: Path, seed: int, model: str | None) -> None:
    """Write the benchmarks' workload of NUM_REQUESTS requests to WORKLOAD (a Parquet file).

    \b
    Example:
      bulkgen bench make-workload 256 w256.parquet --seed 0
    """
    _make_workload(num_requests, workload, seed, model)


@bench.command("shared-prefix", context_settings=CONTEXT)
@click.argument("workload", type=click.Path(path_type=Path))
@click.option("--prefixes", type=click.IntRange(min=1), default=8, show_default=True, help="Documents.")
@click.option("--prefix-tokens", type=click.IntRange(min=1), default=1000, show_default=True,
              help="About how long each document is, in tokens.")
@click.option("--questions", type=click.IntRange(min=1), default=40, show_default=True,
              help="Questions asked of each document (one request each).")
@SEED
@MODEL
def shared_prefix_cmd(workload: Path, prefixes: int, prefix_tokens: int, questions: int, seed: int,
                      model: str | None) -> None:
    """Write a few-shot workload to WORKLOAD (a Parquet file): documents that many requests share as their
    prompts' prefix, rows shuffled.

    \b
    Example:
      bulkgen bench shared-prefix fewshot.parquet --prefixes 8 --prefix-tokens 1000 --questions 40
      bulkgen bench fewshot.parquet --compare bulkgen@fifo
    """
    resolved = resolve_model(model or default_model(), log=lambda m: click.echo(m, err=True))
    counts = wl.make_shared_prefix(load_tokenizer(resolved.path), workload, prefixes, prefix_tokens, questions, seed)
    click.echo(f"wrote {workload}: {counts['num_requests']} requests, {counts['num_prompt_tokens']:,} prompt tokens "
               f"({counts['num_distinct_prompt_tokens']:,} distinct), {counts['num_output_tokens']:,} output tokens "
               f"(seed {seed}, model {resolved.name})")


def _make_workload(num_requests: int, workload: Path, seed: int, model: str | None) -> None:
    if num_requests < 1:
        raise click.UsageError("make-workload N needs N >= 1: bulkgen bench make-workload 256 w256.parquet")
    resolved = resolve_model(model or default_model(), log=lambda m: click.echo(m, err=True))
    counts = wl.make_workload(load_tokenizer(resolved.path), num_requests, workload, seed)
    click.echo(f"wrote {workload}: {counts['num_requests']} requests, {counts['num_prompt_tokens']:,} prompt "
               f"tokens, {counts['num_output_tokens']:,} output tokens (seed {seed}, model {resolved.name})")


def _queue(workers: str, dbs: tuple[str, ...], num_requests: int, max_num_seqs: int, json_path: Path | None) -> None:
    # here, not at the top: the rest of bench runs where the database packages are not installed (a GPU's)
    from bulkgen.bench.queue_capacity import run_queue_bench
    from bulkgen.store.db import open_store

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
        click.echo(f"bulkgen bench queue: {num_requests:,} requests a run, workers hold up to {max_num_seqs} each",
                   err=True)
        rows = run_queue_bench(urls, counts, num_requests, max_num_seqs, lambda m: click.echo(m, err=True))
    if json_path:
        json_path.write_text(json.dumps({"queue": rows}, indent=2) + "\n")


def _resolved_dtype(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """--dtype auto made the dtype every engine of the comparison runs in: what bulkgen's engine would load."""
    if config.dtype != "auto":
        return config
    import torch  # here: the bench's children import it anyway

    from bulkgen.engine.memory import run_plan

    on_gpu = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    return dataclasses.replace(config, dtype=run_plan(model_dir, config, on_gpu)[1])


def _token_range(text: str, flag: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        bounds = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise click.BadParameter(f"{text!r} is not a range of token counts: give MIN-MAX, e.g. 128-512",
                                 param_hint=flag)
    return bounds


def _suite(models: str, num_requests: int, peer_requests: int, engines: str, hf_batch_size: str,
           json_path: Path | None, engine: dict[str, Any], prompt_tokens: str, output_tokens: str) -> None:
    prompts = _token_range(prompt_tokens, "--suite-prompt-tokens")
    outputs = _token_range(output_tokens, "--suite-output-tokens")
    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SUITE_MODELS]
    if unknown or not names:
        raise click.BadParameter(f"unknown suite model(s) {unknown}; known: {', '.join(SUITE_MODELS)}",
                                 param_hint="--suite-models")
    engine_names = [e.strip() for e in engines.split(",") if e.strip()]
    unknown = [e for e in engine_names if e not in SUITE_RUNNERS]
    if unknown or not engine_names:
        raise click.BadParameter(f"unknown suite engine(s) {unknown}; known: {', '.join(SUITE_RUNNERS)}",
                                 param_hint="--suite-engines")
    if engine["dtype"] == "auto":
        engine["dtype"] = "bfloat16"  # the suite measures bfloat16 (a --dtype given is kept: float32 for a rehearsal)
    config = dataclasses.asdict(engine_config(engine))
    run = child_runner(timeout_s=3600, hf_batch_sizes=[int(b) for b in hf_batch_size.split(",")])

    def on_row(report: dict[str, Any]) -> None:  # each engine's row the moment it is measured: a cut run keeps it
        click.echo(format_suite({**report, "rows": report["rows"][-1:]}).splitlines()[-1], err=True)
        if json_path:
            write_suite_json(report, json_path)

    report = run_suite(names, num_requests, peer_requests, engine_names, config, run,
                       log=lambda m: click.echo(m, err=True), prompt_tokens=prompts, output_tokens=outputs,
                       on_row=on_row)
    click.echo(format_suite(report))
    if json_path:
        write_suite_json(report, json_path)
        click.echo(f"wrote {json_path}", err=True)


def _sampling(temperature: float, top_p: float, top_k: int, min_p: float) -> dict[str, Any]:
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


@bench.command("report", context_settings=CONTEXT)
@click.option("--rows", "num_rows", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Requests of the finished job built for it.")
@click.option("--workers", "num_workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Workers whose samples it records.")
@click.option("--hours", type=click.FloatRange(min=0.01), default=8.0, show_default=True,
              help="How long those workers ran (a sample each 10 s each).")
@click.option("--db", "db_url", metavar="URL", help="Database to build it in (default: a new SQLite file in a "
                                                      "temporary directory).")
@JSON_PATH
def report_scale(num_rows: int, num_workers: int, hours: float, db_url: str | None, json_path: Path | None) -> None:
    """Time `bulkgen report` on a big finished job (built straight through the store) and size its samples
    against the whole database.

    \b
    Example:
      bulkgen bench report --rows 100000
    """
    import time

    # here, not at the top: the rest of bench runs where the database packages are not installed (a GPU's)
    from bulkgen.bench.report_scale import make_big_job, measure
    from bulkgen.store.db import open_store

    with tempfile.TemporaryDirectory() as scratch:
        store = open_store(db_url or f"sqlite:///{scratch}/report-bench.db")
        began = time.perf_counter()
        job_id = make_big_job(store, num_rows, num_workers, hours)
        click.echo(f"built job {job_id}: {num_rows:,} requests, {num_workers} workers over {hours:g} h in "
                   f"{time.perf_counter() - began:.1f} s", err=True)
        figures = measure(store, job_id)
    click.echo(f"report of {figures['num_requests']:,} requests: figures {figures['figures_s']:.2f} s, page "
               f"{figures['page_s']:.2f} s ({figures['page_bytes'] / 1024:.0f} KiB); run samples "
               f"{figures['samples_bytes'] / 2**20:.1f} MiB of {figures['database_bytes'] / 2**20:.1f} MiB "
               f"({100 * (figures['samples_share'] or 0):.2f} %)")
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2))
