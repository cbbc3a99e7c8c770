"""The race of a kernel family's two paths (C and torch) on a model's own shapes: one layer's linear layers
(output columns capped to bound the work) at a decode-sized and a prefill-sized batch, paged attention over a
random cache, the small ops, the sampler's draws over the vocabulary. paths.py runs it once per machine,
model shape, dtype and thread count, and keeps the faster path.

Costs are per token of a job that computes two prompt tokens (in chunks of PREFILL_ROWS) for each token
it generates (in decode steps of DECODE_ROWS sequences).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bulkgen.config import SamplingParams
from bulkgen.engine import attention, metadata
from bulkgen.engine.cpu.attention import decode_c, prefill_c
from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.cpu.ops import Ops
from bulkgen.engine.draws import Candidates, sample_rows
from bulkgen.engine.layers import GatedLinear, Linear, rotate
from bulkgen.model import ModelShape

DECODE_ROWS, PREFILL_ROWS, PREFILL_WEIGHT = 16, 256, 2.0
FLOP_BUDGET = 2.5e8  # floating-point operations per thread for one prefill-sized call of a linear family


def race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, block_size: int, racing: list[str],
         small_ops_c: bool | None) -> dict[str, tuple[float, float]]:
    """Per-token seconds (C, torch) of each racing family, small ops first (gated_mlp's torch path uses them,
    in C where small_ops_c, when the small ops do not race)."""
    timings: dict[str, tuple[float, float]] = {}
    with torch.inference_mode():
        if "small_ops" in racing:
            timings["small_ops"] = _mix(lambda m: _small_ops_step(Ops(kernel, dtype), m, dtype, shape),
                                 lambda m: _small_ops_step(Ops(None, dtype), m, dtype, shape))
        if "small_ops" in timings:
            small_ops_c = timings["small_ops"][0] <= timings["small_ops"][1]
        if "linear" in racing:
            timings["linear"] = _mix(*(_linear_step(k, dtype, shape) for k in (kernel, None)))
        if "gated_mlp" in racing:
            ops = Ops(kernel if small_ops_c else None, dtype)
            timings["gated_mlp"] = _mix(*(_gated_step(k, ops, dtype, shape) for k in (kernel, None)))
        if "decode_attention" in racing:
            timings["decode_attention"] = _decode_race(kernel, dtype, shape, block_size)
        if "prefill_attention" in racing:
            timings["prefill_attention"] = _prefill_race(kernel, dtype, shape, block_size)
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
    layers = [Linear(_randn(generator, dtype, _capped(n, k, 3), k) * k ** -0.5, None, pack=True,
                             kernel=kernel) for n, k in dims]

    def step(rows: int) -> Callable[[], object]:
        xs = [_randn(generator, dtype, rows, k) for _, k in dims]
        return lambda: [layer(x) for layer, x in zip(layers, xs, strict=True)]
    return step


def _gated_step(kernel: Kernels | None, ops: Ops, dtype: torch.dtype,
                shape: ModelShape) -> Callable[[int], Callable]:
    generator = torch.Generator().manual_seed(0)
    n = _capped(shape.intermediate, shape.hidden, 2)
    gate, up = (torch.nn.Linear(shape.hidden, n, bias=False, dtype=dtype) for _ in range(2))
    for linear in (gate, up):
        linear.weight.data = _randn(generator, dtype, n, shape.hidden) * shape.hidden ** -0.5
    layer = GatedLinear(gate, up, pack=True, kernel=kernel, ops=ops)

    def step(rows: int) -> Callable[[], object]:
        x = _randn(generator, dtype, rows, shape.hidden)
        return lambda: layer(x)
    return step


def _randn(generator: torch.Generator, dtype: torch.dtype, *size: int) -> torch.Tensor:
    """Random values from our own generator (the race leaves torch's global one alone)."""
    return torch.randn(*size, generator=generator).to(dtype)


def _small_ops_step(ops: Ops, rows: int, dtype: torch.dtype, shape: ModelShape) -> Callable[[], object]:
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
            rotate(q, cos, sin)
        ops.add_rms_norm(h, x, weight[0], 1e-5)
        return ops.silu_mul(gate_up)
    return run


def _paged_cache(generator: torch.Generator, dtype: torch.dtype, shape: ModelShape, block_size: int, num_seqs: int,
                 context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random one-layer paged cache holding num_seqs sequences of `context` tokens in shuffled blocks:
    K, V and the block tables [num_seqs, blocks a sequence] (int32)."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = 2 * num_seqs * blocks_per_seq
    k_cache = _randn(generator, dtype, num_blocks,
                     *metadata.k_block_shape(shape.num_kv_heads, shape.head_dim, block_size, dtype))
    v_cache = _randn(generator, dtype, num_blocks, shape.num_kv_heads, block_size, shape.head_dim)
    order = torch.randperm(num_blocks, generator=generator)
    return k_cache, v_cache, order[:num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).int()


def _decode_race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, block_size: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    context = 512
    k_cache, v_cache, tables = _paged_cache(generator, dtype, shape, block_size, DECODE_ROWS, context)
    lens = torch.full((DECODE_ROWS,), context, dtype=torch.int32)
    q = _randn(generator, dtype, DECODE_ROWS, shape.num_heads, shape.head_dim)
    meta = metadata.CpuMetadata(k_caches=[k_cache], v_caches=[v_cache], slots=None, slot_blocks=None,
                                slot_offsets=None, num_decode_tokens=DECODE_ROWS, decode_block_tables=tables,
                                decode_context_lens=lens, decode_max_context_len=context, decode_kernel=kernel,
                                num_threads=torch.get_num_threads())
    scale = shape.head_dim ** -0.5
    c_s, torch_s = _best_of(lambda: decode_c(meta, q, k_cache, v_cache, scale, metadata.FULL),
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
    candidates = Ops(None, torch.float32, sampler=kernel).candidates

    def draw(c: Candidates | None) -> Callable[[], object]:
        return lambda: sample_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(DECODE_ROWS)],
                                   candidates=c)
    c_s, torch_s = _best_of(draw(candidates), draw(None), reps=5)
    return c_s / DECODE_ROWS, torch_s / DECODE_ROWS


def _prefill_race(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, block_size: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    rows = PREFILL_ROWS
    k_cache, v_cache, tables = _paged_cache(generator, dtype, shape, block_size, 1, rows)
    q = _randn(generator, dtype, rows, shape.num_heads, shape.head_dim)
    k, v = (_randn(generator, dtype, rows, shape.num_kv_heads, shape.head_dim) for _ in range(2))
    chunk = metadata.PrefillChunk(offset=0, num_tokens=rows, start=0, block_table=tables[0])
    meta = metadata.CpuMetadata(k_caches=[k_cache], v_caches=[v_cache], slots=None, slot_blocks=None,
                                slot_offsets=None, num_decode_tokens=0, decode_block_tables=tables[:0],
                                decode_context_lens=tables[0, :0], decode_max_context_len=0, prefills=[chunk],
                                prefill_kernel=kernel, num_threads=torch.get_num_threads())
    scale = shape.head_dim ** -0.5

    def in_torch() -> torch.Tensor:  # attention.attend's path for a chunk with nothing cached before it
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    c_s, torch_s = _best_of(lambda: prefill_c(meta, q, k_cache, v_cache, chunk, scale, metadata.FULL), in_torch,
                            reps=3)
    return c_s / rows, torch_s / rows
