"""Frozen, validated settings shared by every layer: sampling parameters, engine limits, paths.

A leaf module: it imports nothing from bulkgen but `errors`, and nothing heavy (no torch), so the
store, the packer and the scheduler can all use it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bulkgen.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")  # --quantization (engine/quant.py, engine/blocks.py)
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: float32 where the weights fit, else bfloat16 (engine/memory.py)
DEVICES = ("auto", "cpu", "cuda")
SPECULATE = ("auto", "off")  # --speculate (engine/speculate.py)
ATTENTION_BACKENDS = ("auto", "kernel", "torch", "triton")
# CPU kernel families, each run in bulkgen's C kernels or in plain torch (engine/paths.py decides).
KERNEL_FAMILIES = ("linear", "gated_mlp", "decode_attention", "prefill_attention", "small_ops", "sampler")
KERNEL_FAMILY_GROUPS = {"attention": ("decode_attention", "prefill_attention"), "all": KERNEL_FAMILIES}
KERNEL_PATHS = ("c", "torch")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Temperature 0 (the default) means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0  # 0: no min-p filter
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # OpenAI's: minus this x how often the token is in the output so far
    presence_penalty: float = 0.0  # OpenAI's: minus this if the token is in the output so far
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    seed: int | None = None
    logprobs: int | None = None  # None: none kept; 0: the chosen token's; k: also the top k
    json_schema: str | None = None  # the output is JSON valid against this schema (its JSON text)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top-p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top-k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p < 1,
               f"min-p must be in [0, 1), got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition-penalty must be > 0 (1 turns it off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2,
                   f"{name.replace('_', '-')} must be in [-2, 2] (0 turns it off), got {value!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop token ids must be integers >= 0, got {list(self.stop_token_ids)!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        _check(self.json_schema is None or isinstance(self.json_schema, str),
               f"json-schema must be a JSON schema's text, got {self.json_schema!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def runs_to_budget(self) -> bool:
        """Whether every output is exactly max_new_tokens long (--ignore-eos, nothing else that ends it)."""
        return self.ignore_eos and not self.stop and not self.stop_token_ids and self.json_schema is None

    def replace(self, **changes: Any) -> SamplingParams:
        return SamplingParams(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        for key in ("stop", "stop_token_ids"):
            if key in data:
                value = data[key]
                data[key] = (value,) if isinstance(value, str) else tuple(value or ())
        return cls(**data)


def request_sampling(job: SamplingParams, own: dict[str, Any] | None = None, **fixed: Any) -> SamplingParams:
    """A request's sampling, merged in this one place: the job's settings, overridden by the request's own
    (an OpenAI batch line's, a row's JSON schema), then by what each request fixes (its token budget and
    seed). Submit checks a request with it; the worker and the in-memory stage run it."""
    return SamplingParams.from_dict({**job.to_dict(), **(own or {}), **fixed})


def request_seed(*key: Any) -> int:
    """A request's own seed from what identifies it (the job's seed, its row and sample): its sampled output
    never depends on what it was batched with."""
    digest = hashlib.blake2b(":".join(str(part) for part in key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits a signed 64-bit column


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the engine. Sizes left as None are derived from the machine and the model."""

    dtype: str = "auto"  # resolved to one of DTYPES when the model loads (engine/memory.choose_dtype)
    # the linear layers' weights: none (as loaded), int8 (W8A8, engine/quant.py), gguf (a GGUF file's own blocks,
    # engine/blocks.py); auto: none where the dequantized weights fit in memory, else gguf (engine/runner.py)
    quantization: str = "auto"
    device: str = "auto"
    block_size: int = 32  # tokens per KV block (32 reads K/V in longer runs than 16: BENCHMARKS.md, session 7)
    kv_cache_memory: int | None = None  # bytes for K and V of all layers
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV when kv_cache_memory is None
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 1024  # tokens computed per step (the token budget)
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # kernel: our C kernels (CPU); torch: pure torch; triton: Triton (GPU)
    kernels: str = "auto"  # CPU path per kernel family: auto (measured), c, torch, or "family=path,..."
    num_threads: int | None = None  # torch intra-op threads on CPU
    pack_weights: bool = True  # CPU: pack linear weights once for our C GEMM (float32, bfloat16) or oneDNN
    fast_forward: bool = True  # Llama family: our lean forward (False: always Hugging Face's modules)
    cuda_graphs: bool = False  # GPU: replay pure-decode steps as CUDA graphs (off until measured on a GPU)
    # drafts with no draft model, verified in the normal step (engine/speculate.py): auto drafts where the step has
    # room for them as measured; off never drafts. The outputs are the same either way.
    speculate: str = "auto"

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPE_CHOICES, f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        _check(self.quantization in QUANTIZATIONS,
               f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _check(self.device in DEVICES or self.device.startswith("cuda:"),
               f"device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}")
        power_of_two = isinstance(self.block_size, int) and self.block_size >= 1 \
            and self.block_size & (self.block_size - 1) == 0
        _check(power_of_two,
               f"block size must be a power of two, got {self.block_size!r}")
        _check(self.kv_cache_memory is None or (isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 0),
               f"kv-cache-memory must be a positive size such as 2GiB, got {self.kv_cache_memory!r}")
        _check(_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
               f"gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
               f"max-num-seqs must be >= 1, got {self.max_num_seqs!r}")
        _check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
               f"max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        _check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
               f"max-model-len must be >= 2, got {self.max_model_len!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        _check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
               f"num-threads must be >= 1, got {self.num_threads!r}")
        parse_kernels(self.kernels)
        _check(self.speculate in SPECULATE, f"speculate must be one of {', '.join(SPECULATE)}, got {self.speculate!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """An EngineConfig of options named as its fields (the CLI's, the API's), a KV cache size as written
        ("2GiB", or a number of bytes; empty: derived). The one place a user's engine options become one."""
        size = options.get("kv_cache_memory")
        return cls(**{**options, "kv_cache_memory": parse_size(size) if size else None})


def parse_json_schema(text: str, what: str = "the JSON schema") -> dict[str, Any]:
    """A JSON schema's text -> the schema (a JSON object); ConfigError naming `what` otherwise."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ConfigError(f"{what} must be a JSON object (a JSON schema)")
    return schema


def parse_kernels(spec: str) -> dict[str, str]:
    """A --kernels / BULKGEN_KERNELS value -> {family: "c" | "torch"} for the families it forces.

    "auto" forces none (each is measured); "c" or "torch" forces all; "linear=torch,attention=c" forces
    those named ("attention" is both attention families, "all" every family)."""
    if not isinstance(spec, str):
        raise ConfigError(f"kernels must be a string such as auto, c, torch or linear=torch, got {spec!r}")
    text = spec.strip().lower()
    if text in ("", "auto"):
        return {}
    if text in KERNEL_PATHS:
        return dict.fromkeys(KERNEL_FAMILIES, text)
    forced: dict[str, str] = {}
    for item in text.split(","):
        name, eq, path = (part.strip() for part in item.partition("="))
        families = KERNEL_FAMILY_GROUPS.get(name, (name,) if name in KERNEL_FAMILIES else None)
        if not eq or families is None or path not in (*KERNEL_PATHS, "auto"):
            raise ConfigError(
                f"cannot read {item.strip()!r} in kernels {spec!r}: write auto, c, torch, or FAMILY=PATH pairs "
                f"separated by commas, FAMILY one of {', '.join((*KERNEL_FAMILIES, *KERNEL_FAMILY_GROUPS))} and "
                "PATH c, torch or auto (e.g. linear=torch,attention=c)")
        for family in families:
            if path == "auto":
                forced.pop(family, None)
            else:
                forced[family] = path
    return forced


@dataclass(frozen=True)
class Paths:
    """Where bulkgen keeps its database and its model cache (see README, 'Where data lives')."""

    data_dir: Path = field(default_factory=lambda: _env_dir("BULKGEN_HOME", "XDG_DATA_HOME", ".local/share"))
    cache_dir: Path = field(default_factory=lambda: _env_dir("BULKGEN_CACHE", "XDG_CACHE_HOME", ".cache"))

    @property
    def default_db_url(self) -> str:
        return os.environ.get("BULKGEN_DB") or f"sqlite:///{self.data_dir / 'bulkgen.db'}"

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """'4GiB' → 4294967296; '512MB' → 512000000; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot read size {text!r}: write a number with a unit, such as 512MiB or 4GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _env_dir(own_var: str, xdg_var: str, home_default: str) -> Path:
    if os.environ.get(own_var):
        return Path(os.environ[own_var]).expanduser()
    base = os.environ.get(xdg_var) or str(Path.home() / home_default)
    return Path(base).expanduser() / "bulkgen"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
