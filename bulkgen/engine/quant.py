"""Quantized linear layers: `--quantization int8`.

Weights are quantized once at load to int8 per output channel (symmetric: w ≈ scale[n] q[n, k], q in
[-127, 127]); a step's activations per block of 32 values (x ≈ d[m, b] p[m, k], the same rule, as llama.cpp's
Q8_0: per token instead, SmolLM2's outlier channels cost 4 % of perplexity, per block 0.6 %); each block's
dot product runs in integers (exact), y[m, n] = scale[n] sum_b d[m, b] sum_{k in b} p[m, k] q[n, k] (+ bias),
and a request's outputs never depend on what it shares a step with. The product is our C kernel
(cpu/csrc/qgemm.c: AVX512-VNNI, AVX-VNNI or AVX2, whichever the CPU has, else plain C); without the C kernels,
the same quantization with the products in float (torch). Embeddings, norms and the LM head stay in the
model's float dtype (the head's error would reach every logit).

Weights take a quarter of their float32 bytes (half of bfloat16's); the distance from the exact path is
measured in BENCHMARKS.md (tools/quant_quality.py: perplexity and greedy agreement on SmolLM2-135M).
"""

from __future__ import annotations

from typing import Any

import torch

from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.cpu.machine import release_freed_memory
from bulkgen.engine.cpu.ops import DTYPE_CODES
from bulkgen.engine.layers import fused_bias

QMAX = 127
BLOCK = 32  # activations are quantized per block of this many values (qgemm.c's QB)
VALUES_AT_ONCE = 1 << 22  # quantize_weight's values a pass: its float32 temporaries take 16 MB each


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q int8 [..., K], scale float32 [..., 1]) with x ≈ scale * q per row: scale =
    max|x| / 127 (1 for a row of zeros), q = round-half-even(x / scale)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight [N, K] quantized per output channel (quantize_rows, a few rows a pass, so that its
    float temporaries stay small: the same values): (q int8 [N, K], scale float32 [N])."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    rows = max(1, VALUES_AT_ONCE // max(k, 1))
    for row in range(0, n, rows):
        part_q, part_scale = quantize_rows(w[row:row + rows].detach())
        q[row:row + rows], scale[row:row + rows] = part_q, part_scale[:, 0]
    return q, scale


def quantized_activations(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] float32 as the C kernels see them: quantized per block of 32 (zero-padded) and back, dp."""
    k = rows.shape[-1]
    blocks = torch.nn.functional.pad(rows, (0, -k % BLOCK)).view(rows.shape[0], -1, BLOCK)
    p, d = quantize_rows(blocks)
    return (p.float() * d).view(rows.shape[0], -1)[:, :k]


class Int8Linear:
    """y = x W^T + b with W in int8 per output channel and x quantized per block of 32 at each call (module
    doc): through our C kernel where given (`kernel`), else in torch. weight: the float weight, quantized here;
    or, with its scale, quantized already (quantize_weight's q and scale)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernels | None = None,
                 scale: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_weight(weight) if scale is None else (weight, scale)
        self.scale = scale.float().reshape(-1).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kernel = kernel if kernel is not None and weight.device.type == "cpu" else None
        if self.kernel is not None:
            n, k = q.shape
            self.weight = torch.empty(self.kernel.qlinear_packed_size(N=n, K=k), dtype=torch.uint8)
            self.kernel.pack_qlinear(w=q.contiguous().data_ptr(), N=n, K=k, out=self.weight.data_ptr(),
                                     num_threads=torch.get_num_threads())
        else:
            self.weight = q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return self._torch(x)
        if x.dtype not in DTYPE_CODES:  # float16: the kernel reads float32 (the same quantized blocks)
            return self(x.float()).to(x.dtype)
        x = x.contiguous()
        y = x.new_empty(*x.shape[:-1], self.out_features)
        self.kernel.qlinear(x=x.data_ptr(), M=x.numel() // self.in_features, K=self.in_features,
                            dtype=DTYPE_CODES[x.dtype], packed=self.weight.data_ptr(), N=self.out_features,
                            scale=self.scale.data_ptr(), bias=None if self.bias is None else self.bias.data_ptr(),
                            y=y.data_ptr(), num_threads=torch.get_num_threads())
        return y

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same quantization, the products in float32 (no C kernels: a GPU, or no compiler)."""
        x_q = quantized_activations(x.reshape(-1, self.in_features).float())
        y = torch.nn.functional.linear(x_q, self.weight.float() * self.scale[:, None], self.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class SiluMulAfter:
    """The MLP's input, silu(x Wg^T) * (x Wu^T), as one product of the fused weights (int8 or GGUF blocks), then
    the small ops' silu_mul."""

    def __init__(self, linear: Any, ops: Any) -> None:
        self.linear, self.ops = linear, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(self.linear(x))


class Int8GatedLinear(SiluMulAfter):
    """The gate's and up's weights fused in one Int8Linear. Through our C kernel (where the intermediate size is
    a multiple of its panels' 32), one pass: each panel's gate and up sums meet in cache and leave as the
    activation, the same bits as the product then silu_mul; otherwise SiluMulAfter."""

    def __init__(self, gate: torch.nn.Module, up: torch.nn.Module, ops: Any, kernel: Kernels | None = None) -> None:
        super().__init__(int8_linear(gate, up, kernel=kernel), ops)
        self.out_features = gate.out_features
        self.one_pass = self.linear.kernel is not None and bool(self.linear.kernel.qlinear_silu_mul_takes(
            N=self.out_features))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if not self.one_pass or x.dtype not in DTYPE_CODES:
            return super().__call__(x)
        x = x.contiguous()
        y = x.new_empty(*x.shape[:-1], self.out_features)
        linear.kernel.qlinear_silu_mul(x=x.data_ptr(), M=x.numel() // linear.in_features, K=linear.in_features,
                                       dtype=DTYPE_CODES[x.dtype], packed=linear.weight.data_ptr(),
                                       N=self.out_features, scale=linear.scale.data_ptr(), bias=None,
                                       y=y.data_ptr(), num_threads=torch.get_num_threads())
        return y


class QuantizedLinear(torch.nn.Module):
    """An nn.Linear as the int8 load leaves it (int8_load.py): its weight quantized (quantize_weight) but not
    yet packed for the kernels, its bias as loaded. The runner makes it an Int8Linear (int8_linear: the lean
    forward fuses q, k and v, gate and up; quantize_linears for Hugging Face's modules) before any step."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q, persistent=False)  # buffers: they move with the model, counted in its bytes
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the same product in torch (no step runs it)
        return int8_linear(self)(x)


def int8_linear(*linears: torch.nn.Linear | QuantizedLinear, kernel: Kernels | None = None) -> Int8Linear:
    """One Int8Linear over linear layers' outputs (q, k, v; gate, up; or one layer), float ones quantized here:
    per output channel, so stacking the quantized rows equals quantizing the stacked weight."""
    parts = [(m.q, m.scale) if isinstance(m, QuantizedLinear) else quantize_weight(m.weight) for m in linears]
    q, scale = (parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return Int8Linear(q, fused_bias(*linears), kernel, scale=scale)


class Int8Module(torch.nn.Module):
    """An nn.Linear whose product runs as Int8Linear, for models run through Hugging Face's modules."""

    def __init__(self, linear: torch.nn.Linear | QuantizedLinear, kernel: Kernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = int8_linear(linear, kernel=kernel)
        self.register_buffer("weight_q", self.linear.weight, persistent=False)  # counted with the model's bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def quantize_linears(model: torch.nn.Module, kernel: Kernels | None = None) -> int:
    """Swap every nn.Linear of a model run through Hugging Face's modules (and every QuantizedLinear of the int8
    load) for an Int8Module, the output head excepted. Returns how many were swapped."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) in (torch.nn.Linear, QuantizedLinear) and child is not head]
    count = len(swaps)
    while swaps:
        parent, name, child = swaps.pop()
        setattr(parent, name, Int8Module(child, kernel))
        del child
        release_freed_memory()  # the weight it replaced, now: the heap would keep it until the last swap
    return count
