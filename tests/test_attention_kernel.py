"""The C decode kernel against the pure-torch reference: float32 and bfloat16, every head-dim path."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine.attention import AttentionMetadata, _decode_kernel, decode_torch
from bulkgen.engine.kernels import load_paged_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3])
def test_kernel_matches_torch(dtype: torch.dtype, head_dim: int, group: int) -> None:
    kernel = load_paged_attention()
    assert kernel is not None, "the kernel builds wherever gcc is present (CI has it)"
    torch.manual_seed(head_dim + group)
    num_blocks, kv_heads, block_size, seqs = 64, 2, 8, 5
    k = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    tables = torch.randperm(num_blocks)[:seqs * 6].view(seqs, 6).int()
    lens = torch.tensor([1, 7, 8, 33, 48], dtype=torch.int32)
    q = torch.randn(seqs, kv_heads * group, head_dim).to(dtype)
    meta = AttentionMetadata([k], [v], None, None, seqs, tables, lens, int(lens.max()), [], kernel, 2)
    got = _decode_kernel(meta, q, k, v, head_dim**-0.5).float()
    want = decode_torch(q.float(), k.float(), v.float(), tables, lens, head_dim**-0.5)
    assert torch.allclose(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
