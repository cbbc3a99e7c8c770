"""The C linear layer with and without its panel prefetch, the weights in DRAM (copies cycled), beside oneDNN.

    python tools/gemm_prefetch.py "FLAGS" [DTYPE]      # e.g. "-mno-avx512f" float32 (the AVX2 kind); "" native

Milliseconds a call, best of three passes over the copies, at 1, 16, 36 and 132 rows (BENCHMARKS.md, issue 38).
"""

from __future__ import annotations

import sys
import time

import torch

from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.layers import Linear

N, K, COPIES, ROWS = 16384, 2048, 12, (1, 16, 36, 132)  # the 1B shape's gate+up


def timed(layers: list[Linear], rows: int, dtype: torch.dtype) -> float:
    x = torch.randn(rows, K).to(dtype)
    for layer in layers[:2]:
        layer(x)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for layer in layers:
            layer(x)
        best = min(best, (time.perf_counter() - started) / len(layers))
    return best * 1e3


def main() -> None:
    flags = tuple(sys.argv[1].split()) if len(sys.argv) > 1 else ()
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    torch.set_num_threads(2)
    weights = [torch.randn(N, K).to(dtype) * 0.02 for _ in range(COPIES)]
    results = {}
    for name, extra in (("prefetch", ()), ("none", ("-DPREFETCH_ROWS=0",))):
        kernel = load_cpu_kernels((*flags, *extra))
        if kernel is None or not kernel.linear_takes(dtype, K):
            raise SystemExit(f"the C linear layers do not run {dtype} with flags {flags + extra} here")
        results[name] = [timed([Linear(w, None, True, kernel) for w in weights], rows, dtype) for rows in ROWS]
    results["oneDNN"] = [timed([Linear(w, None, True, None) for w in weights], rows, dtype) for rows in ROWS]
    print(f"flags {flags} {dtype}: ms a call at rows {'/'.join(map(str, ROWS))}")
    for name, times in results.items():
        print(f"  {name:9s}", " ".join(f"{t:7.2f}" for t in times))


if __name__ == "__main__":
    main()
