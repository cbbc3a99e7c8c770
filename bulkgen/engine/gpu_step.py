"""A step's metadata for the Triton kernels, built on the host as one int32 buffer and sent to the device
in one copy (from pinned memory on a GPU): one transfer a step instead of one per tensor."""

from __future__ import annotations

import numpy as np
import torch

from bulkgen.engine.attention import TritonStep


def triton_step(slots: list[int], decode_tables: list[list[int]], decode_context_lens: list[int],
                chunks: list[tuple[int, int, int, list[int]]], device: torch.device, num_kv_heads: int,
                group: int) -> TritonStep:
    """slots: each new token's cache slot; decode_tables, decode_context_lens: per decoding sequence; chunks:
    per prefill chunk (offset in the batch, length, tokens cached before it, block table)."""
    from bulkgen.engine import triton_attention

    num_decodes, num_chunks = len(decode_tables), len(chunks)
    decode_width = max((len(t) for t in decode_tables), default=0)
    chunk_width = max((len(c[3]) for c in chunks), default=0)
    tile_chunks, tile_rows = triton_attention.prefill_tiles([c[1] for c in chunks],
                                                            triton_attention.prefill_block_m(group))
    sizes = [len(slots), num_decodes * decode_width, num_decodes, len(tile_chunks), len(tile_rows), num_chunks,
             num_chunks, num_chunks, num_chunks * chunk_width]
    host = np.zeros(sum(sizes), dtype=np.int32)
    parts = np.split(host, np.cumsum(sizes)[:-1])
    parts[0][:] = slots
    tables = parts[1].reshape(num_decodes, decode_width)
    for i, table in enumerate(decode_tables):
        tables[i, :len(table)] = table
    parts[2][:] = decode_context_lens
    parts[3][:], parts[4][:] = tile_chunks, tile_rows
    chunk_tables = parts[8].reshape(num_chunks, chunk_width)
    for i, (offset, length, start, table) in enumerate(chunks):
        parts[5][i], parts[6][i], parts[7][i] = offset, length, start
        chunk_tables[i, :len(table)] = table
    buffer = torch.from_numpy(host)
    if device.type == "cuda":
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    views = torch.split(buffer, sizes)
    return TritonStep(
        slots=views[0], decode_block_tables=views[1].view(num_decodes, decode_width), decode_context_lens=views[2],
        # about 256 programs on a GPU; in the CPU interpreter (tests) two splits a sequence are proof enough
        decode_splits=triton_attention.decode_splits(num_decodes, num_kv_heads, decode_width,
                                                     256 if device.type == "cuda" else 2 * num_decodes * num_kv_heads),
        tile_chunks=views[3], tile_rows=views[4], chunk_offsets=views[5], chunk_lens=views[6],
        chunk_starts=views[7], chunk_block_tables=views[8].view(num_chunks, chunk_width))
