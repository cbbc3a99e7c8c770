"""One quantized linear layer's speed, GOP/s, per kernel build: --quantization int8's Int8Linear and each GGUF
block format's BlockLinear (random weights), beside our C bfloat16 GEMM (where the CPU has its products: what
--quantization none runs there) and torch's bfloat16 and float32 nn.Linear, at a few row counts.

    python tools/quant_layers.py                                   # the build the engine uses here
    python tools/quant_layers.py --cflags "-mno-avx512f -mno-avxvnni"   # the AVX2 kernels (AMD Zen 3's)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bulkgen.engine.blocks import BlockLinear, Blocks, _Part
from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.layers import Linear, kernel_takes
from bulkgen.engine.quant import Int8Linear

ROWS = (4, 36, 128, 512)


def _blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> Blocks:
    """Random blocks of a format: every u and scale drawn (the speed does not depend on the values)."""
    top = {"Q8_0": 256, "Q6_K": 64}.get(kind, 16)
    u = rng.integers(0, top, (n, k)).astype(np.uint8)
    per = 16 if kind == "Q6_K" else 32
    half = (rng.random((n, k // per)) * 0.01).astype(np.float16).view(np.uint16)
    if kind in ("Q8_0", "Q4_0"):
        return Blocks(kind, u, half)
    if kind == "Q4_1":
        return Blocks(kind, u, half, half.copy())
    d = (rng.random((n, k // 256)) * 0.01).astype(np.float32)
    sc = rng.integers(0, 64, (n, k // per)).astype(np.uint8)
    return Blocks(kind, u, d, d.copy(), sc, sc.copy()) if kind == "Q4_K" else Blocks(kind, u, d, sc=sc)


def _rate(layer, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> list[float]:
    out = []
    for m in ROWS:
        x = torch.randn(m, k, dtype=dtype)
        with torch.no_grad():
            layer(x)
            start = time.perf_counter()
            for _ in range(reps):
                layer(x)
        out.append(2 * m * n * k * reps / (time.perf_counter() - start) / 1e9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cflags", default="", help="more compiler flags for the kernels' build")
    parser.add_argument("--shape", default="2048x2048", help="N x K of the weight (K a multiple of 256)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    kernel = load_cpu_kernels(tuple(args.cflags.split()))
    rng = np.random.default_rng(0)
    print(f"{args.cflags or 'native build'}; GOP/s at {', '.join(map(str, ROWS))} rows, {n} x {k}, bfloat16 in")
    weight = torch.randn(n, k) * 0.05
    rows = {"int8": Int8Linear(weight, None, kernel)}
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        rows[kind] = BlockLinear([_Part(_blocks(kind, n, k, rng), kernel)], None)
    for name, layer in rows.items():
        print(f"{name:10s}", " / ".join(f"{r:.0f}" for r in _rate(layer, k, n, torch.bfloat16)))
    if kernel_takes(kernel, weight.bfloat16()):  # our C bfloat16 GEMM, what --quantization none runs here
        print(f"{'C bfloat16':10s}", " / ".join(f"{r:.0f}" for r in _rate(Linear(weight.bfloat16(), None, True, kernel),
                                                                          k, n, torch.bfloat16)))
    for dtype in (torch.bfloat16, torch.float32):
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        print(f"{'torch ' + str(dtype)[6:]:10s}", " / ".join(f"{r:.0f}" for r in _rate(linear, k, n, dtype)))


if __name__ == "__main__":
    main()
