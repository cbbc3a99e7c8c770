"""`bulkgen plan`: a job's predicted wall time and tokens on this machine, before it runs (bulkgen/plan.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import click

from bulkgen import plan as planner
from bulkgen.cli.options import (
    CONTEXT,
    JOB_ID,
    JobCommand,
    db_option,
    emit_json,
    engine_config,
    engine_options,
    json_option,
)
from bulkgen.config import EngineConfig, format_size, parse_size
from bulkgen.errors import ConfigError
from bulkgen.packing import check_packing
from bulkgen.progress import format_duration
from bulkgen.store.db import open_store
from bulkgen.store.packings import DEFAULT_PACKING

CANDIDATES = ("--max-num-seqs", "--kv-cache-memory")


def _list(text: str | None, parse: Any, flag: str) -> list[Any]:
    if text is None:
        return [None]
    try:
        return [parse(part.strip()) for part in text.split(",") if part.strip()]
    except (ValueError, ConfigError, click.BadParameter) as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint=flag) from exc


@click.command(cls=JobCommand, context_settings=CONTEXT)
@click.argument("job_id", type=JOB_ID)
@lambda func: engine_options(func, without=CANDIDATES)
@click.option("--max-num-seqs", metavar="N[,N...]", help=f"Sequences running at once (default: "
              f"{EngineConfig().max_num_seqs}); several, comma-separated, to compare.")
@click.option("--kv-cache-memory", metavar="SIZE[,SIZE...]",
              help="KV cache size, e.g. 2GiB (default: run's); several to compare.")
@click.option("--packing", default=DEFAULT_PACKING, show_default=True, metavar="NAME[,NAME...]",
              help="Admission order (lpt, sorted, fifo); several to compare.")
@click.option("--kv-admission/--no-kv-admission", default=True, show_default=True,
              help="Admit a request only if the KV cache can hold it to its end (as run's).")
@json_option
@db_option
def plan(job_id: int, max_num_seqs: str | None, kv_cache_memory: str | None, packing: str, kv_admission: bool,
         as_json: bool, db_url: str, **flags: Any) -> None:
    """Predict how long JOB will take on this machine, before it runs: wall time, output tokens, prompt tokens
    computed (after shared prefixes are reused), peak KV blocks and mean batch, from a replay of the real
    scheduler over the job's requests and a step cost measured once on this machine for its model.

    \b
    Example:
      bulkgen plan 1
      bulkgen plan 1 --max-num-seqs 32,64,256 --kv-cache-memory 1GiB,4GiB --json
    """
    seqs = _list(max_num_seqs, int, "--max-num-seqs")
    sizes = _list(kv_cache_memory, parse_size, "--kv-cache-memory")
    packings = _list(packing, str, "--packing")
    for name in packings:
        check_packing(name)
    if any(n is not None and n < 1 for n in seqs):
        raise click.BadParameter("each must be at least 1", param_hint="--max-num-seqs")
    config = engine_config(flags)
    configs = [(dataclasses.replace(config, **({"max_num_seqs": n} if n is not None else {}),
                                    **({"kv_cache_memory": size} if size is not None else {})), name)
               for n, size, name in itertools.product(seqs, sizes, packings)]
    store = open_store(db_url)
    cost, predictions, num_requests = planner.plan_job(store, job_id, configs, kv_admission,
                                                       log=lambda m: click.echo(m, err=True))
    upper = predictions[0].upper_bound
    if as_json:
        emit_json({**predictions[0].to_dict(), "job_id": job_id, "engine_load_s": round(cost.load_s, 2),
                   **({"candidates": [p.to_dict() for p in predictions]} if len(predictions) > 1 else {})})
        return
    bound = "<= " if upper else ""
    eos = "; a request that meets its EOS ends sooner: upper bounds" if upper else ""
    click.echo(f"bulkgen plan: job {job_id}, {num_requests:,} pending requests, on this machine (engine load "
               f"{cost.load_s:.1f}s){eos}")
    click.echo(f"{'max-num-seqs':>12} {'kv blocks':>9} {'kv memory':>9} {'packing':>7} {'time':>9} {'output':>9} "
               f"{'prompt computed':>15} {'peak kv':>7} {'batch':>6}")
    for p in predictions:
        memory = format_size(p.kv_cache_blocks * cost.block_bytes)
        click.echo(f"{p.max_num_seqs:>12} {p.kv_cache_blocks:>9,} {memory:>9} "
                   f"{p.packing:>7} {bound + format_duration(p.seconds):>9} {p.output_tokens:>9,} "
                   f"{p.prompt_tokens_computed:>15,} {p.peak_kv_blocks:>7,} {p.mean_batch:>6.1f}")
