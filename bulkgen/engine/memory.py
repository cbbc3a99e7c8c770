"""What fits in this machine's memory: how much is free to bulkgen, and the dtype a model's weights load in.

`--dtype auto` (the default) loads the weights in float32 where they fit beside the KV cache and the step's
activations, else in bfloat16 where the device computes it natively (a GPU, or a CPU with AVX512-BF16, AMX or
Arm BF16), and refuses before loading anything, with the numbers, where neither fits. A dtype asked for by name
is checked the same way. Free memory is the least of what Linux reports available, what the process's cgroup
still allows (a container's limit), and BULKGEN_MEMORY_LIMIT.

No torch here: the decision is arithmetic on sizes, tested as such.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from bulkgen.config import EngineConfig, format_size, parse_size
from bulkgen.engine.cpu.machine import native_dtype_problem
from bulkgen.errors import ConfigError
from bulkgen.gguf_info import GGUFInfo, gguf_info
from bulkgen.model import DTYPE_BYTES, ModelShape, estimated_weight_count, read_config, weight_count

MEMORY_LIMIT_ENV = "BULKGEN_MEMORY_LIMIT"  # e.g. 16GiB: count no more than this as free (a machine shared with others)
CPU_HEADROOM_BYTES = 1 * 2**30  # activations of a 1k-token step, Python, libraries
MIN_KV_BYTES = 256 * 2**20  # what a default-sized KV cache must at least get beside the weights
INT8_BYTES = 1.02  # an int8 weight and its share of the packed panels' padding and scales (cpu/csrc/qgemm.c)


def available_memory() -> int:
    """Bytes bulkgen may still use: Linux's available memory, capped by the cgroup's limit and by
    BULKGEN_MEMORY_LIMIT."""
    free = psutil.virtual_memory().available
    cgroup = _cgroup_room()
    if cgroup is not None:
        free = min(free, cgroup)
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        try:
            cap = parse_size(limit)
        except ConfigError as exc:
            raise ConfigError(f"{MEMORY_LIMIT_ENV}: {exc}") from exc
        free = min(free, cap)
    return max(free, 0)


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the process's cgroup (v2, else v1) still lets it allocate; None where it sets no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a v1 "unlimited" near 2^63: no limit
            return int(limit) - usage
    return None


def choose_dtype(requested: str, num_weights: int, kv_bytes: int | None, available: int, native: set[str],
                 on_gpu: bool, name: str, block_bytes: float = 0, block_name: str = "GGUF blocks") -> str:
    """The dtype to load a model of num_weights parameters in. requested: "auto" or a dtype; kv_bytes: the KV
    cache's size where given (None: it takes what is left, at least MIN_KV_BYTES); available: free bytes (on a
    GPU its memory is sized elsewhere: auto is bfloat16 there); native: the low-precision dtypes this CPU
    computes natively; block_bytes: weights kept in a GGUF file's blocks (or in int8: block_name says), whatever
    the dtype. ConfigError with
    the numbers where nothing fits."""
    if on_gpu:
        return "bfloat16" if requested == "auto" else requested
    if kv_bytes is not None and kv_bytes + CPU_HEADROOM_BYTES > available:  # whatever the weights' dtype
        raise ConfigError(f"a KV cache of {format_size(kv_bytes)} does not fit: {format_size(available)} of memory "
                          f"is free, and activations need about {format_size(CPU_HEADROOM_BYTES)} more; lower "
                          "--kv-cache-memory")
    kv = kv_bytes if kv_bytes is not None else MIN_KV_BYTES

    def fits(dtype: str) -> bool:
        return block_bytes + num_weights * DTYPE_BYTES[dtype] + kv + CPU_HEADROOM_BYTES <= available

    if requested != "auto":
        if fits(requested):
            return requested
        smaller = requested == "float32" and "bfloat16" in native and fits("bfloat16")
        hint = "; --dtype bfloat16 (or auto) fits" if smaller else ""
        raise ConfigError(f"{name} does not fit in {requested}: "
                          f"{_numbers(num_weights, requested, kv, available, block_bytes, block_name)}{hint}")
    if fits("float32"):
        return "float32"
    if "bfloat16" in native and fits("bfloat16"):
        return "bfloat16"
    tried = "float32 or bfloat16" if "bfloat16" in native else "float32 (and this CPU has no native bfloat16)"
    smallest = "bfloat16" if "bfloat16" in native else "float32"
    raise ConfigError(f"{name} fits in no dtype this machine runs, {tried}: "
                      f"{_numbers(num_weights, smallest, kv, available, block_bytes, block_name)}; "
                      f"free memory, lower --kv-cache-memory, or use a smaller model")


def _numbers(num_weights: int, dtype: str, kv: int, available: int, block_bytes: float = 0,
             block_name: str = "GGUF blocks") -> str:
    blocks = f"its {block_name} take {format_size(int(block_bytes))}, " if block_bytes else ""
    return (f"{blocks}its {num_weights / 1e9:.2f} B {'other ' if blocks else ''}weights take "
            f"{format_size(num_weights * DTYPE_BYTES[dtype])} in {dtype}, "
            f"the KV cache {format_size(kv)} and activations about {format_size(CPU_HEADROOM_BYTES)}, and "
            f"{format_size(available)} of memory is free")


def gguf_dtype(requested: str, info: GGUFInfo, kv_bytes: int | None, on_gpu: bool, name: str) -> str:
    """choose_dtype for a model run from its GGUF file's blocks (--quantization gguf): the blocks at their size,
    the rest (embeddings, norms) in the dtype."""
    return choose_dtype(requested, info.float_values, kv_bytes, available_memory(), native_dtypes(), on_gpu, name,
                        block_bytes=info.bytes_in(0))


def native_dtypes() -> set[str]:
    """The low-precision dtypes this CPU computes natively (cpu/machine.py reads its flags)."""
    return {d for d in ("bfloat16", "float16") if native_dtype_problem(d) is None}


def dtype_for(requested: str, model_dir: Path, kv_bytes: int | None, on_gpu: bool, int8: bool = False) -> str:
    """choose_dtype for a model directory, its weights counted from their safetensors headers (else estimated
    from its config). int8 (--quantization int8, which quantizes safetensors weights as it reads them:
    engine/int8_load.py): the linear layers' weights counted at a byte each (and their scales), the rest in the
    dtype."""
    num_weights = weight_count(model_dir)
    if num_weights is None:
        num_weights = estimated_weight_count(ModelShape.of(read_config(model_dir)))
    elif int8:
        linear = weight_count(model_dir, vocab=ModelShape.of(read_config(model_dir)).vocab)
        return choose_dtype(requested, num_weights - linear, kv_bytes, available_memory(), native_dtypes(), on_gpu,
                            Path(model_dir).name, block_bytes=linear * INT8_BYTES, block_name="int8 weights")
    return choose_dtype(requested, num_weights, kv_bytes, available_memory(), native_dtypes(), on_gpu,
                        Path(model_dir).name)


def run_plan(model: Path, config: EngineConfig, on_gpu: bool) -> tuple[str, str, GGUFInfo | None]:
    """--quantization and --dtype as a model (a directory, or one converted from a GGUF file) runs with them, and
    its GGUF file's facts where it came from one; the one rule of the runner (engine/loading.py) and the bench.
    quantization auto: none (the exact path) where the dequantized weights fit in memory, else the file's blocks;
    dtype auto: what fits (dtype_for; with the blocks kept, the weights that are not: gguf_dtype). Checked before
    anything loads."""
    gguf = gguf_info(model)
    requested = config.quantization
    if requested == "gguf" and gguf is None:
        raise ConfigError(f"--quantization gguf runs a GGUF file's own blocks, and {model.name} did not come from "
                          "one: give a .gguf file, the default model, or a hub name with :QUANT (or use "
                          "--quantization int8)")
    if gguf is not None and not gguf.weights and requested in ("none", "int8"):
        raise ConfigError(f"{gguf.gguf.name} dequantized does not fit in this machine's memory, so only its blocks "
                          f"were kept: run it with --quantization gguf (or auto)")
    quantization = requested if requested != "auto" else "none" if gguf is None else None
    if quantization is None:  # auto, from a GGUF file: exact where it fits
        quantization = "gguf"
        if gguf.weights:
            try:
                dtype_for(config.dtype, model, config.kv_cache_memory, on_gpu)
                quantization = "none"
            except ConfigError:
                pass
    if quantization == "gguf":
        return quantization, gguf_dtype(config.dtype, gguf, config.kv_cache_memory, on_gpu, gguf.gguf.name), gguf
    dtype = dtype_for(config.dtype, model, config.kv_cache_memory, on_gpu, int8=quantization == "int8")
    return quantization, dtype, gguf
