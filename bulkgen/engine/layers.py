"""The model's layers as bulkgen runs them on its weights: linear layers (our C GEMM, oneDNN's packed
layout, or torch's), the gated MLP input, and the torch reference of the small ops (Hugging Face's own
math). The lean Llama forward (llama.py) is built of these; a model run through Hugging Face's modules
has its nn.Linear layers swapped for PackedLinear, the same linear layer as a module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bulkgen.engine.cpu.kernels import Kernels


class Linear:
    """y = x W^T + b. On CPU, given the C kernels (`kernel`; whether to is measured per machine, see
    paths.py): float32, and bfloat16 where the CPU has AVX512-BF16, through our C GEMM (weights packed
    once into its panels; 1.3-2x oneDNN for the few rows of a decode step); otherwise through oneDNN with
    the weight reordered once (a third faster than nn.Linear's MKL path) where oneDNN has the dtype;
    elsewhere torch's linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
                 kernel: Kernels | None = None) -> None:
        on_cpu = weight.device.type == "cpu"
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel if pack and kernel_takes(kernel, weight) else None
        self.packed = pack and on_cpu and self.kernel is None and onednn_takes(weight.dtype)
        self.bias = bias
        if self.kernel is not None:
            self.dtype = weight.dtype
            self._linear = self.kernel.typed("linear", weight.dtype)
            self.weight = pack_weight(self.kernel, weight)
            self.bias = None if bias is None else bias.contiguous()
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if x.dtype != self.dtype:
                raise TypeError(f"linear layer in {self.dtype} got {x.dtype} input")
            x = x.contiguous()
            y = x.new_empty(*x.shape[:-1], self.out_features)
            self._linear(x=x.data_ptr(), M=x.numel() // self.in_features, K=self.in_features,
                         packed=self.weight.data_ptr(), N=self.out_features,
                         bias=None if self.bias is None else self.bias.data_ptr(), y=y.data_ptr(),
                         num_threads=torch.get_num_threads())
            return y
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear layer runs this dtype on this CPU: float32 wherever oneDNN is built in;
    bfloat16 only where torch says oneDNN supports it (AVX-512 or AVX-NE-CONVERT: elsewhere reordering the
    weight raises); float16 never (torch's own path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernel_takes(kernel: Kernels | None, weight: torch.Tensor) -> bool:
    """Whether our C linear layers run this weight: float32, and bfloat16 on AMX tiles or AVX512-BF16."""
    return kernel is not None and weight.device.type == "cpu" and kernel.linear_takes(weight.dtype, weight.shape[1])


def pack_weight(kernel: Kernels, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the C linear layers' panels."""
    pack = kernel.typed("pack_linear", weight.dtype)
    n, k = weight.shape
    out = torch.empty(kernel.packed_size(weight.dtype, N=n, K=k), dtype=weight.dtype)
    pack(w=weight.contiguous().data_ptr(), N=n, K=k, out=out.data_ptr(), num_threads=torch.get_num_threads())
    return out


class GatedLinear:
    """The MLP's input: silu(x Wg^T) * (x Wu^T). With our C linear layers, one pass: the tiles of the
    gate and of the up projection for the same columns meet in cache and leave as the activation, so the
    [rows, 2 × intermediate] product is never written out and read back (the same bits as the two steps).
    Otherwise one fused linear layer, then Ops.silu_mul."""

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, pack: bool, kernel: Kernels | None,
                 ops: Any) -> None:
        self.ops = ops
        self.in_features, self.out_features = gate.in_features, gate.out_features
        self.linear: Linear | None = None
        if pack and gate.bias is None and up.bias is None and kernel_takes(kernel, gate.weight):
            self.dtype = gate.weight.dtype
            self.weight = torch.cat([pack_weight(kernel, lin.weight.detach()) for lin in (gate, up)])
            self._function = kernel.typed("linear_silu_mul", self.dtype)
        else:
            self.linear = fused(gate, up, pack=pack, kernel=kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.ops.silu_mul(self.linear(x))
        if x.dtype != self.dtype:
            raise TypeError(f"linear layer in {self.dtype} got {x.dtype} input")
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        self._function(x=x.data_ptr(), M=x.numel() // self.in_features, K=self.in_features,
                       packed=self.weight.data_ptr(), n=self.out_features, out=out.data_ptr(),
                       num_threads=torch.get_num_threads())
        return out


def fused(*linears: torch.nn.Linear, pack: bool, kernel: Kernels | None = None) -> Linear:
    return Linear(*fused_weight(*linears), pack, kernel)


def fused_weight(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear layers' weights stacked into one, and their biases (fused_bias)."""
    return torch.cat([lin.weight.detach() for lin in linears]), fused_bias(*linears)


def fused_bias(*linears: torch.nn.Module) -> torch.Tensor | None:
    """Linear layers' biases stacked into one (zeros for those without; None where none has one)."""
    biases = [lin.bias for lin in linears]
    like = next((b for b in biases if b is not None), None)
    if like is None:
        return None
    return torch.cat([b.detach() if b is not None else like.new_zeros(lin.out_features)
                      for b, lin in zip(biases, linears, strict=True)])


class PackedLinear(torch.nn.Module):
    """An nn.Linear whose weight oneDNN has reordered once into its blocked layout (Linear with pack=True):
    on CPU its GEMMs run about a third faster than the same nn.Linear (200 vs 150 GFLOP/s in float32 on 2
    cores at 64 rows, 400 vs 270 in bfloat16), with results equal up to the order of the float additions."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), pack=True)
        # kept as the module's parameters too, so that counting and moving the model's weights sees them
        self.weight = torch.nn.Parameter(self.linear.weight, requires_grad=False)
        self.bias = None if self.linear.bias is None else torch.nn.Parameter(self.linear.bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear of the model for a PackedLinear (CPU only). Returns how many were swapped;
    0 where this torch's oneDNN does not take the model's dtype."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and onednn_takes(child.weight.dtype)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb for one of q, k: x [tokens, heads, head_dim], cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
