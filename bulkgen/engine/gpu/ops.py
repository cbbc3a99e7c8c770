"""The small ops of the forward pass in Triton, one launch each where torch takes four to six: RMSNorm with
the residual add before it, RoPE in place on the fused qkv projection, SiLU-and-multiply. The same
roundings as the torch code of Hugging Face's modules (cpu/ops.Ops' torch path): intermediate results
are rounded to the model's dtype where torch rounds them. `TritonOps` has cpu/ops.Ops' interface."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter truncates float32 -> bfloat16 where GPUs round to nearest even; it rounds by hand there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest even), as a value of that dtype."""
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _add_rms_norm_kernel(x, residual, weight, out, cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         BY_HAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    h = tl.load(x + row * cols + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = _round(h.to(tl.float32) + tl.load(residual + row * cols + c, mask=mask, other=0.0).to(tl.float32),
                   h.dtype, BY_HAND)
        tl.store(x + row * cols + c, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / cols + eps)
    normed = _round(hf * inv, h.dtype, BY_HAND).to(tl.float32)
    w = tl.load(weight + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * cols + c, _round(w * normed, out.dtype.element_ty, BY_HAND), mask=mask)


@triton.jit
def _rope_kernel(x, row_stride, cos, sin, num_heads, head_dim, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                 HEADS_PAD: tl.constexpr, BY_HAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    first_half = x + row * row_stride + h[:, None] * head_dim + i[None, :]  # [heads, half]
    x1 = tl.load(first_half, mask=mask, other=0.0)
    x2 = tl.load(first_half + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos + row * head_dim + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + row * head_dim + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin + row * head_dim + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + row * head_dim + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype
    first = _round(a1 * c1, dtype, BY_HAND).to(tl.float32) + _round(-a2 * s1, dtype, BY_HAND).to(tl.float32)
    second = _round(a2 * c2, dtype, BY_HAND).to(tl.float32) + _round(a1 * s2, dtype, BY_HAND).to(tl.float32)
    tl.store(first_half, _round(first, dtype, BY_HAND), mask=mask)
    tl.store(first_half + HALF, _round(second, dtype, BY_HAND), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up, out, cols, BLOCK: tl.constexpr, BY_HAND: tl.constexpr):
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = part * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    g = tl.load(gate_up + row * 2 * cols + c, mask=mask, other=0.0)
    u = tl.load(gate_up + row * 2 * cols + cols + c, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    silu = _round(gf / (1.0 + tl.exp(-gf)), g.dtype, BY_HAND).to(tl.float32)
    tl.store(out + row * cols + c, _round(silu * u, out.dtype.element_ty, BY_HAND), mask=mask)


class TritonOps:
    """RMSNorm (+ residual), RoPE and SiLU-and-multiply in Triton; argmax in torch (one launch already)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += residual (in place, when given), then RMSNorm(x) as a new tensor. x: [rows, hidden]."""
        rows, cols = x.shape
        out = torch.empty_like(x)
        if rows:
            _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual.contiguous(), weight, out, cols, eps,
                                          HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                                          BY_HAND=INTERPRET)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * n] -> silu(gate) * up [rows, n]."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(width // 2))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up.contiguous(), out, width // 2,
                                                                     BLOCK=block, BY_HAND=INTERPRET)
        return out

    def rope(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor | None:
        """Rotate the first num_heads heads of each row of qkv [rows, width] in place."""
        if qkv.stride(-1) != 1 or head_dim % 2:
            return None
        rows = qkv.shape[0]
        if rows:
            half = head_dim // 2
            _rope_kernel[(rows,)](qkv, qkv.stride(0), cos.contiguous(), sin.contiguous(), num_heads, head_dim,
                                  HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                  HEADS_PAD=triton.next_power_of_2(num_heads), BY_HAND=INTERPRET)
        return qkv

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def candidates(self, logits: torch.Tensor, index: torch.Tensor | None, inverse_t: torch.Tensor,
                   want_z: torch.Tensor | None, cut: int) -> None:
        return None  # the sampler's torch ops run on the GPU as they are

    def mask_tokens(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> bool:
        return False  # the grammar's own unpacking, on the device
