"""The C attention kernels against the pure-torch reference: float32 and bfloat16, every head-dim path,
every build (native, without AVX512-BF16, without AVX-512, x86-64 baseline)."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine.attention import attend, decode_torch, gather_k, write_kv
from bulkgen.engine.cpu.attention import decode_c, prefill_c
from bulkgen.engine.metadata import FULL, CpuMetadata, LayerAttention, PrefillChunk, k_block_shape
from tests.builds import HAS_AMX, HAS_AVX512_BF16, builds, kernel


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(16, 8), (64, 8), (64, 16), (64, 32), (128, 16), (96, 16)])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_matches_torch(build: str, dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> None:
    """Vectorised paths (head_dim 64/128, blocks a multiple of 16) and the plain loop (the rest)."""
    torch.manual_seed(head_dim + group + block_size)
    num_blocks, kv_heads, seqs = 64, 2, 5
    k = torch.randn(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype)).to(dtype)  # K transposed
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    tables = torch.randperm(num_blocks)[:seqs * 6].view(seqs, 6).int()
    lens = torch.tensor([1, 7, block_size, 2 * block_size + 1, 6 * block_size], dtype=torch.int32)
    q = torch.randn(seqs, kv_heads * group, head_dim).to(dtype)
    meta = decode_meta(k, v, tables, lens, int(lens.max()), decode_kernel=kernel(build), num_threads=2)
    got = decode_c(meta, q, k, v, head_dim**-0.5, FULL).float()
    want = decode_torch(q.float(), k.float(), v.float(), tables, lens, head_dim**-0.5)
    assert torch.allclose(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)



@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 32, 4), (64, 16, 1)])
def test_decode_of_sequences_sharing_blocks_is_the_same_bits_as_one_at_a_time(build: str, dtype: torch.dtype,
                                                                              head_dim: int, block_size: int,
                                                                              group: int) -> None:
    """Decoding sequences whose tables start with the same blocks (a shared prefix: 11 of one document in work
    items of up to 8, 3 of another, one alone, contexts ending inside, at and past the shared blocks) go
    through the shared kernel, which reads each shared block once for a work item: its outputs are bit for
    bit those of the kernel run one sequence at a time (so a sequence's attention never depends on who shares
    its step), and match the definition; sinks and softcaps as a layer has them."""
    from bulkgen.engine.cpu.attention import shared_items

    torch.manual_seed(head_dim + block_size + group)
    kv_heads, num_blocks = 2, 120
    k = torch.randn(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype)).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    doc_a, doc_b = [free.pop() for _ in range(5)], [free.pop() for _ in range(2)]
    rows, lens = [], []
    for i in range(11):  # contexts past, at and inside the shared 5 blocks (those inside share fewer)
        n = 5 * block_size + [1, 0, 7, block_size, 2 * block_size + 3][i % 5] - (i == 10) * 3 * block_size
        rows.append(doc_a + [free.pop() for _ in range(3)])
        lens.append(n)
    for n in (2 * block_size + 5, 2 * block_size + 1, 3 * block_size):
        rows.append(doc_b + [free.pop() for _ in range(2)])
        lens.append(n)
    rows.append([free.pop() for _ in range(4)])
    lens.append(3 * block_size + 2)
    perm = torch.randperm(len(rows)).tolist()  # the step's order mixes the groups
    tables = torch.tensor([rows[i] + [0] * (8 - len(rows[i])) for i in perm], dtype=torch.int32)  # padded as a step
    lens_t = torch.tensor([lens[i] for i in perm], dtype=torch.int32)
    q = torch.randn(len(rows), kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    shared = shared_items(tables.numpy(), lens_t.tolist(), block_size)
    order, starts, shared_tokens = (t.tolist() for t in shared)
    assert sorted(order) == list(range(len(rows))) and max(shared_tokens) == 5 * block_size
    sizes = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert max(sizes) <= 8 and sum(size for size, n in zip(sizes, shared_tokens, strict=True) if n) >= 12
    for layer in (FULL, LayerAttention(softcap=3.0, sinks=torch.linspace(-1.0, 2.0, kv_heads * group))):
        meta = decode_meta(k, v, tables, lens_t, int(lens_t.max()), decode_kernel=kernel(build), num_threads=2)
        meta.decode_shared = shared
        got = decode_c(meta, q, k, v, scale, layer)
        meta.decode_shared = None
        alone = decode_c(meta, q, k, v, scale, layer)
        assert torch.equal(got, alone)
        for i in range(len(rows)):
            positions = torch.arange(int(lens_t[i]))
            blocks, offsets = tables[i].long()[positions // block_size], positions % block_size
            want = explicit_attention(q[i:i + 1], gather_k(k, blocks, offsets), v[blocks, :, offsets],
                                      positions[-1:], scale, layer).float()
            assert torch.allclose(got[i:i + 1].float(), want, atol=3e-2 if dtype == torch.bfloat16 else 1e-5)


def test_shared_decode_runs_where_the_shared_blocks_outgrow_the_cache(tmp_path) -> None:
    """The shared work items are taken where a layer's shared blocks fill more than half the last-level cache (the
    deepest data or unified cache sysfs lists: here a 32 MiB L3 beside a 1 MiB L2 and an instruction cache), and
    wherever the cache's size is unknown."""
    from bulkgen.engine.cpu.attention import last_level_cache_bytes, shared_decode_pays

    for index, (level, kind, size) in enumerate([(1, "Instruction", "64K"), (1, "Data", "32K"), (2, "Unified", "1024K"),
                                                 (3, "Unified", "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / f"index{index}" / name).write_text(f"{value}\n")
    l3 = last_level_cache_bytes(tmp_path)
    assert l3 == 32 << 20 and last_level_cache_bytes(tmp_path / "absent") is None
    block = 2 * 3 * 64 * 16 * 4  # SmolLM2's K and V block of one layer, float32
    assert not shared_decode_pays(464, block, l3)  # 8 documents of 58 blocks: 11 MiB, which the L3 keeps
    assert shared_decode_pays(928, block, l3)  # 16 of them: 23 MiB
    assert shared_decode_pays(1, block, None)


def decode_meta(k, v, tables, lens, max_len: int, **kernels) -> CpuMetadata:
    """A decode-only step's metadata: every row a decoding sequence, nothing written."""
    return CpuMetadata(k_caches=[k], v_caches=[v], slots=None, slot_blocks=None, slot_offsets=None,
                       num_decode_tokens=tables.shape[0], decode_block_tables=tables, decode_context_lens=lens,
                       decode_max_context_len=max_len, **kernels)


def prefill_case(start: int, num_tokens: int, num_blocks: int, block_size: int, kv_heads: int, group: int,
                 head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A sequence of start + num_tokens random K/V in random blocks, and the chunk's queries: its block table,
    positions, every position's slot, keys, values and query."""
    total = start + num_tokens
    table = torch.randperm(num_blocks)[:-(-total // block_size)].int()
    positions = torch.arange(total)
    slots_all = table[positions // block_size].long() * block_size + positions % block_size
    keys = torch.randn(total, kv_heads, head_dim).to(dtype)
    values = torch.randn(total, kv_heads, head_dim).to(dtype)
    query = torch.randn(num_tokens, kv_heads * group, head_dim).to(dtype)
    return table, positions, slots_all, keys, values, query


def write_meta(k, v, slots, block_size: int, **rest) -> CpuMetadata:
    """A step that writes the K/V of `slots` (and attends for `prefills`, if given): no decode rows."""
    return CpuMetadata(k_caches=[k], v_caches=[v], slots=slots, slot_blocks=slots // block_size,
                       slot_offsets=slots % block_size, num_decode_tokens=0, decode_block_tables=None,
                       decode_context_lens=None, decode_max_context_len=0, **rest)

def test_portable_bfloat16_path_matches_torch() -> None:
    """Without AVX512-BF16 the bfloat16 scores split each K pair into two float32 vectors instead."""
    if not HAS_AVX512_BF16:
        pytest.skip("the default build already takes the portable path on this CPU")
    torch.manual_seed(1)
    num_blocks, kv_heads, block_size, seqs = 32, 2, 32, 4
    for head_dim in (64, 128):
        k = torch.randn(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, torch.bfloat16)).bfloat16()
        v = torch.randn(num_blocks, kv_heads, block_size, head_dim).bfloat16()
        tables = torch.randperm(num_blocks)[:seqs * 5].view(seqs, 5).int()
        lens = torch.tensor([1, 33, 100, 160], dtype=torch.int32)
        q = torch.randn(seqs, kv_heads * 3, head_dim).bfloat16()
        meta = decode_meta(k, v, tables, lens, 160, decode_kernel=kernel("no-avx512bf16"), num_threads=2)
        got = decode_c(meta, q, k, v, head_dim**-0.5, FULL).float()
        want = decode_torch(q.float(), k.float(), v.float(), tables, lens, head_dim**-0.5)
        assert torch.allclose(got, want, atol=2e-2)


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_matches_torch(build: str, dtype: torch.dtype) -> None:
    """The C write of new K/V (K transposed) puts every value where torch's indexing does."""
    num_blocks, kv_heads, block_size, head_dim, tokens = 8, 3, 16, 64, 21
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    # Like Hugging Face's keys after RoPE: a transposed view, head_dim contiguous.
    key = torch.randn(kv_heads, tokens, head_dim).to(dtype).transpose(0, 1)
    value = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    caches = []
    for library in (kernel(build), None):
        k = torch.zeros(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype), dtype=dtype)
        v = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
        meta = write_meta(k, v, slots, block_size, write_kernel=library)
        write_kv(meta, key, value, k, v)
        caches.append((k, v))
    (k_c, v_c), (k_t, v_t) = caches
    assert torch.equal(k_c, k_t) and torch.equal(v_c, v_t)
    assert torch.equal(gather_k(k_t, slots // block_size, slots % block_size), key)
    if dtype == torch.bfloat16:  # dims in pairs: dims 2p and 2p + 1 of a row side by side
        assert torch.equal(k_t[slots[0] // block_size, 0, 1, slots[0] % block_size], key[0, 0, 2:4])


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (96, 16)])
@pytest.mark.parametrize("start,num_tokens", [(0, 1), (0, 45), (32, 20), (7, 62), (100, 3)])
def test_prefill_through_kernel_matches_torch(build: str, dtype: torch.dtype, head_dim: int, block_size: int,
                                        start: int, num_tokens: int) -> None:
    """Prefill chunks through the C kernel (rows in tiles of 4 where vectorised, else row by row; causal
    by context length) agree with torch's attention over the same paged cache: fresh prompts, chunks
    after cached tokens (chunked prefill, prefix hits) longer and shorter than what is cached, row
    counts that leave a partial tile."""
    torch.manual_seed(start + num_tokens + head_dim)
    kv_heads, group, num_blocks = 3, 3, 16
    table, positions, slots_all, keys, values, query = prefill_case(start, num_tokens, num_blocks, block_size,
                                                              kv_heads, group, head_dim, dtype)
    outs = []
    for library in (kernel(build), None):
        k = torch.zeros(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype), dtype=dtype)
        v = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
        cached = slots_all[:start]
        if start:
                meta = write_meta(k, v, cached, block_size)
                write_kv(meta, keys[:start], values[:start], k, v)
        chunk = PrefillChunk(offset=0, num_tokens=num_tokens, start=start)
        if start:
            chunk.context_blocks, chunk.context_offsets = slots_all // block_size, slots_all % block_size
            if start > num_tokens:
                chunk.mask = positions[start:, None] >= positions[None, :]
        if library is not None:
            chunk.block_table = table
        new = slots_all[start:]
        meta = write_meta(k, v, new, block_size, prefills=[chunk], prefill_kernel=library, write_kernel=library,
                          num_threads=2)
        outs.append(attend(meta, 0, query, keys[start:], values[start:], head_dim**-0.5).float())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(outs[0], outs[1], atol=tolerance), (outs[0] - outs[1]).abs().max()


def explicit_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       scale: float, layer: LayerAttention) -> torch.Tensor:
    """The definition, in float64: query row i ([rows, heads, d]) at positions[i] sees keys k with
    positions[i] - window < k <= positions[i] (window 0: all up to it), scores softcapped, a sink logit
    per head in the softmax."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,thd->iht", query.double(), k) * scale
    if layer.softcap:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    t = torch.arange(keys.shape[0], device=keys.device)[None, None, :]  # on the keys' device, whatever the default
    positions = positions.to(keys.device)
    seen = t <= positions[:, None, None]
    if layer.window:
        seen &= t > positions[:, None, None] - layer.window
    scores = scores.masked_fill(~seen, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.double()[None, :, None].expand(scores.shape[0], -1, 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :keys.shape[0]]
    return torch.einsum("iht,thd->ihd", probs, v)


LAYERS = {
    "window-5": dict(window=5), "window-16": dict(window=16), "window-24-softcap": dict(window=24, softcap=3.0),
    "sinks": dict(sinks=True), "window-20-sinks-softcap": dict(window=20, sinks=True, softcap=2.0),
}


def _layer(name: str, num_heads: int) -> LayerAttention:
    fields = dict(LAYERS[name])
    if fields.pop("sinks", False):
        fields["sinks"] = torch.linspace(-2.0, 3.0, num_heads)  # some heads' sinks take most of the weight
    return LayerAttention(**fields)


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (96, 16)])
@pytest.mark.parametrize("name", list(LAYERS))
def test_windows_softcaps_and_sinks_match_their_definition(build: str, dtype: torch.dtype, head_dim: int,
                                                     block_size: int, name: str) -> None:
    """Decode rows and prefill chunks, in C and in torch, against the definition written out: contexts
    shorter than, at and past the window, windows inside one block and across several, chunks whose
    tiles straddle the window's edge, after cached tokens."""
    torch.manual_seed(head_dim + block_size + len(name))
    kv_heads, group, num_blocks = 2, 3, 40
    layer = _layer(name, kv_heads * group)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    # decode: one sequence per context length, each its own blocks
    lens = [1, 4, 5, 6, 16, 17, 24, 25, 60]
    tables = torch.randperm(num_blocks)[:len(lens) * 4].view(len(lens), 4).int()
    k = torch.randn(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype)).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    meta = decode_meta(k, v, tables, lens_t, max(lens), decode_kernel=kernel(build), num_threads=2)
    scale = head_dim**-0.5
    got_c = decode_c(meta, q, k, v, scale, layer).float()
    got_torch = decode_torch(q, k, v, tables, lens_t, scale, layer).float()
    for i, n in enumerate(lens):
        positions = torch.arange(n)
        blocks, rows = tables[i].long()[positions // block_size], positions % block_size
        keys, values = gather_k(k, blocks, rows), v[blocks, :, rows]
        want = explicit_attention(q[i:i + 1], keys, values, torch.tensor([n - 1]), scale, layer).float()
        assert torch.allclose(got_c[i:i + 1], want, atol=tolerance), (n, (got_c[i] - want).abs().max())
        assert torch.allclose(got_torch[i:i + 1], want, atol=tolerance), (n, (got_torch[i] - want).abs().max())
    # prefill: chunks fresh and after cached tokens, through the C kernel and through torch
    for start, num_tokens in ((0, 45), (13, 22), (40, 3), (0, 7)):
        table, positions, slots_all, keys, values, query = prefill_case(start, num_tokens, num_blocks, block_size,
                                                                  kv_heads, group, head_dim, dtype)
        want = explicit_attention(query, keys, values, positions[start:], scale, layer).float()
        for library in (kernel(build), None):
            k = torch.zeros(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype), dtype=dtype)
            v = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
            if start:
                write_kv(write_meta(k, v, slots_all[:start], block_size), keys[:start], values[:start], k, v)
            chunk = PrefillChunk(offset=0, num_tokens=num_tokens, start=start)
            if start:
                chunk.context_blocks, chunk.context_offsets = slots_all // block_size, slots_all % block_size
            if library is not None:
                chunk.block_table = table
            meta = write_meta(k, v, slots_all[start:], block_size, prefills=[chunk], prefill_kernel=library,
                        write_kernel=library, num_threads=2)
            got = attend(meta, 0, query, keys[start:], values[start:], scale, layer).float()
            assert torch.allclose(got, want, atol=tolerance), (start, num_tokens, library, (got - want).abs().max())


@pytest.mark.skipif(not HAS_AMX, reason="AMX tiles need an Intel Xeon of the 4th generation or later (the other "
                                  "prefill kernels are tested on every CPU)")
@pytest.mark.parametrize("head_dim,block_size,group", [(64, 32, 3), (128, 64, 4), (64, 16, 2)])
@pytest.mark.parametrize("start,num_tokens", [(0, 1), (0, 200), (40, 17), (333, 50)])
def test_prefill_on_amx_tiles_matches_the_definition(head_dim: int, block_size: int, group: int, start: int,
                                               num_tokens: int) -> None:
    """bfloat16 prefill on AMX tiles (16 query rows of a head a tile, 32 keys a step, K's tiles straight from
    its blocks): within torch's own bfloat16 error of the float64 definition, chunks fresh and after cached
    tokens, partial tiles and steps, the cache's unwritten slots NaN (they must not leak). Blocks of 16
    tokens are not its shape: it declines them (status 2) and the other kernel answers."""
    torch.manual_seed(start + num_tokens + head_dim)
    dtype, kv_heads, num_blocks = torch.bfloat16, 2, 24
    table, positions, slots_all, keys, values, query = prefill_case(start, num_tokens, num_blocks, block_size,
                                                              kv_heads, group, head_dim, dtype)
    k = torch.full((num_blocks, *k_block_shape(kv_heads, head_dim, block_size, dtype)), float("nan"), dtype=dtype)
    v = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    library = kernel()
    write_kv(write_meta(k, v, slots_all, block_size), keys, values, k, v)
    chunk = PrefillChunk(offset=0, num_tokens=num_tokens, start=start, block_table=table)
    meta = write_meta(k, v, slots_all[:0], block_size, prefills=[chunk], prefill_kernel=library, num_threads=2)
    scale = head_dim ** -0.5
    got = prefill_c(meta, query, k, v, chunk, scale, FULL)
    out = torch.empty_like(query)
    status = library.paged_prefill_amx(q=query.data_ptr(), k_cache=k.data_ptr(), v_cache=v.data_ptr(),
                                 table=table.data_ptr(), start=start, n=num_tokens, out=out.data_ptr(),
                                 num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=block_size, scale=scale, num_threads=2)
    assert status == (2 if block_size % 32 else 0)
    want = explicit_attention(query, keys, values, positions[start:], scale, FULL)
    mask = positions[start:, None] >= positions[None, :]
    torch_own = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert not got.isnan().any()
    bound = 1.5 * (torch_own.double() - want).abs().max().item() + 1e-3
    assert (got.double() - want).abs().max().item() <= bound
    if status == 0:
        assert torch.equal(out, got)
