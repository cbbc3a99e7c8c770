"""A step's inputs and metadata for the Triton path, built on the host as one int32 buffer and sent to the
device in one copy (from pinned memory on a GPU, without waiting for it): one transfer a step instead of one
per tensor."""

from __future__ import annotations

import numpy as np
import torch

from bulkgen.engine.gpu import attention as triton_attention
from bulkgen.engine.metadata import TritonMetadata

ALIGN = 4  # int32s: 16 bytes


def triton_step(input_ids: list[int], positions: list[int], keep: list[int], slots: list[int],
                decode_tables: list[list[int]], decode_context_lens: list[int],
                chunks: list[tuple[int, int, int, list[int]]], device: torch.device, num_kv_heads: int,
                group: int, **common: object) -> tuple[TritonMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the step's metadata and its input ids, positions and sampled rows (int64 on the device).
    keep: the rows to sample; slots: each new token's cache slot; decode_tables, decode_context_lens: per
    decoding sequence; chunks: per prefill chunk (offset in the batch, length, tokens cached before it, block
    table); common: the metadata's fields of every backend (metadata.AttentionMetadata's)."""
    num_decodes, num_chunks = len(decode_tables), len(chunks)
    decode_width = max((len(t) for t in decode_tables), default=0)
    chunk_width = max((len(c[3]) for c in chunks), default=0)
    tile_chunks, tile_rows = triton_attention.prefill_tiles([c[1] for c in chunks],
                                                            triton_attention.prefill_block_m(group))
    splits = triton_attention.decode_splits(num_decodes, num_kv_heads, decode_width,
                                            triton_attention.decode_programs(device, num_decodes, num_kv_heads))
    params = triton_attention.decode_params(decode_width, splits)
    sizes = [len(params), len(input_ids), len(positions), len(keep), len(slots), num_decodes * decode_width,
             num_decodes, len(tile_chunks), len(tile_rows), num_chunks, num_chunks, num_chunks,
             num_chunks * chunk_width]
    # each section starts on 16 bytes: Triton specializes a pointer on its 16-byte alignment, and sections at
    # arbitrary offsets would compile a kernel variant for each pattern of them
    starts_at = np.concatenate([[0], np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes])])
    host = np.zeros(int(starts_at[-1]), dtype=np.int32)
    (decode_params, ids, pos, kept, slot, tables, lens, t_chunks, t_rows, offsets, lengths, starts,
     chunk_tables) = (host[a:a + n] for a, n in zip(starts_at, sizes, strict=False))
    decode_params[:] = params
    ids[:], pos[:], kept[:], slot[:], lens[:] = input_ids, positions, keep, slots, decode_context_lens
    tables = tables.reshape(num_decodes, decode_width)
    for i, table in enumerate(decode_tables):
        tables[i, :len(table)] = table
    t_chunks[:], t_rows[:] = tile_chunks, tile_rows
    chunk_tables = chunk_tables.reshape(num_chunks, chunk_width)
    for i, (offset, length, start, table) in enumerate(chunks):
        offsets[i], lengths[i], starts[i] = offset, length, start
        chunk_tables[i, :len(table)] = table
    buffer = torch.from_numpy(host)
    if device.type == "cuda":
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    views = [buffer[a:a + n] for a, n in zip(starts_at.tolist(), sizes, strict=False)]
    step = TritonMetadata(
        **common, slots=views[4], decode_block_tables=views[5].view(num_decodes, decode_width),
        decode_context_lens=views[6],
        decode_splits=splits, decode_params=views[0],
        tile_chunks=views[7], tile_rows=views[8], chunk_offsets=views[9], chunk_lens=views[10],
        chunk_starts=views[11], chunk_block_tables=views[12].view(num_chunks, chunk_width))
    return step, views[1].long(), views[2].long(), views[3].long()
