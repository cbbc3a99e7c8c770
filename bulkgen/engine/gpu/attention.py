# Whole (over 300 lines): the Triton kernels and their launchers share block sizes and layouts that change together.
"""Paged attention and the KV write in Triton, for GPUs (and, for tests, Triton's CPU interpreter).

KV layout on this path: K and V alike, per layer [num_blocks, num_kv_heads, block_size, head_dim] (a
head's part of a block is one contiguous [block_size, head_dim] tile; the CPU kernels' transposed K is
theirs alone).

Decode: one program per (sequence, KV head, split of its blocks). The program loads each K/V block of its
KV head once for all the query heads sharing it (GQA): the group's queries are the rows of one tile,
padded to 16 for tensor-core dots. Long contexts are split over several programs (flash-decoding), each
leaving a partial max, sum and weighted value; a second kernel combines the splits.

Prefill: every prefill chunk of a step in one launch. One program per (tile of query rows of a chunk, KV
head), the tile's rows times the group's heads as one [rows x heads, head_dim] block of queries, walking
the sequence's blocks through its block table up to the tile's last position, causal by position: the
chunk's own K/V (written just before) and whatever was cached before it (chunked prefill, prefix hits,
recompute) are read alike.

Each layer's own attention (metadata.LayerAttention): a sliding window skips the blocks before it and masks
the positions it leaves out; softcapping bounds the scores (softcap * tanh(score / softcap)); sinks join
each head's softmax as a logit with no value, once, where its max and sum are final.

Triton's interpreter (TRITON_INTERPRET=1) runs these on CPU tensors for tests, with one difference: it
computes bfloat16 dot products wrongly (triton 3.9), so there the operands go to float32 first (the same
products, exact in float32; only the summation order may differ).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from bulkgen.engine.metadata import FULL, LayerAttention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as triton reads it
MIN_DOT = 16  # tensor-core dots need 16 rows


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:  # float32 products as IEEE (a GPU's tl.dot of float32 is tf32 by default: 10-bit mantissas)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softcap(s, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        return softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    return s


# Ints that change from step to step: not specialized (Triton compiles a variant for ==1 and for %16 == 0 of
# every int it is not told of), so that a run compiles each kernel once per layer kind after warm-up
# (tests/test_triton_specializations.py counts them)
VARYING = {
    "_write_kv_kernel": ("num_tokens", "k_token_stride", "k_head_stride", "v_token_stride", "v_head_stride"),
    "_decode_kernel": ("window",),
    "_prefill_kernel": ("table_stride", "window"),
}


@triton.jit(do_not_specialize=VARYING["_write_kv_kernel"])
def _write_kv_kernel(key, value, slots, k_cache, v_cache, num_tokens, k_token_stride, k_head_stride, v_token_stride,
                     v_head_stride, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    mask = (tokens < num_tokens)[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.load(slots + tokens, mask=tokens < num_tokens, other=0).to(tl.int64)
    dst = ((slot // BLOCK_SIZE * NUM_KV_HEADS + head) * BLOCK_SIZE + slot % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(key + tokens[:, None] * k_token_stride + head * k_head_stride + d[None, :], mask=mask)
    v = tl.load(value + tokens[:, None] * v_token_stride + head * v_head_stride + d[None, :], mask=mask)
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] (head_dim contiguous) into their slots (int)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_t = 16
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        key, value, slots, k_cache, v_cache, num_tokens, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2],
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_T=block_t)


@triton.jit(do_not_specialize=VARYING["_decode_kernel"])
def _decode_kernel(q, q_stride, k_cache, v_cache, block_tables, table_params, context_lens, out, part_acc, part_ml,
                   scale, window, softcap, sinks, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    r = tl.arange(0, BLOCK_SIZE)
    head_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    qt = tl.load(q + seq * q_stride + heads[:, None] * HEAD_DIM + d[None, :],
                 mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D_PAD]
    # read on the device, so that a CUDA graph's replay takes the step's table width and split size
    table_stride = tl.load(table_params)
    blocks_per_split = tl.load(table_params + 1)
    context = tl.load(context_lens + seq)
    lowest = tl.where(window > 0, tl.maximum(context - window, 0), 0)  # a sliding window's first position
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(context, BLOCK_SIZE))
    first = tl.maximum(first, lowest // BLOCK_SIZE)  # every block from here on has a position seen
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)  # the softmax's running sum
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for b in range(first, last):
        block = tl.load(block_tables + seq * table_stride + b).to(tl.int64)
        base = (block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE * HEAD_DIM
        kv_offsets = base + r[:, None] * HEAD_DIM + d[None, :]
        position = b * BLOCK_SIZE + r
        seen = (position < context) & (position >= lowest)
        # rows not seen are not read: a reused block's stale values (a NaN once written) would give NaN x 0
        k = tl.load(k_cache + kv_offsets, mask=seen[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_SIZE, D_PAD]
        v = tl.load(v_cache + kv_offsets, mask=seen[:, None] & d_ok[None, :], other=0.0)
        s = _softcap(_dot(qt, tl.trans(k), DOT_F32) * scale, softcap, HAS_SOFTCAP)  # [G_PAD, BLOCK_SIZE]
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks + heads, mask=head_ok, other=0.0)
            m_all = tl.maximum(m, sink)
            acc = acc * tl.exp(m - m_all)[:, None]
            total = total * tl.exp(m - m_all) + tl.exp(sink - m_all)
        o = acc / total[:, None]
        tl.store(out + (seq * NUM_HEADS + heads[:, None]) * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
                 mask=head_ok[:, None] & d_ok[None, :])
    else:
        part = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split
        tl.store(part_acc + (part * G_PAD + g[:, None]) * D_PAD + d[None, :], acc)
        tl.store(part_ml + (part * 2) * G_PAD + g, m)
        tl.store(part_ml + (part * 2 + 1) * G_PAD + g, total)


@triton.jit
def _combine_kernel(out, part_acc, part_ml, sinks, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    first = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS
    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    for i in range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_ml + ((first + i) * 2) * G_PAD + g))
    heads = kv_head * GROUP + g
    total = tl.zeros([G_PAD], tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks + heads, mask=g < GROUP, other=0.0)
        m_all = tl.maximum(m_all, sink)
        total += tl.exp(sink - m_all)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for i in range(NUM_SPLITS):
        m = tl.load(part_ml + ((first + i) * 2) * G_PAD + g)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # a split with no block weighs nothing
        total += w * tl.load(part_ml + ((first + i) * 2 + 1) * G_PAD + g)
        acc += w[:, None] * tl.load(part_acc + ((first + i) * G_PAD + g[:, None]) * D_PAD + d[None, :])
    tl.store(out + (seq * NUM_HEADS + heads[:, None]) * HEAD_DIM + d[None, :], (acc / total[:, None]).to(
        out.dtype.element_ty), mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, num_programs: int = 256) -> int:
    """Splits of each sequence's blocks so that about `num_programs` programs run (the GPU's SMs a few times
    over), at least 4 blocks a split, at most 64 splits; a power of two (NUM_SPLITS is compiled in: seven
    variants at most)."""
    if max_blocks <= 4:
        return 1
    wanted = min(triton.cdiv(num_programs, max(1, num_seqs * num_kv_heads)), triton.cdiv(max_blocks, 4), 64)
    return 1 << (max(1, wanted).bit_length() - 1)


def rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] as the kernels read it: each token's heads one after the other, its rows any
    stride apart (a view of the fused qkv projection is read in place); else a contiguous copy (a transposed
    query: gpt-oss's RoPE makes one)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def decode_programs(device: torch.device, num_seqs: int, num_kv_heads: int) -> int:
    """The decode programs a step aims at: about 256 on a GPU (its SMs a few times over); in the CPU interpreter
    (tests) two splits a sequence are proof enough."""
    return 256 if device.type == "cuda" else 2 * num_seqs * num_kv_heads


def decode_params(table_width: int, num_splits: int) -> list[int]:
    """The decode kernel's two ints read on the device: the block tables' row stride and blocks a split."""
    return [table_width, triton.cdiv(table_width, num_splits)]


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
           layer: LayerAttention = FULL, out: torch.Tensor | None = None,
           params: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: q [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] and
    context_lens [num_seqs] (int32); returns [num_seqs, num_heads, head_dim] in q's dtype, written into `out`
    where given (contiguous, as the kernel writes it: the step's output rows, no copy). params: decode_params
    as int32 on the device where the step holds them (its one copy; a graph's replay rewrites them), the tables'
    rows then params[0] apart; else from block_tables' shape."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    q = rows_of_heads(q)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == q.shape
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = max(MIN_DOT, triton.next_power_of_2(group))
    d_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    splits = num_splits or decode_splits(num_seqs, num_kv_heads, block_tables.shape[1])
    if params is None:
        params = torch.tensor([block_tables.stride(0), triton.cdiv(block_tables.shape[1], splits)], dtype=torch.int32,
                              device=q.device)
    part_acc = torch.empty((num_seqs, num_kv_heads, splits, g_pad, d_pad) if splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    part_ml = torch.empty((num_seqs, num_kv_heads, splits, 2, g_pad) if splits > 1 else (1,), dtype=torch.float32,
                          device=q.device)
    sinks = _sinks(layer, q)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, q.stride(0), k_cache, v_cache, block_tables, params, context_lens, out, part_acc, part_ml, scale,
        layer.window, layer.softcap or 1.0, sinks, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        DOT_F32=INTERPRET or q.dtype == torch.float32, HAS_SOFTCAP=layer.softcap > 0,
        HAS_SINKS=layer.sinks is not None)
    if splits > 1:
        _combine_kernel[(num_seqs, num_kv_heads)](out, part_acc, part_ml, sinks, NUM_HEADS=num_heads,
                                                  NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad,
                                                  HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits,
                                                  HAS_SINKS=layer.sinks is not None)
    return out


@triton.jit(do_not_specialize=VARYING["_prefill_kernel"])
def _prefill_kernel(q, q_stride, k_cache, v_cache, out, tile_chunks, tile_rows, chunk_offsets, chunk_lens,
                    chunk_starts, block_tables, table_stride, scale, window, softcap, sinks, NUM_HEADS: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    chunk = tl.load(tile_chunks + tile)
    row0 = tl.load(tile_rows + tile)  # first query row of the tile within its chunk
    offset = tl.load(chunk_offsets + chunk)  # the chunk's first token in the step's flattened batch
    length = tl.load(chunk_lens + chunk)
    start = tl.load(chunk_starts + chunk)  # tokens of the sequence cached before the chunk
    i = tl.arange(0, BLOCK_M * G_PAD)  # rows of the query block: query row i // G_PAD, head i % G_PAD
    qi = row0 + i // G_PAD
    g = i % G_PAD
    d = tl.arange(0, D_PAD)
    r = tl.arange(0, BLOCK_SIZE)
    row_ok = (qi < length) & (g < GROUP)
    d_ok = d < HEAD_DIM
    heads = (kv_head * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    qt = tl.load(q + (offset + qi)[:, None] * q_stride + heads, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    position = start + qi  # each query row's position in its sequence
    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    last_position = start + tl.minimum(row0 + BLOCK_M, length) - 1
    # a sliding window: the tile's first row sees nothing before position start + row0 - window + 1
    first_seen = tl.where(window > 0, tl.maximum(start + row0 - window + 1, 0), 0)
    first_block = first_seen // BLOCK_SIZE
    for b in range(first_block, last_position // BLOCK_SIZE + 1):
        block = tl.load(block_tables + chunk * table_stride + b).to(tl.int64)
        kv_offsets = (block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :]
        key_row = b * BLOCK_SIZE + r
        # rows no query of the tile sees are not read (stale values: see the decode kernel)
        row_seen = (key_row <= last_position) & (key_row >= first_seen)
        k = tl.load(k_cache + kv_offsets, mask=row_seen[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_cache + kv_offsets, mask=row_seen[:, None] & d_ok[None, :], other=0.0)
        s = _softcap(_dot(qt, tl.trans(k), DOT_F32) * scale, softcap, HAS_SOFTCAP)  # [rows, BLOCK_SIZE]
        key_position = key_row[None, :]
        visible = (key_position <= position[:, None]) & ((key_position > position[:, None] - window) | (window <= 0))
        s = tl.where(visible & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay empty
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    if HAS_SINKS:
        sink = tl.load(sinks + kv_head * GROUP + g, mask=g < GROUP, other=0.0)
        m_all = tl.maximum(m, sink)
        acc = acc * tl.exp(m - m_all)[:, None]
        total = total * tl.exp(m - m_all) + tl.exp(sink - m_all)
    o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out + (offset + qi)[:, None] * (NUM_HEADS * HEAD_DIM) + heads, o.to(out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def prefill_tiles(chunk_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The (chunk, first row) of each tile of block_m query rows, in chunk order."""
    chunks, rows = [], []
    for c, n in enumerate(chunk_lens):
        for row in range(0, n, block_m):
            chunks.append(c)
            rows.append(row)
    return chunks, rows


def prefill_block_m(group: int) -> int:
    """Query rows a prefill tile takes: rows x padded group about 64 (a tile's worth of tensor-core rows)."""
    return max(1, 64 // triton.next_power_of_2(group))


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            tile_chunks: torch.Tensor, tile_rows: torch.Tensor, chunk_offsets: torch.Tensor,
            chunk_lens: torch.Tensor, chunk_starts: torch.Tensor, block_tables: torch.Tensor, scale: float,
            layer: LayerAttention = FULL) -> None:
    """Attention of every prefill chunk of a step, in one launch, into `out` (rows of q's shape).
    q, out: [num_tokens, num_heads, head_dim] (the step's flattened tokens; q as rows_of_heads, out contiguous); per
    chunk (int32): its offset in
    them, its length, the tokens cached before it, its block table row; tiles from prefill_tiles."""
    num_tiles = tile_chunks.shape[0]
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_m = prefill_block_m(group)
    q = rows_of_heads(q)
    assert out.is_contiguous()
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, q.stride(0), k_cache, v_cache, out, tile_chunks, tile_rows, chunk_offsets, chunk_lens, chunk_starts,
        block_tables, block_tables.stride(0), scale, layer.window, layer.softcap or 1.0, _sinks(layer, q),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim,
        D_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        DOT_F32=INTERPRET or q.dtype == torch.float32, HAS_SOFTCAP=layer.softcap > 0,
        HAS_SINKS=layer.sinks is not None)


def _sinks(layer: LayerAttention, q: torch.Tensor) -> torch.Tensor:
    """The layer's sinks as float32 on q's device ([num_heads]), or q itself as a pointer never read."""
    return q if layer.sinks is None else layer.sinks.to(device=q.device, dtype=torch.float32)
