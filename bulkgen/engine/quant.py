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
from bulkgen.engine.cpu.ops import DTYPE_CODES
from bulkgen.engine.layers import fused_weight

QMAX = 127
BLOCK = 32  # activations are quantized per block of this many values (qgemm.c's QB)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q int8 [..., K], scale float32 [..., 1]) with x ≈ scale * q per row: scale =
    max|x| / 127 (1 for a row of zeros), q = round-half-even(x / scale)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantized_activations(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] float32 as the C kernels see them: quantized per block of 32 (zero-padded) and back, dp."""
    k = rows.shape[-1]
    blocks = torch.nn.functional.pad(rows, (0, -k % BLOCK)).view(rows.shape[0], -1, BLOCK)
    p, d = quantize_rows(blocks)
    return (p.float() * d).view(rows.shape[0], -1)[:, :k]


class Int8Linear:
    """y = x W^T + b with W in int8 per output channel and x quantized per block of 32 at each call (module
    doc): through our C kernel where given (`kernel`), else in torch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernels | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows(weight.detach())
        self.scale = scale.reshape(-1).contiguous()
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

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, ops: Any, kernel: Kernels | None = None) -> None:
        super().__init__(Int8Linear(fused_weight(gate, up)[0], None, kernel), ops)
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


class Int8Module(torch.nn.Module):
    """An nn.Linear whose product runs as Int8Linear, for models run through Hugging Face's modules."""

    def __init__(self, linear: torch.nn.Linear, kernel: Kernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = Int8Linear(linear.weight, linear.bias, kernel)
        self.register_buffer("weight_q", self.linear.weight, persistent=False)  # counted with the model's bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def quantize_linears(model: torch.nn.Module, kernel: Kernels | None = None) -> int:
    """Swap every nn.Linear of a model run through Hugging Face's modules for an Int8Module, the output
    head excepted. Returns how many were swapped."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child is not head]
    for parent, name, child in swaps:
        setattr(parent, name, Int8Module(child, kernel))
    return len(swaps)
