"""Which path each CPU kernel family takes on this machine: bulkgen's C kernels or plain torch.

A kernel tuned on one CPU is a regression on another until measured (built for AVX2, the kernels tuned
on AVX-512 ran 4x slower than torch; on an AMX CPU torch's bfloat16 GEMM is 5x our AVX512-BF16 one), so
the choice is made where the engine runs, family by family, in this order:
1. forced: BULKGEN_NO_KERNEL=1 (pure torch everywhere), `--kernels` / BULKGEN_KERNELS (c, torch, or
   family=path pairs), `--attention-backend`;
2. what the C kernels can take: a library built here, float32 or bfloat16, the bfloat16 linear layers only
   with AVX512-BF16, the linear families only where the lean Llama forward runs;
3. a race of both paths on the model's own shapes: one layer's linear layers (output columns capped to
   bound the work) at a decode-sized and a prefill-sized batch, paged attention over a random cache, the
   small ops, the sampler's draws over the vocabulary. A few hundred milliseconds, once per machine, model shape, dtype and thread count: the
   result is cached as JSON beside the compiled kernels. The faster path runs; a tie goes to C (its
   linear layers give each row the same bits whatever the batch).

Costs are per token of a job that computes two prompt tokens (in chunks of PREFILL_ROWS) for each token
it generates (in decode steps of DECODE_ROWS sequences).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bulkgen.config import KERNEL_FAMILIES, EngineConfig, Paths, SamplingParams
from bulkgen.engine import attention, forward
from bulkgen.engine.cpu import describe_cpu, torch_capability
from bulkgen.engine.draws import Candidates, sample_rows
from bulkgen.engine.kernels import Kernels
from bulkgen.errors import ConfigError

log = logging.getLogger(__name__)

KERNELS_ENV = "BULKGEN_KERNELS"  # the --kernels setting for processes started without the flag
DECODE_ROWS, PREFILL_ROWS, PREFILL_WEIGHT = 16, 256, 2.0
FLOP_BUDGET = 2.5e8  # floating-point operations per thread for one prefill-sized call of a linear family
CACHE_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """What the race needs of a model."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    lean: bool  # the lean Llama forward runs (the linear families exist)
    vocab: int = 32000  # the sampler's rows


def model_shape(model: torch.nn.Module, config: EngineConfig) -> ModelShape:
    hf = model.config
    num_heads = hf.num_attention_heads
    hidden = hf.hidden_size
    return ModelShape(hidden=hidden, intermediate=getattr(hf, "intermediate_size", None) or 4 * hidden,
                      num_heads=num_heads, num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
                      head_dim=getattr(hf, "head_dim", None) or hidden // num_heads, block_size=config.block_size,
                      lean=config.fast_forward and forward.unsupported_reason(model) is None,
                      vocab=model.get_output_embeddings().weight.shape[0])


@dataclass(frozen=True)
class FamilyPath:
    use_c: bool
    reason: str


@dataclass(frozen=True)
class CpuPaths:
    kernel: Kernels | None
    families: dict[str, FamilyPath]
    note: str = ""  # how the measured families were measured (now, or when, from the cache)

    def c(self, family: str) -> Kernels | None:
        """The kernel library where `family` runs in C, else None (torch)."""
        return self.kernel if self.families[family].use_c else None

    def short(self) -> str:
        """'C: linear gated_mlp decode_attention; torch: prefill_attention small_ops'"""
        sides = {label: " ".join(name for name, path in self.families.items() if path.use_c == use_c)
                 for label, use_c in (("C", True), ("torch", False))}
        return "; ".join(f"{label}: {names}" for label, names in sides.items() if names)

    def lines(self) -> list[str]:
        return [f"{name}: {'C' if path.use_c else 'torch'} ({path.reason})" for name, path in self.families.items()]

    @classmethod
    def torch_only(cls, reason: str) -> CpuPaths:
        return cls(None, {name: FamilyPath(False, reason) for name in KERNEL_FAMILIES})


def choose(kernel: Kernels | None, dtype: torch.dtype, shape: ModelShape, forced: dict[str, str],
           forced_by: str, no_kernel_reason: str) -> CpuPaths:
    """Each family's path on this machine (see the module docstring for the order of the rules)."""
    if kernel is None:
        for family, path in forced.items():
            if path == "c":
                raise ConfigError(f"{forced_by} asks for {family} in C, but {no_kernel_reason}")
        return CpuPaths.torch_only(no_kernel_reason)
    families: dict[str, FamilyPath] = {}
    racing = []
    for family in KERNEL_FAMILIES:
        if family in ("linear", "gated_mlp") and not shape.lean:
            families[family] = FamilyPath(False, "not used: the model runs through Hugging Face's modules "
                                                 "(oneDNN linear layers)")
            continue
        why_not = _why_not_c(kernel, family, dtype, shape)
        want = forced.get(family)
        if want == "c" and why_not is not None:
            raise ConfigError(f"{forced_by} asks for {family} in C, but {why_not}")
        if want is not None:
            families[family] = FamilyPath(want == "c", f"forced by {forced_by}")
        elif why_not is not None:
            families[family] = FamilyPath(False, why_not)
        else:
            racing.append(family)
    note = ""
    if racing:
        measured, note = _race_cached(kernel, dtype, shape, racing, families)
        families.update(measured)
    return CpuPaths(kernel, {name: families[name] for name in KERNEL_FAMILIES}, note)


def describe_machine(dtype: torch.dtype) -> str:
    return f"CPU {describe_cpu()} (torch: {torch_capability()}), {str(dtype).removeprefix('torch.')}"


def _why_not_c(kernel: Kernels, family: str, dtype: torch.dtype, shape: ModelShape) -> str | None:
    if family == "sampler":
        return None  # it reads float32 logits, whatever the model's dtype
    if dtype not in forward.DTYPE_CODES:
        return f"the C kernels take float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if family in ("linear", "gated_mlp"):
        if dtype == torch.bfloat16 and not all(kernel.linear_bf16_available(K=k) for k in
                                               (shape.hidden, shape.intermediate, shape.num_heads * shape.head_dim)):
            return "the C bfloat16 linear layers need AVX512-BF16 and even input sizes"
    return None


def _race_cached(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, racing: list[str],
                 decided: dict[str, FamilyPath]) -> tuple[dict[str, FamilyPath], str]:
    key_text = json.dumps([CACHE_VERSION, kernel.path.name, torch.__version__, str(dtype), asdict(shape),
                           torch.get_num_threads(), sorted(racing), decided.get("small_ops", FamilyPath(False, ""))
                           .use_c])
    cache_file = Paths().cache_dir / "kernels" / f"paths-{hashlib.sha256(key_text.encode()).hexdigest()[:16]}.json"
    try:
        timings = json.loads(cache_file.read_text())
        note = f"measured on this machine {timings.pop('_measured_at')} (cached in {cache_file})"
    except (OSError, ValueError, KeyError):
        started = time.perf_counter()
        timings = _race(kernel, dtype, shape, racing, decided)
        note = f"measured on this machine now, in {time.perf_counter() - started:.2f} s"
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**timings, "_measured_at": time.strftime("%Y-%m-%d %H:%M")}))
            os.replace(tmp, cache_file)
        except OSError as exc:
            log.warning("bulkgen: could not cache the kernel timings in %s (%s)", cache_file, exc)
    out = {}
    for family in racing:
        c_s, torch_s = timings[family]
        faster = f"C {torch_s / c_s:.2f}x torch" if c_s <= torch_s else f"torch {c_s / torch_s:.2f}x C"
        out[family] = FamilyPath(c_s <= torch_s, f"measured: {faster}, {c_s * 1e6:.1f} vs {torch_s * 1e6:.1f} us a token")
    return out, note


def _race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, racing: list[str],
          decided: dict[str, FamilyPath]) -> dict[str, tuple[float, float]]:
    """Per-token seconds (C, torch) of each racing family, small ops first (gated_mlp's torch path uses them)."""
    timings: dict[str, tuple[float, float]] = {}
    with torch.inference_mode():
        if "small_ops" in racing:
            timings["small_ops"] = _mix(lambda m: _small_ops_step(forward.Ops(kernel, dtype), m, dtype, shape),
                                        lambda m: _small_ops_step(forward.Ops(None, dtype), m, dtype, shape))
        small_ops_c = timings["small_ops"][0] <= timings["small_ops"][1] if "small_ops" in timings \
            else decided["small_ops"].use_c
        if "linear" in racing:
            timings["linear"] = _mix(*(_linear_step(k, dtype, shape) for k in (kernel, None)))
        if "gated_mlp" in racing:
            ops = forward.Ops(kernel if small_ops_c else None, dtype)
            timings["gated_mlp"] = _mix(*(_gated_step(k, ops, dtype, shape) for k in (kernel, None)))
        if "decode_attention" in racing:
            timings["decode_attention"] = _decode_race(kernel, dtype, shape)
        if "prefill_attention" in racing:
            timings["prefill_attention"] = _prefill_race(kernel, dtype, shape)
        if "sampler" in racing:
            timings["sampler"] = _sampler_race(kernel, shape)
    return timings


def _best_of(c_step: Callable[[], object], torch_step: Callable[[], object], reps: int) -> tuple[float, float]:
    """Least seconds of each step over `reps` alternating runs (alternating: a burst of load on a shared
    machine hits both alike), after one warm-up run each."""
    c_step(), torch_step()
    best_c = best_torch = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        c_step()
        t1 = time.perf_counter()
        torch_step()
        t2 = time.perf_counter()
        best_c, best_torch = min(best_c, t1 - t0), min(best_torch, t2 - t1)
    return best_c, best_torch


def _mix(c_step: Callable[[int], Callable[[], object]],
         torch_step: Callable[[int], Callable[[], object]]) -> tuple[float, float]:
    """Per-token cost of a row-wise family: a decode step of DECODE_ROWS rows per generated token, plus
    PREFILL_WEIGHT prompt tokens in chunks of PREFILL_ROWS. c_step(rows) returns a function running one step."""
    decode = _best_of(c_step(DECODE_ROWS), torch_step(DECODE_ROWS), reps=7)
    prefill = _best_of(c_step(PREFILL_ROWS), torch_step(PREFILL_ROWS), reps=3)
    return tuple(d / DECODE_ROWS + PREFILL_WEIGHT * p / PREFILL_ROWS for d, p in zip(decode, prefill, strict=True))


def _capped(columns: int, inputs: int, num_matrices: int) -> int:
    """Output columns to time a [columns, inputs] weight with, so that a prefill-sized call stays within
    the FLOP budget (a multiple of 48, the C panel width; at least one panel per thread)."""
    budget = FLOP_BUDGET * torch.get_num_threads() / (2 * PREFILL_ROWS * inputs * num_matrices)
    cap = max(48 * torch.get_num_threads(), int(budget) // 48 * 48)
    return min(columns, cap)


def _linear_step(kernel: Kernels | None, dtype: torch.dtype, shape: ModelShape) -> Callable[[int], Callable]:
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = [(q_size + 2 * kv_size, shape.hidden), (shape.hidden, q_size), (shape.hidden, shape.intermediate)]
    generator = torch.Generator().manual_seed(0)
    layers = [forward.Linear(_randn(generator, dtype, _capped(n, k, 3), k) * k ** -0.5, None, pack=True,
                             kernel=kernel) for n, k in dims]

    def step(rows: int) -> Callable[[], object]:
        xs = [_randn(generator, dtype, rows, k) for _, k in dims]
        return lambda: [layer(x) for layer, x in zip(layers, xs, strict=True)]
    return step


def _gated_step(kernel: Kernels | None, ops: forward.Ops, dtype: torch.dtype,
                shape: ModelShape) -> Callable[[int], Callable]:
    generator = torch.Generator().manual_seed(0)
    n = _capped(shape.intermediate, shape.hidden, 2)
    gate, up = (torch.nn.Linear(shape.hidden, n, bias=False, dtype=dtype) for _ in range(2))
    for linear in (gate, up):
        linear.weight.data = _randn(generator, dtype, n, shape.hidden) * shape.hidden ** -0.5
    layer = forward.GatedLinear(gate, up, pack=True, kernel=kernel, ops=ops)

    def step(rows: int) -> Callable[[], object]:
        x = _randn(generator, dtype, rows, shape.hidden)
        return lambda: layer(x)
    return step


def _randn(generator: torch.Generator, dtype: torch.dtype, *size: int) -> torch.Tensor:
    """Random values from our own generator (the race leaves torch's global one alone)."""
    return torch.randn(*size, generator=generator).to(dtype)


def _small_ops_step(ops: forward.Ops, rows: int, dtype: torch.dtype, shape: ModelShape) -> Callable[[], object]:
    """A layer's small ops on `rows` tokens: two RMSNorms with their residual adds, RoPE, SiLU-and-multiply."""
    generator = torch.Generator().manual_seed(0)
    h, res, weight = (_randn(generator, dtype, rows, shape.hidden) for _ in range(3))
    heads = shape.num_heads + shape.num_kv_heads
    qkv = _randn(generator, dtype, rows, (heads + shape.num_kv_heads) * shape.head_dim)
    cos, sin = (_randn(generator, dtype, rows, shape.head_dim) for _ in range(2))
    gate_up = _randn(generator, dtype, rows, 2 * shape.intermediate)

    def run() -> object:
        x = ops.add_rms_norm(h, res, weight[0], 1e-5)
        if ops.rope(qkv, heads, shape.head_dim, cos, sin) is None:
            q = qkv[:, :heads * shape.head_dim].view(rows, heads, shape.head_dim)
            forward.rotate(q, cos, sin)
        ops.add_rms_norm(h, x, weight[0], 1e-5)
        return ops.silu_mul(gate_up)
    return run


def _paged_cache(generator: torch.Generator, dtype: torch.dtype, shape: ModelShape, num_seqs: int,
                 context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random one-layer paged cache holding num_seqs sequences of `context` tokens in shuffled blocks:
    K, V and the block tables [num_seqs, blocks a sequence] (int32)."""
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = 2 * num_seqs * blocks_per_seq
    k_cache = _randn(generator, dtype, num_blocks,
                     *attention.k_block_shape(shape.num_kv_heads, shape.head_dim, shape.block_size, dtype))
    v_cache = _randn(generator, dtype, num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
    order = torch.randperm(num_blocks, generator=generator)
    return k_cache, v_cache, order[:num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).int()


def _decode_race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    context = 512
    k_cache, v_cache, tables = _paged_cache(generator, dtype, shape, DECODE_ROWS, context)
    lens = torch.full((DECODE_ROWS,), context, dtype=torch.int32)
    q = _randn(generator, dtype, DECODE_ROWS, shape.num_heads, shape.head_dim)
    meta = attention.AttentionMetadata([k_cache], [v_cache], None, None, None, DECODE_ROWS, tables, lens, context,
                                       decode_kernel=kernel, num_threads=torch.get_num_threads())
    scale = shape.head_dim ** -0.5
    c_s, torch_s = _best_of(lambda: attention.decode_c(meta, q, k_cache, v_cache, scale),
                            lambda: attention.decode_torch(q, k_cache, v_cache, tables, lens, scale), reps=5)
    return c_s / DECODE_ROWS, torch_s / DECODE_ROWS


def _sampler_race(kernel: Kernels, shape: ModelShape) -> tuple[float, float]:
    """A decode step's draws at T 0.8, top-p 0.95 (the common setting) over the model's vocabulary: the
    C kernels' pass over each row against torch's topk and sums; per generated token."""
    # rows like a model's: a tail of noise and a few strong tokens, so that the nucleus is a few dozen wide
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(DECODE_ROWS, shape.vocab, generator=generator) * 1.5
    strong = torch.randint(0, shape.vocab, (DECODE_ROWS, 32), generator=generator)
    logits.scatter_add_(1, strong, torch.linspace(16.0, 8.0, 32).expand(DECODE_ROWS, 32).contiguous())
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * DECODE_ROWS
    candidates = forward.Ops(None, torch.float32, sampler=kernel).candidates

    def draw(c: Candidates | None) -> Callable[[], object]:
        return lambda: sample_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(DECODE_ROWS)],
                                   candidates=c)
    c_s, torch_s = _best_of(draw(candidates), draw(None), reps=5)
    return c_s / DECODE_ROWS, torch_s / DECODE_ROWS


def _prefill_race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    rows = PREFILL_ROWS
    k_cache, v_cache, tables = _paged_cache(generator, dtype, shape, 1, rows)
    q = _randn(generator, dtype, rows, shape.num_heads, shape.head_dim)
    k, v = (_randn(generator, dtype, rows, shape.num_kv_heads, shape.head_dim) for _ in range(2))
    chunk = attention.PrefillChunk(offset=0, num_tokens=rows, start=0, block_table=tables[0])
    meta = attention.AttentionMetadata([k_cache], [v_cache], None, None, None, 0, tables[:0], tables[0, :0], 0,
                                       [chunk], prefill_kernel=kernel, num_threads=torch.get_num_threads())
    scale = shape.head_dim ** -0.5

    def in_torch() -> torch.Tensor:  # attention.attend's path for a chunk with nothing cached before it
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    c_s, torch_s = _best_of(lambda: attention.prefill_c(meta, q, k_cache, v_cache, chunk, scale), in_torch,
                            reps=3)
    return c_s / rows, torch_s / rows
