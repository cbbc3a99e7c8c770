"""Paged attention in our C kernels (csrc/paged_attention.c): decode rows over their blocks in place, and a
prefill chunk's rows in tiles that share each K/V block load. engine/attention.attend calls these where
paths.py chose C for the family; the torch path there is their reference.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.metadata import CpuMetadata, LayerAttention, PrefillChunk


def kernel_layout(k_cache: torch.Tensor) -> bool:
    """Whether the C kernels know this K layout: 4-byte groups of dims (float32 alone, bfloat16 in pairs)."""
    return k_cache.shape[-1] * k_cache.element_size() == 4


SHARED_ITEM = 8  # sequences a work item of the shared decode at most (csrc/paged_attention.c: SHARED_MAX 16)


@cache
def last_level_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the deepest data cache the first core has (its L3 on the machines we know), from sysfs; None
    where the system does not say."""
    deepest: tuple[int, int] | None = None
    for index in cpu_dir.glob("index*"):
        try:
            level, kind = int((index / "level").read_text()), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if kind in ("Data", "Unified") and digits.isdigit() and (deepest is None or level > deepest[0]):
            deepest = (level, int(digits) * scale)
    return deepest[1] if deepest else None


def shared_decode_pays(shared_blocks: int, block_bytes: int, cache_bytes: int | None) -> bool:
    """Whether a decode step's sequences that share blocks go in shared work items (paged_decode_shared) rather
    than one at a time: where the blocks that several of them read in one layer (shared_blocks of block_bytes, K
    and V) fill more than half the last-level cache. Below that they stay in the cache from one sequence to the
    next, and on an AMD Zen 4 (32 MB L3) the shared items were slower than one sequence at a time (0.75-0.9x at
    11 MB a layer); above it each sequence reads them from memory again (the shared items 1.15-1.65x there at 23-45
    MB; BENCHMARKS.md, issue 42). Where the cache's size is unknown, the shared items (the side that bounds memory
    traffic)."""
    return cache_bytes is None or 2 * shared_blocks * block_bytes > cache_bytes


def shared_items(tables: np.ndarray, context_lens: list[int], block_size: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The decoding sequences (rows of tables [num_decodes, max_blocks], their context lengths) in work items
    for paged_decode_shared: the tables sorted, so that those sharing the most leading blocks (a prefix from the
    prefix cache) come together, then cut into items of up to SHARED_ITEM sequences that share a run of whole
    blocks within every one's context, an item closed where one more sequence would share less (a document's
    questions apart from the next document's, though all share the chat template's first block); a sequence
    that shares nothing is an item alone. (order, starts, shared tokens) as int32 tensors, or None where no two
    sequences share a block."""
    n = len(context_lens)
    if n < 2:
        return None
    order = np.lexsort(tables.T[::-1])  # by the first block, then the second, ...
    rows = tables[order]
    full = np.asarray(context_lens)[order] // block_size  # whole blocks within each one's context
    common = np.cumprod(rows[1:] == rows[:-1], axis=1).sum(axis=1)  # with the sequence before it
    common = np.minimum(common, np.minimum(full[1:], full[:-1]))
    if not common.any():
        return None
    starts, shared = [0], []
    blocks = 0  # the open item's shared blocks (0 while it holds one sequence)
    for i in range(1, n):
        size = i - starts[-1]
        run = min(blocks, common[i - 1]) if size > 1 else common[i - 1]
        if size < SHARED_ITEM and run > 0 and (size == 1 or run >= blocks):
            blocks = run
            continue
        starts.append(i)
        shared.append(blocks * block_size)
        blocks = 0
    starts.append(n)
    shared.append(blocks * block_size)
    return tuple(torch.tensor(values, dtype=torch.int32) for values in (order, starts, shared))


def decode_c(meta: CpuMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             scale: float, layer: LayerAttention) -> torch.Tensor:
    """Decode attention of the step's decoding sequences (q [num_decodes, num_heads, head_dim]) in C: where some
    share their first blocks (full attention), in work items that read each shared block once for all of
    them (the same bits as one sequence at a time)."""
    tables = meta.decode_block_tables
    return _paged_c(meta.decode_kernel, meta, q, k_cache, v_cache, tables, tables.stride(0),
                    meta.decode_context_lens, meta.decode_max_context_len, scale, layer,
                    None if layer.window else meta.decode_shared)


def prefill_c(meta: CpuMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              chunk: PrefillChunk, scale: float, layer: LayerAttention) -> torch.Tensor:
    """A prefill chunk's attention in C: on AMX tiles where they apply (bfloat16, plain attention), else rows
    in tiles sharing each K/V block load where the vectorised kernel applies, else row by row (each row a
    decode with its own context length)."""
    kernel = meta.prefill_kernel
    if kernel.amx and q.dtype == torch.bfloat16 and layer.plain and not layer.window:
        q16 = q.contiguous()
        out16 = torch.empty_like(q16)
        num_rows, num_heads, head_dim = q16.shape
        _, num_kv_heads, block_size, _ = v_cache.shape
        status = kernel.paged_prefill_amx(
            q=q16.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
            table=chunk.block_table.data_ptr(), start=chunk.start, n=num_rows, out=out16.data_ptr(),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, scale=scale,
            num_threads=meta.num_threads)
        if status == 1:
            raise MemoryError("paged attention kernel could not allocate its scratch buffer")
        if status == 0:
            return out16
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    num_rows, num_heads, head_dim = q32.shape
    _, num_kv_heads, block_size, _ = v_cache.shape
    function = kernel.typed("paged_prefill", k_cache.dtype)
    status = function(q=q32.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                      table=chunk.block_table.data_ptr(), start=chunk.start, n=num_rows, out=out.data_ptr(),
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      scale=scale, window=layer.window, softcap=layer.softcap, sinks=layer.c_sinks(),
                      num_threads=meta.num_threads)
    if status == 1:
        raise MemoryError("paged attention kernel could not allocate its scratch buffer")
    if status == 2:
        lens = torch.arange(chunk.start + 1, chunk.start + num_rows + 1, dtype=torch.int32)
        return _paged_c(kernel, meta, q, k_cache, v_cache, chunk.block_table, 0, lens, chunk.start + num_rows,
                        scale, layer)
    return out.to(q.dtype)


def _paged_c(kernel: Kernels, meta: CpuMetadata, q: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, tables: torch.Tensor, table_stride: int, context_lens: torch.Tensor,
             max_context_len: int, scale: float, layer: LayerAttention,
             shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The C kernel: query row i ([rows, num_heads, head_dim]) attends to the first context_lens[i]
    tokens of the blocks in row i of `tables` (table_stride 0: one table for every row), or the last
    layer.window of them. shared: shared_items' work items, for paged_decode_shared (where it does not apply,
    paged_decode runs)."""
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    num_rows, num_heads, head_dim = q32.shape
    _, num_kv_heads, block_size, _ = v_cache.shape
    args = dict(q=q32.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                block_tables=tables.data_ptr(), block_table_stride=table_stride,
                context_lens=context_lens.data_ptr(), out=out.data_ptr(), num_seqs=num_rows, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                max_context_len=max_context_len, scale=scale, window=layer.window, softcap=layer.softcap,
                sinks=layer.c_sinks(), num_threads=meta.num_threads)
    status = 2
    if shared is not None:
        order, starts, tokens = shared
        status = kernel.typed("paged_decode_shared", k_cache.dtype)(
            **args, order=order.data_ptr(), starts=starts.data_ptr(), shared=tokens.data_ptr(),
            num_items=len(tokens))
    if status == 2:
        status = kernel.typed("paged_decode", k_cache.dtype)(**args)
    if status:
        raise MemoryError("paged attention kernel could not allocate its scratch buffer")
    return out.to(q.dtype)
