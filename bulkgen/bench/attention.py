"""Decode attention alone on a paged cache, with the bytes it must read counted: the achieved memory bandwidth
of the Triton decode kernel (`.ci/gpu-check`'s second stage; on a CPU, under Triton's interpreter, a rehearsal
of small sizes).

    python -m bulkgen.bench.attention OUT.json [--seqs 256 --context 1024 --dtype bfloat16]

Llama-3.1-8B's heads (32 query, 8 KV, head dim 128), 16-token blocks scattered over the cache; the bytes are
K and V of every sequence's context (the queries and outputs are noise beside them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def decode_bandwidth(num_seqs: int, context: int, dtype: str = "bfloat16", num_heads: int = 32, num_kv_heads: int = 8,
                     head_dim: int = 128, block_size: int = 16, reps: int = 20) -> dict[str, Any]:
    import torch

    from bulkgen.engine.gpu import attention  # here: triton is optional

    device = torch.device("cuda" if torch.cuda.is_available() and not attention.INTERPRET else "cpu")
    torch_dtype = getattr(torch, dtype)
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, device=device, generator=generator).to(torch_dtype)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device=device, generator=generator).view(num_seqs, blocks_per_seq).int()
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs, num_heads, head_dim, device=device, generator=generator).to(torch_dtype)
    splits = attention.decode_splits(num_seqs, num_kv_heads, blocks_per_seq)  # as a step chooses them

    def run() -> object:
        return attention.decode(q, k, v, tables, lens, head_dim**-0.5, splits)

    seconds = _timed(run, reps, device)
    read = 2 * num_seqs * context * num_kv_heads * head_dim * k.element_size()
    return {"num_seqs": num_seqs, "context": context, "dtype": dtype, "heads": [num_heads, num_kv_heads, head_dim],
            "block_size": block_size, "splits": splits, "device": str(device), "ms": seconds * 1e3,
            "bytes_read": read, "gb_per_s": read / seconds / 1e9}


def _timed(fn: Any, reps: int, device: Any) -> float:
    """Median seconds of one call, after a warm-up call (the compile)."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    result = decode_bandwidth(args.seqs, args.context, args.dtype, reps=args.reps)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"decode attention: {result['num_seqs']} sequences x {result['context']} tokens, {result['dtype']}, "
          f"{result['splits']} split(s): {result['ms']:.3f} ms, {result['bytes_read'] / 1e9:.3f} GB read, "
          f"{result['gb_per_s']:.1f} GB/s")


if __name__ == "__main__":
    main()
