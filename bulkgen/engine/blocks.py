"""Linear layers on a GGUF file's own blocks: `--quantization gguf` (loaded by engine/gguf_load.py).

A GGUF file's linear weights in Q8_0, Q4_0, Q4_1, Q4_K or Q6_K stay in their blocks, repacked once at load for
cpu/csrc/qblocks.c at about the file's size. Each block is decoded here to unsigned integers u and its scales,
w = s u + m (the C file's comment has every format's s and m); a step's activations are quantized per block of
32 (as --quantization int8 and llama.cpp's Q8_0) and every block's product runs in integers, its scales applied
in float32. Without the C kernels (a GPU, no compiler) the same math runs in torch on the decoded blocks.
A layer may be made of parts of several types (a fused q/k/v where a Q4_K_M file holds v in Q6_K), or of float
weights where the file holds them unquantized.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.cpu.ops import DTYPE_CODES
from bulkgen.engine.quant import quantized_activations

FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4}  # qblocks.c's FORMATS
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}  # the file's, a block
BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256}
ZERO = {"Q8_0": 128, "Q4_0": 8, "Q6_K": 32}  # w = s (u - zero); Q4_1 and Q4_K keep a minimum m instead


@dataclass
class Blocks:
    """One weight [N, K] decoded from its GGUF blocks: u [N, K] uint8, and the scales as the format holds them
    (s: fp16 [N, K / 32] for Q8_0, Q4_0, Q4_1, else the superblocks' fp32 d [N, K / 256]; m: Q4_1's fp16 minima,
    or Q4_K's fp32 dmin; sc, mn: the K-quants' integer scales (and minima) a block of 32 (16 for Q6_K))."""

    kind: str
    u: np.ndarray
    s: np.ndarray
    m: np.ndarray | None = None
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.u.shape[0], self.u.shape[1]

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        """Every block's s and m as float32 [N, K / block], in qblocks.c's arithmetic."""
        if self.sc is None:
            s = self.s.view(np.float16).astype(np.float32)
            m = self.m.view(np.float16).astype(np.float32) if self.m is not None else s * np.float32(-ZERO[self.kind])
            return s, m
        per = self.sc.shape[1] // self.s.shape[1]
        sc = self.sc.view(np.int8) if self.kind == "Q6_K" else self.sc
        s = np.repeat(self.s, per, axis=1) * sc.astype(np.float32)
        if self.mn is None:
            return s, s * np.float32(-ZERO[self.kind])
        return s, np.float32(0) - np.repeat(self.m, per, axis=1) * self.mn.astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """The weight in float32: s (u - zero), or s u + m, as the gguf package computes it."""
        s, m = self.scales()
        n, k = self.shape
        u = self.u.reshape(n, s.shape[1], -1)
        if self.kind in ZERO:
            w = s[..., None] * (u.astype(np.float32) - np.float32(ZERO[self.kind]))
        else:
            w = s[..., None] * u.astype(np.float32) + m[..., None]
        return w.reshape(n, k)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """The 2 bytes at the end of raw [..., 2] as uint16 (fp16 bits)."""
    return np.ascontiguousarray(raw).view(np.uint16)[..., 0]


def decode(raw: np.ndarray, kind: str, k: int) -> Blocks:
    """A weight's GGUF rows raw [N, row bytes] (uint8) of type `kind` -> Blocks."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])
    if kind == "Q8_0":
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(kind, u.reshape(n, k), _fp16(b[..., :2]))
    if kind in ("Q4_0", "Q4_1"):
        qs = b[..., 2 if kind == "Q4_0" else 4:]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
        return Blocks(kind, u, _fp16(b[..., :2]), _fp16(b[..., 2:4]) if kind == "Q4_1" else None)
    if kind == "Q4_K":
        d = _fp16(b[..., 0:2]).view(np.float16).astype(np.float32)
        dmin = _fp16(b[..., 2:4]).view(np.float16).astype(np.float32)
        low, high, mixed = b[..., 4:8], b[..., 8:12], b[..., 12:16]  # 6-bit scales and minima of 8 blocks
        sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 2) & 48)], axis=-1)
        mn = np.concatenate([high & 63, (mixed >> 4) | ((high >> 2) & 48)], axis=-1)
        qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        u = (qs & 15).reshape(n, k)
        return Blocks(kind, u, d, dmin, sc.reshape(n, -1), mn.reshape(n, -1))
    if kind == "Q6_K":
        low = b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        high = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        u = ((low & 15).reshape(n, -1, 8, 32) | ((high & 3).reshape(n, -1, 8, 32) << 4)).reshape(n, k)
        d = _fp16(b[..., 208:210]).view(np.float16).astype(np.float32)
        return Blocks(kind, u, d, sc=np.ascontiguousarray(b[..., 192:208]).reshape(n, -1))
    raise ValueError(f"no block decoder for {kind}")


class _Part:
    """Some of a layer's outputs: blocks packed for the C kernel (or decoded, for torch), or float weights."""

    def __init__(self, weight: Blocks | torch.Tensor, kernel: Kernels | None) -> None:
        self.blocks = isinstance(weight, Blocks)
        self.kind = weight.kind if isinstance(weight, Blocks) else str(weight.dtype).removeprefix("torch.")
        self.n, self.k = weight.shape
        self.kernel = kernel if self.blocks and kernel is not None and kernel.qblocks_takes(
            fmt=FORMATS[self.kind], K=self.k) else None
        self.s = self.m = None
        if isinstance(weight, torch.Tensor):
            self.weight = weight.detach()
        elif self.kernel is not None:
            self.weight = _pack(weight, self.kernel)
        else:  # torch: u and each block's float s and m
            s, m = weight.scales()
            self.weight = torch.from_numpy(np.ascontiguousarray(weight.u))
            self.s, self.m = torch.from_numpy(s), torch.from_numpy(m)

    def joins(self, other: _Part) -> bool:
        """Whether other's rows can follow this part's in one part (packed panels: whole panels only)."""
        return (other.kind, other.blocks, other.k, other.kernel) == (self.kind, self.blocks, self.k, self.kernel) \
            and (self.kernel is None or self.n % PANEL == 0)

    def join(self, other: _Part) -> None:
        self.weight = torch.cat([self.weight, other.weight])
        if self.s is not None:
            self.s, self.m = torch.cat([self.s, other.s]), torch.cat([self.m, other.m])
        self.n += other.n

    def float_weight(self) -> torch.Tensor:
        """The part's weight in float32 (torch's path)."""
        if not self.blocks:
            return self.weight.float()
        u = self.weight.view(self.n, self.s.shape[1], -1).float()
        if self.kind in ZERO:
            return (self.s[..., None] * (u - ZERO[self.kind])).view(self.n, self.k)
        return (self.s[..., None] * u + self.m[..., None]).view(self.n, self.k)


PANEL = 32  # outputs a packed panel (qblocks.c's QNR)


def _pack(blocks: Blocks, kernel: Kernels) -> torch.Tensor:
    n, k = blocks.shape
    fmt = FORMATS[blocks.kind]
    out = torch.empty(kernel.qblocks_packed_size(fmt=fmt, N=n, K=k), dtype=torch.uint8)
    arrays = [None if a is None else np.ascontiguousarray(a) for a in (blocks.u, blocks.s, blocks.m, blocks.sc,
                                                                        blocks.mn)]
    u, s, m, sc, mn = (None if a is None else a.ctypes.data for a in arrays)
    kernel.pack_qblocks(fmt=fmt, u=u, N=n, K=k, s=s, m=m, sc=sc, mn=mn, out=out.data_ptr(),
                        num_threads=torch.get_num_threads())
    return out


class BlockLinear:
    """y = x W^T + b with W's rows in parts (GGUF blocks, or float), concatenated: through qblocks.c where the
    parts are packed for it, else torch."""

    def __init__(self, parts: list[_Part], bias: torch.Tensor | None) -> None:
        self.parts: list[_Part] = []
        for part in parts:
            if self.parts and self.parts[-1].joins(part):
                self.parts[-1].join(part)
            else:
                self.parts.append(part)
        self.in_features = self.parts[0].k
        self.out_features = sum(p.n for p in self.parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def kinds(self) -> list[str]:
        return [p.kind for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if any(p.kernel is None for p in self.parts) or x.dtype not in DTYPE_CODES or x.device.type != "cpu":
            return self._torch(x)
        x = x.contiguous()
        y = x.new_empty(*x.shape[:-1], self.out_features)
        rows, col = x.numel() // self.in_features, 0
        for part in self.parts:
            part.kernel.qblocks_linear(
                fmt=FORMATS[part.kind], x=x.data_ptr(), M=rows, K=self.in_features, dtype=DTYPE_CODES[x.dtype],
                packed=part.weight.data_ptr(), N=part.n,
                bias=None if self.bias is None else self.bias.data_ptr() + 4 * col,
                y=y.data_ptr() + y.element_size() * col, ldy=self.out_features, num_threads=torch.get_num_threads())
            col += part.n
        return y

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same math in float32: the activations quantized per block of 32 where the weights are blocks."""
        rows = x.reshape(-1, self.in_features).float()
        outs = []
        for part in self.parts:
            w = part.float_weight().to(x.device)
            outs.append(torch.nn.functional.linear(quantized_activations(rows) if part.blocks else rows, w))
        y = torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(x.device)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class GGUFLinear(torch.nn.Module):
    """An nn.Linear whose weight is a GGUF file's blocks (or its float weight, where the file holds it so), for
    models run through Hugging Face's modules, and what the lean forward fuses from."""

    def __init__(self, weight: Blocks | torch.Tensor, bias: torch.Tensor | None, kernel: Kernels | None) -> None:
        super().__init__()
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.linear = BlockLinear([_Part(weight, kernel)], bias)
        self.in_features, self.out_features = self.linear.in_features, self.linear.out_features
        for i, part in enumerate(self.linear.parts):  # counted with the model's bytes
            self.register_buffer(f"packed_{i}", part.weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def fused(*modules: GGUFLinear) -> BlockLinear:
    """One BlockLinear over several GGUFLinear layers' outputs (q, k, v; gate, up), their biases concatenated."""
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach().float() if b is not None else torch.zeros(m.out_features)
         for b, m in zip(biases, modules, strict=True)])
    return BlockLinear([copy.copy(p) for m in modules for p in m.linear.parts], bias)
