"""The Triton kernels (paged decode and prefill attention, the KV write, the small ops) against plain
torch: block sizes, GQA ratios, head dims that are not powers of two, ragged context lengths, split
contexts, chunks after cached tokens, several chunks in one launch, float32 and bfloat16. Run by Triton's
interpreter on the CPU (TRITON_INTERPRET=1, set in conftest), or on a GPU where there is one and
TRITON_INTERPRET=0 (.ci/gpu-check)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton_attention = pytest.importorskip("bulkgen.engine.gpu.attention")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
DEVICE = "cpu" if triton_attention.INTERPRET or not torch.cuda.is_available() else "cuda"
if DEVICE == "cuda":
    TOLERANCE[torch.float32] = 1e-4  # IEEE float32 dots (not tf32), summed in another order than float64's


@pytest.fixture(autouse=True)
def _on_the_kernels_device():
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(previous)


def _cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    k = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    return k, v


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
               positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [rows, heads, d] of one sequence at `positions`, attending causally to its blocks (float64)."""
    block_size = k_cache.shape[2]
    length = int(positions.max()) + 1
    idx = torch.arange(length)
    k = k_cache[table.long()[idx // block_size], :, idx % block_size].double()  # [length, kv_heads, d]
    v = v_cache[table.long()[idx // block_size], :, idx % block_size].double()
    mask = idx[None, :] <= positions[:, None]  # [rows, length]
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    num_blocks, kv_heads, block_size, head_dim, tokens = 6, 3, 16, 80, 13
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    key = torch.randn(kv_heads, tokens, head_dim).to(dtype).transpose(0, 1)  # strided, like a view of qkv
    value = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    k, v = (torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype) for _ in range(2))
    triton_attention.write_kv(key, value, slots.int(), k, v)
    want_k, want_v = torch.zeros_like(k), torch.zeros_like(v)
    want_k[slots // block_size, :, slots % block_size] = key
    want_v[slots // block_size, :, slots % block_size] = value
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (8, 80, 16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_torch(dtype: torch.dtype, group: int, head_dim: int, block_size: int, splits: int) -> None:
    torch.manual_seed(group * 100 + head_dim + splits)
    kv_heads, num_blocks, seqs, max_blocks = 2, 24, 3, 6
    k, v = _cache(num_blocks, kv_heads, block_size, head_dim, dtype)
    tables = torch.randperm(num_blocks)[:seqs * max_blocks].view(seqs, max_blocks).int()
    lens = torch.tensor([1, block_size + 3, max_blocks * block_size], dtype=torch.int32)
    q = torch.randn(seqs, kv_heads * group, head_dim).to(dtype)
    scale = head_dim ** -0.5
    got = triton_attention.decode(q, k, v, tables, lens, scale, num_splits=splits)
    assert got.dtype == dtype and got.shape == q.shape
    for i in range(seqs):
        want = _reference(q[i:i + 1], k, v, tables[i], torch.tensor([int(lens[i]) - 1]), scale)
        assert torch.allclose(got[i:i + 1].double(), want, atol=TOLERANCE[dtype]), (got[i] - want[0]).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (4, 80, 16)])
def test_prefill_chunks_in_one_launch_match_torch(dtype: torch.dtype, group: int, head_dim: int,
                                                  block_size: int) -> None:
    """Three chunks in one launch: a fresh prompt, a chunk after cached tokens longer than itself, and one
    after a short cached prefix; decode tokens sit before them in the flattened batch (untouched)."""
    torch.manual_seed(group + head_dim)
    kv_heads, num_blocks = 2, 32
    k, v = _cache(num_blocks, kv_heads, block_size, head_dim, dtype)
    chunks = [(0, 37), (2 * block_size + 5, 9), (3, 20)]  # (cached tokens before, chunk length)
    max_blocks = max(-(-(s + n) // block_size) for s, n in chunks)
    tables = torch.randperm(num_blocks)[:len(chunks) * max_blocks].view(len(chunks), max_blocks).int()
    num_decodes = 2
    offsets, offset = [], num_decodes
    for _, n in chunks:
        offsets.append(offset)
        offset += n
    q = torch.randn(offset, kv_heads * group, head_dim).to(dtype)
    out = torch.full_like(q, 7.0)
    block_m = triton_attention.prefill_block_m(group)
    tile_chunks, tile_rows = triton_attention.prefill_tiles([n for _, n in chunks], block_m)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    scale = head_dim ** -0.5
    triton_attention.prefill(q, k, v, out, as_int(tile_chunks), as_int(tile_rows), as_int(offsets),
                             as_int([n for _, n in chunks]), as_int([s for s, _ in chunks]), tables, scale)
    assert torch.equal(out[:num_decodes], torch.full_like(out[:num_decodes], 7.0)), "decode rows are not its"
    for c, (start, n) in enumerate(chunks):
        rows = slice(offsets[c], offsets[c] + n)
        want = _reference(q[rows], k, v, tables[c], torch.arange(start, start + n), scale)
        assert torch.allclose(out[rows].double(), want, atol=TOLERANCE[dtype]), (out[rows].double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_match_hugging_faces_torch_code(dtype: torch.dtype) -> None:
    """RMSNorm (+ residual, in place), RoPE (in place, q's and k's heads of a fused qkv) and SiLU-mul in
    Triton against cpu/ops.Ops' torch path (Hugging Face's code): bfloat16 rounded at the same points."""
    from bulkgen.engine.cpu.ops import Ops
    from bulkgen.engine.gpu.ops import TritonOps

    torch.manual_seed(3)
    ops, ref = TritonOps(), Ops(None, dtype)
    x = (torch.randn(7, 96) * 3).to(dtype)
    residual, weight = torch.randn(7, 96).to(dtype), (torch.rand(96) + 0.5).to(dtype)
    x_ref = x.clone()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1 / 64, atol=1e-2)
    torch.testing.assert_close(ops.add_rms_norm(x, residual, weight, 1e-5), ref.add_rms_norm(x_ref, residual, weight,
                                                                                            1e-5), **tol)
    assert torch.equal(x, x_ref), "the residual is added in place, rounded as torch's add"
    torch.testing.assert_close(ops.add_rms_norm(x, None, weight, 1e-5), ref.add_rms_norm(x, None, weight, 1e-5), **tol)
    heads, kv_heads, head_dim, tokens = 4, 2, 48, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    want = qkv.clone()
    rotated = want[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    from bulkgen.engine.layers import rotate

    rotated.copy_(rotate(rotated.clone(), cos, sin))
    assert ops.rope(qkv, heads + kv_heads, head_dim, cos, sin) is qkv
    torch.testing.assert_close(qkv, want, **tol)
    gate_up = (torch.randn(6, 2 * 1500) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gate_up), ref.silu_mul(gate_up), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["window-5", "window-24-softcap", "sinks", "window-20-sinks-softcap"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (2, 16)])
def test_windows_softcaps_and_sinks_match_their_definition(dtype: torch.dtype, name: str, splits: int, group: int,
                                                           head_dim: int) -> None:
    """Decode (one split and several, some splits wholly before the window) and prefill chunks (tiles that
    straddle the window's edge, after cached tokens) against the definition written out."""
    from tests.test_attention_kernel import _layer, explicit_attention

    torch.manual_seed(len(name) + splits)
    kv_heads, block_size, num_blocks = 2, 16, 48
    layer = _layer(name, kv_heads * group)
    if layer.sinks is not None:
        layer = type(layer)(window=layer.window, softcap=layer.softcap, sinks=layer.sinks.to(DEVICE))
    k, v = _cache(num_blocks, kv_heads, block_size, head_dim, dtype)
    scale = head_dim ** -0.5
    lens = [1, 5, 6, 17, 24, 25, 60, 96]
    tables = torch.randperm(num_blocks)[:len(lens) * 6].view(len(lens), 6).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim).to(dtype)
    got = triton_attention.decode(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), scale, splits, layer)
    for i, n in enumerate(lens):
        idx = torch.arange(n)
        blocks, rows = tables[i].long()[idx // block_size], idx % block_size
        want = explicit_attention(q[i:i + 1].cpu(), k[blocks, :, rows].cpu(), v[blocks, :, rows].cpu(),
                                  torch.tensor([n - 1]), scale, _cpu(layer))
        assert torch.allclose(got[i:i + 1].double().cpu(), want, atol=TOLERANCE[dtype]), (n, name)
    chunks = [(0, 45), (13, 22), (40, 3)]
    max_blocks = max(-(-(s + n) // block_size) for s, n in chunks)
    tables = torch.randperm(num_blocks)[:len(chunks) * max_blocks].view(len(chunks), max_blocks).int()
    offsets = [0, 45, 67]
    q = torch.randn(70, kv_heads * group, head_dim).to(dtype)
    out = torch.zeros_like(q)
    block_m = triton_attention.prefill_block_m(group)
    tile_chunks, tile_rows = triton_attention.prefill_tiles([n for _, n in chunks], block_m)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    triton_attention.prefill(q, k, v, out, as_int(tile_chunks), as_int(tile_rows), as_int(offsets),
                             as_int([n for _, n in chunks]), as_int([s for s, _ in chunks]), tables, scale, layer)
    for c, (start, n) in enumerate(chunks):
        idx = torch.arange(start + n)
        blocks, rows = tables[c].long()[idx // block_size], idx % block_size
        rows_q = q[offsets[c]:offsets[c] + n].cpu()
        want = explicit_attention(rows_q, k[blocks, :, rows].cpu(), v[blocks, :, rows].cpu(), idx[start:].cpu(), scale,
                                  _cpu(layer))
        got = out[offsets[c]:offsets[c] + n].double().cpu()
        assert torch.allclose(got, want, atol=TOLERANCE[dtype]), (start, n, name, (got - want).abs().max())


def _cpu(layer):
    return layer if layer.sinks is None else type(layer)(window=layer.window, softcap=layer.softcap,
                                                         sinks=layer.sinks.cpu())


@pytest.mark.parametrize("name", ["full", "window-5"])
@pytest.mark.parametrize("splits", [1, 3])
def test_rows_no_query_sees_are_never_read(name: str, splits: int) -> None:
    """Every cache row outside what some query sees (past a context, before a window, in blocks nobody holds)
    set to NaN: the outputs are those of a clean cache. A reused block's stale values once read with weight 0
    gave NaN x 0 = NaN to its next owner."""
    from tests.test_attention_kernel import _layer

    torch.manual_seed(3)
    kv_heads, group, head_dim, block_size, num_blocks = 2, 2, 16, 16, 40
    layer = triton_attention.FULL if name == "full" else _layer(name, kv_heads * group)
    k, v = _cache(num_blocks, kv_heads, block_size, head_dim, torch.float32)
    scale = head_dim ** -0.5
    lens = [1, 7, 17, 33, 60]
    tables = torch.randperm(num_blocks)[:len(lens) * 4].view(len(lens), 4).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim)
    chunks = [(0, 21), (13, 9)]
    chunk_tables = torch.randperm(num_blocks)[:2 * 2].view(2, 2).int()
    q_prefill = torch.randn(30, kv_heads * group, head_dim)
    tile_chunks, tile_rows = triton_attention.prefill_tiles([n for _, n in chunks],
                                                            triton_attention.prefill_block_m(group))
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731

    def run(k, v):
        decoded = triton_attention.decode(q, k, v, tables, as_int(lens), scale, splits, layer)
        out = torch.zeros_like(q_prefill)
        triton_attention.prefill(q_prefill, k, v, out, as_int(tile_chunks), as_int(tile_rows), as_int([0, 21]),
                                 as_int([n for _, n in chunks]), as_int([s for s, _ in chunks]), chunk_tables, scale,
                                 layer)
        return decoded, out

    clean = run(k, v)
    seen = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    # a decode's query (at n - 1) sees (n - 1 - window, n); a chunk's queries (start - window, start + length)
    spans = [*((table, n - 1 - layer.window, n) for table, n in zip(tables, lens, strict=True)),
             *((chunk_tables[c], start - layer.window, start + n) for c, (start, n) in enumerate(chunks))]
    for table, after, end in spans:
        for position in range(max(0, after + 1) if layer.window else 0, end):
            seen[table[position // block_size].long(), position % block_size] = True
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned.masked_fill_(~seen[:, None, :, None], float("nan"))
    v_poisoned.masked_fill_(~seen[:, None, :, None], float("nan"))
    for got, want in zip(run(k_poisoned, v_poisoned), clean, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
