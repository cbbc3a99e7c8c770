"""What the commands share: the group that turns bulkgen's errors into messages and exit codes (the only
place that does) and loads each command's module when it runs, job-id arguments, the --db and --json
options, the engine's options (one a field of EngineConfig, by its name). Nothing here needs the database
packages: `bench suite` runs on a GPU machine that has none (.ci/gpu-check)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

import click

from bulkgen.config import ATTENTION_BACKENDS, DTYPE_CHOICES, QUANTIZATIONS, SPECULATE, EngineConfig, Paths
from bulkgen.errors import BulkgenError

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


# what a command interrupted by Ctrl-C leaves behind (submit removes its half-made job; export writes a temporary
# file renamed onto the output only when complete)
INTERRUPTED = {"submit": ": nothing was written (the job was not made)",
               "export": ": nothing was written (the output file is as it was)",
               "report": ": nothing was written"}


class BulkgenGroup(click.Group):
    """A group whose commands' BulkgenErrors become `error: ...` and the error's exit code. `lazy` names
    commands by "module:attribute", imported when the command runs or shows its help: a command loads its
    own module's imports only (`bulkgen --help` loads them all, for their one-line summaries)."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            module, attribute = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BulkgenError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:  # Ctrl-C: what it left, in one line, and the shell's exit code for SIGINT
            click.echo(f"stopped{INTERRUPTED.get(ctx.invoked_subcommand or '', '')}", err=True)
            ctx.exit(130)


def db_option(func: Callable) -> Callable:
    @click.option("--db", "db_url", envvar="BULKGEN_DB", metavar="URL",
                  help="Database URL (env BULKGEN_DB). Default: sqlite:///~/.local/share/bulkgen/bulkgen.db")
    @functools.wraps(func)
    def wrapper(*args: Any, db_url: str | None, **kwargs: Any) -> Any:
        return func(*args, db_url=db_url or Paths().default_db_url, **kwargs)

    return wrapper


def json_option(func: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def engine_options(func: Callable, without: tuple[str, ...] = ()) -> Callable:
    """Engine limits shared by `run`, `bench` and `plan`; each option's name is its EngineConfig field's, and its
    default the field's own (`without`: flags a command spells its own way, as `plan`'s lists of candidates)."""
    default = EngineConfig()
    options = [
        _option("--dtype", type=click.Choice(DTYPE_CHOICES), default=default.dtype,
                     show_default=True, help="Weights, activations and KV cache (auto: float32 where the weights "
                                             "fit in memory, else bfloat16 where the CPU computes it natively)."),
        _option("--quantization", type=click.Choice(QUANTIZATIONS), default=default.quantization,
                     show_default=True, help="The linear layers' weights: none (as loaded, exact); int8 (per "
                                             "output channel, activations per block of 32, integer products: a "
                                             "quarter of float32's bytes, approximate); gguf (a GGUF model's "
                                             "own blocks, Q4_K etc., integer products: the file's size, "
                                             "approximate); auto: none where the dequantized weights fit in "
                                             "memory, else gguf."),
        _option("--device", default=default.device, show_default=True, help="cpu, cuda, cuda:N or auto."),
        _option("--kv-cache-memory", metavar="SIZE",
                     help="KV cache size, e.g. 2GiB (default on CPU: 4GiB or a quarter of free RAM, at most what "
                          "--max-num-seqs sequences of the longest context fill; "
                          "--gpu-memory-utilization on a GPU)."),
        _option("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization,
                     show_default=True, help="Share of GPU memory for weights and KV cache."),
        _option("--max-num-seqs", type=int, default=default.max_num_seqs, show_default=True,
                     help="Sequences running at once."),
        _option("--max-num-batched-tokens", type=int, default=default.max_num_batched_tokens,
                     show_default=True, help="Tokens computed per engine step (the token budget)."),
        _option("--max-model-len", type=int, help="Cap on prompt + output tokens (default: the model's)."),
        _option("--block-size", type=int, default=default.block_size, show_default=True,
                     help="Tokens per KV block."),
        _option("--attention-backend", type=click.Choice(ATTENTION_BACKENDS),
                     default=default.attention_backend, show_default=True,
                     help="kernel: bulkgen's C kernels (CPU); torch: pure torch; triton: the Triton kernels (a "
                          "GPU's default; on a CPU only in Triton's interpreter)."),
        _option("--kernels", default=default.kernels, envvar="BULKGEN_KERNELS", show_default=True,
                     metavar="SPEC",
                     help="CPU path of each kernel family (linear, gated_mlp, decode_attention, "
                          "prefill_attention, small_ops, sampler): auto (the faster, measured once on this "
                          "machine), c, torch, or pairs such as linear=torch,attention=c. Also read from "
                          "BULKGEN_KERNELS."),
        _option("--num-threads", type=int, help="CPU threads for torch (default: all cores)."),
        _option("--prefix-caching/--no-prefix-caching", "enable_prefix_caching",
                     default=default.enable_prefix_caching, show_default=True,
                     help="Share KV blocks of common prompt prefixes."),
        _option("--cuda-graphs/--no-cuda-graphs", default=default.cuda_graphs, show_default=True,
                     help="GPU: replay decode steps as CUDA graphs captured per batch-size bucket "
                          "(1, 2, 4, ... --max-num-seqs)."),
        _option("--speculate", type=click.Choice(SPECULATE), default=default.speculate, show_default=True,
                help="Drafts with no draft model (a JSON schema's forced tokens, the prompt's and the job's "
                     "n-grams), verified in the normal step: auto drafts where a step has room as measured; the "
                     "outputs are the same either way."),
    ]
    for flags, option in reversed(options):
        if not set(flags) & set(without):
            func = option(func)
    return func


def _option(*flags: str, **settings: Any) -> tuple[tuple[str, ...], Callable]:
    """A click option and the flags it declares (what engine_options' `without` names)."""
    return flags, click.option(*flags, **settings)


ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of engine_options' values (taken out of `options`); sizes as the user wrote them."""
    return EngineConfig.from_options({name: options.pop(name) for name in list(options) if name in ENGINE_FIELDS})
